"""The engine on a CUDA GPU: decode and prefill speed against the memory-bandwidth ceiling.

For each model (random weights in bfloat16, built here from a Llama config: SmolLM2-135M's
shape, and a ~1B one to leave the launch-bound regime):

- single-stream decode tokens/s with CUDA graphs and without (``--enforce-eager``), beside
  the bandwidth ceiling: measured device bandwidth / bytes read per token (every weight
  once, plus the sequence's KV cache at its mean length); and with graphs, without
  asynchronous scheduling and without programmatic dependent launch (``LLMSERVE_PDL=0``),
  each against the defaults;
- the linear kernel on the 1B model's shapes against cuBLAS, replayed from CUDA graphs
  (with and without PDL, and a split weight's parts always in programs of their own);
- aggregate decode tokens/s at batch 1, 8, 64 and 256 (all sequences decoding together);
- prefill tokens/s of one prompt of 512 and of 4096 tokens;
- greedy output identical batched and alone (16 prompts of 1 to 700 tokens).

    python benchmarks/cuda_bench.py --out results.json          # on the GPU machine
    python benchmarks/cuda_bench.py --device cpu --quick         # a smoke run anywhere

The tokenizer comes from ``--tokenizer`` (a saved directory) or the embedded GGUF.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers

from llmserve import envs
from llmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmserve.engine.core import EngineCore
from llmserve.gc_freeze import startup_objects_frozen
from llmserve.layers import triton_launch, triton_linear
from llmserve.sampling_params import SamplingParams

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                    rope_theta=100000.0)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, rope_theta=10000.0)
VOCAB = 49152


def build_model_dir(path: Path, shape: dict, tokenizer_dir: Path | None, seed: int = 0
                    ) -> tuple[Path, int]:
    """config.json, random bfloat16 weights (normal, std 0.02; norms 1) and the tokenizer.
    Returns the directory and the parameter count."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu",
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", **shape}
    (path / "config.json").write_text(json.dumps(cfg))
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    gen = torch.Generator().manual_seed(seed)
    tensors = {"model.embed_tokens.weight": (VOCAB, h), "model.norm.weight": (h,)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter),
                    p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)}
    weights = {name: (torch.ones(shape_) if len(shape_) == 1 else
                      torch.randn(shape_, generator=gen) * 0.02).to(torch.bfloat16)
               for name, shape_ in tensors.items()}
    save_file(weights, str(path / "model.safetensors"))
    if tokenizer_dir is not None:
        from llmserve.tokenizer import Tokenizer

        Tokenizer.from_hf_dir(tokenizer_dir).save(path)
    else:
        from tests.helpers.tiny_models import smollm2_tokenizer

        smollm2_tokenizer().save(path)
    return path, sum(t.numel() for t in weights.values())


def engine(model: Path, device: str, eager: bool, *, max_num_seqs: int = 256,
           prefix_caching: bool = False, kv_gib: float = 8.0,
           async_scheduling: bool | None = None) -> EngineCore:
    return EngineCore(EngineConfig(
        model=ModelConfig(str(model), device, max_model_len=8192, quantization="none",
                          dtype="bfloat16" if device != "cpu" else "float32",
                          enforce_eager=eager),
        cache=CacheConfig(kv_cache_memory_gib=kv_gib, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=max_num_seqs,
                                  async_scheduling=async_scheduling)))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_batch(core: EngineCore, prompts: list[list[int]], max_tokens: int, device: str,
              tag: str) -> dict:
    """All prompts at once; times the steps after every request has its first token."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, params)
    tokens: dict[str, list[int]] = {}
    decode_tokens, decode_start, first_step = 0, None, None
    # The collector as in the server's engine process: else its collections walk this
    # process's every object in the timed steps (seen as ~3 ms a step at 256 sequences).
    with startup_objects_frozen("cuda_bench"):
        sync(device)
        start = time.perf_counter()
        while core.has_unfinished():
            outs = core.step()
            now = time.perf_counter()
            if first_step is None:
                first_step = now - start
            for o in outs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if decode_start is None:
                if len(tokens) == len(prompts):
                    decode_start = now
            else:
                decode_tokens += sum(len(o.new_token_ids) for o in outs)
        end = time.perf_counter()
    decode_s = end - decode_start if decode_start else float("nan")
    return {"tokens": [tokens[f"{tag}-{i}"] for i in range(len(prompts))],
            "decode_tokens": decode_tokens, "decode_seconds": decode_s,
            "decode_tok_s": decode_tokens / decode_s, "first_step_s": first_step}


def prefill_speed(core: EngineCore, length: int, device: str, repeats: int = 3) -> float:
    """Tokens/s of one prompt's prefill (the step that returns its first token); best of
    ``repeats`` after a warm-up (prefix caching is off)."""
    rng = random.Random(length)
    best = float("inf")
    for r in range(repeats + 1):
        prompt = [rng.randrange(17, VOCAB) for _ in range(length)]
        core.add_request(f"prefill-{length}-{r}", prompt,
                         SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        sync(device)
        start = time.perf_counter()
        core.step()
        sync(device)
        if r:
            best = min(best, time.perf_counter() - start)
        while core.has_unfinished():
            core.step()
    return length / best


def bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (bytes read plus bytes written)."""
    if not device.startswith("cuda"):
        return float("nan")
    n = 2 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / sorted(times)[len(times) // 2]


def replay_ms(core: EngineCore, device: str, context: int, repeats: int = 100
              ) -> float | None:
    """Milliseconds of the GPU's work in one decode step at batch 1: replays of the batch-1
    graph for ``context`` keys back to back (its inputs as the last step left them)."""
    graphs = core.runner.graphs
    if graphs is None:
        return None
    graph = graphs.graph(1, context)
    graph.replay()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    sync(device)
    return (time.perf_counter() - start) / repeats * 1e3


def profile_decode(core: EngineCore, prompts: list[list[int]], path: Path,
                   steps: int = 200) -> None:
    """cProfile of ``steps`` decode steps of ``prompts`` decoding together, by own time
    (where the host's share of a step goes); appended to ``path``."""
    import cProfile
    import io
    import pstats

    params = SamplingParams(temperature=0, max_tokens=steps + 30, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"profile-{len(prompts)}-{i}", p, params)
    for _ in range(20):
        core.step()
    prof = cProfile.Profile()
    with startup_objects_frozen("cuda_bench"):
        prof.enable()
        for _ in range(steps):
            core.step()
        prof.disable()
    while core.has_unfinished():
        core.step()
    out = io.StringIO()
    out.write(f"{len(prompts)} sequences, {steps} decode steps\n")
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    with path.open("a") as f:
        f.write(out.getvalue())


def linear_table(device: str) -> list[dict]:
    """The Triton linear kernel (with programmatic dependent launch and without) against
    cuBLAS (F.linear) on the 1B model's shapes, by rows: microseconds a call and the
    weight's bytes per second, from a CUDA graph of back-to-back calls over enough copies of
    the weight (at least 256 MB) that L2 (50 MB) holds none of them between its uses."""
    import torch.nn.functional as F

    rows = []
    in_order_tiles = triton_linear.IN_ORDER_TILES
    h, inter = LLAMA_1B["hidden_size"], LLAMA_1B["intermediate_size"]
    for n, k, what in ((3072, h, "qkv"), (h, h, "o"), (2 * inter, h, "gate_up"),
                       (h, inter, "down"), (VOCAB, h, "head")):
        copies = max(2, -(-(256 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
              for _ in range(copies)]
        split = triton_linear.linear_config(n, k)[3] > 1
        for m in (1, 64, 1024, 4096):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            row = {"layer": what, "n": n, "k": k, "m": m}
            variants = [("triton", True, in_order_tiles, triton_linear.linear),
                        ("triton_no_pdl", False, in_order_tiles, triton_linear.linear),
                        ("cublas", False, in_order_tiles, F.linear)]
            if split:  # every part its own program, whatever the rows
                variants.append(("triton_parts", True, 1 << 62, triton_linear.linear))
            for label, pdl, tiles, fn in variants:
                triton_launch.PDL = pdl
                triton_linear.IN_ORDER_TILES = tiles
                for w in ws:  # compiled, counters allocated: before the capture
                    fn(x, w)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for w in ws:
                        fn(x, w)
                graph.replay()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(10):
                    graph.replay()
                torch.cuda.synchronize()
                us = (time.perf_counter() - start) / (10 * copies) * 1e6
                row[label] = us
                row[f"{label}_GBps"] = n * k * 2 / us / 1e3
                del graph
            rows.append(row)
        del ws
    triton_launch.PDL = envs.LLMSERVE_PDL
    triton_linear.IN_ORDER_TILES = in_order_tiles
    return rows


def bench_model(name: str, path: Path, params: int, device: str, bw: float, quick: bool,
                batches: list[int], profile_dir: Path | None = None) -> dict:
    rng = random.Random(0)
    res: dict = {"model": name, "parameters": params}
    decode_len = 32 if quick else 256
    prompt = [rng.randrange(17, VOCAB) for _ in range(128)]
    # Single stream in each mode; the last (the defaults) goes on to the other figures.
    modes = [("eager", {"eager": True}),
             ("graphs_sync", {"eager": False, "async_scheduling": False}),
             ("graphs_no_pdl", {"eager": False, "pdl": False}),
             ("graphs", {"eager": False})]
    for mode, opts in modes:
        eager = opts["eager"]
        triton_launch.PDL = opts.get("pdl", envs.LLMSERVE_PDL)
        core = engine(path, device, eager, async_scheduling=opts.get("async_scheduling"))
        if not eager:
            res[f"graph_capture_s_{mode}"] = core.runner.graphs.capture_seconds \
                if core.runner.graphs else None
        run_batch(core, [prompt], 8, device, "warm")
        single = run_batch(core, [prompt], decode_len, device, f"single-{mode}")
        res[f"single_{mode}"] = single["decode_tok_s"]
        res[f"tokens_{mode}"] = single["tokens"][0]
        res[f"steps_ahead_{mode}"] = core.steps_ahead
        print(f"  {name} single stream, {mode}: {single['decode_tok_s']:.0f} tok/s", flush=True)
        if mode != "graphs":
            if not eager:
                res[f"gpu_step_ms_{mode}"] = replay_ms(core, device, len(prompt) + decode_len)
            del core
            continue
        res["step_ms"] = 1e3 / single["decode_tok_s"]
        res["gpu_step_ms"] = replay_ms(core, device, len(prompt) + decode_len)
        if profile_dir is not None:  # one stream, then as many as the largest batch
            path_ = profile_dir / f"profile-{name}.txt"
            path_.write_text("")
            profile_decode(core, [prompt], path_)
            profile_decode(core, [prompt] * batches[-1], path_, steps=50)
        weight_bytes = core.loaded.weight_bytes
        kv_per_token = core.kv_spec.bytes_per_token
        mean_ctx = 128 + decode_len / 2
        per_token = weight_bytes + kv_per_token * mean_ctx
        res |= {"weight_bytes": weight_bytes, "bytes_per_token": per_token,
                "ceiling_tok_s": bw / per_token, "fraction_of_ceiling":
                res["single_graphs"] / (bw / per_token)}
        res["aggregate"] = {}
        for b in batches:
            prompts = [[rng.randrange(17, VOCAB) for _ in range(64)] for _ in range(b)]
            out = run_batch(core, prompts, 16 if quick else 128, device, f"agg{b}")
            res["aggregate"][b] = out["decode_tok_s"]
            print(f"  {name} batch {b}: {out['decode_tok_s']:.0f} tok/s", flush=True)
        res["prefill"] = {n: prefill_speed(core, n, device) for n in (512, 4096)}
        # Greedy output batched and alone.
        lens = [1, 2, 700] + [rng.randint(1, 700) for _ in range(13)]
        mixed = [[rng.randrange(17, VOCAB) for _ in range(k)] for k in lens]
        together = run_batch(core, mixed, 24, device, "mixed")["tokens"]
        alone = [run_batch(core, [p], 24, device, f"alone{i}")["tokens"][0]
                 for i, p in enumerate(mixed)]
        res["batched_equals_alone"] = together == alone
        res["graph_replays"] = core.runner.graphs.replays if core.runner.graphs else 0
        del core
    triton_launch.PDL = envs.LLMSERVE_PDL
    tokens = [res.pop(f"tokens_{mode}") for mode, _ in modes]
    res["graphs_equal_eager"] = all(t == tokens[0] for t in tokens)  # every mode
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny model, short runs (smoke)")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cuda_bench"))
    ap.add_argument("--models", default="smollm2-135m-shape,llama-1b-shape")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-linear", action="store_true", help="skip the linear-kernel table")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile decode at one stream and at the largest batch "
                         "(profile-MODEL.txt beside --out)")
    args = ap.parse_args()
    device = args.device
    info = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch": torch.__version__}
    if device.startswith("cuda"):
        import triton

        info["triton"] = triton.__version__
    bw = bandwidth(device)
    info["bandwidth_GBps"] = bw / 1e9
    print(json.dumps(info), flush=True)
    if device.startswith("cuda") and not args.no_linear:
        info["linear_us"] = linear_table(device)
        for r in info["linear_us"]:
            parts = (f", parts in parallel {r['triton_parts']:.1f} us" if "triton_parts" in r
                     else "")
            print(f"  linear {r['layer']} m={r['m']}: triton {r['triton']:.1f} us "
                  f"({r['triton_GBps']:.0f} GB/s), without PDL {r['triton_no_pdl']:.1f} us"
                  f"{parts}, cuBLAS {r['cublas']:.1f} us ({r['cublas_GBps']:.0f} GB/s)",
                  flush=True)
    shapes = {"smollm2-135m-shape": SMOLLM2_135M, "llama-1b-shape": LLAMA_1B}
    if args.quick:
        shapes = {"tiny": TINY}
    batches = [1, 8] if args.quick else [1, 8, 64, 256]
    results = {"info": info, "models": []}
    for name, shape in shapes.items():
        if not args.quick and name not in args.models.split(","):
            continue
        t0 = time.perf_counter()
        path, params = build_model_dir(args.workdir / name, shape, args.tokenizer)
        print(f"{name}: {params / 1e6:.0f}M parameters, built in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        res = bench_model(name, path, params, device, bw, args.quick, batches,
                          args.out.parent if args.out and args.profile else None)
        results["models"].append(res)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
        print(json.dumps(res), flush=True)
    print(f"\n{info['device']}, copy bandwidth {info['bandwidth_GBps']:.0f} GB/s")
    print("| model | 1 stream, graphs | eager | graphs/eager | step ms (GPU) | ceiling | "
          "of ceiling | batch 1 / 8 / 64 / 256 | prefill 512 / 4096 | batched = alone |")
    for r in results["models"]:
        agg = " / ".join(f"{v:.0f}" for v in r["aggregate"].values())
        pre = " / ".join(f"{v:.0f}" for v in r["prefill"].values())
        print(f"| {r['model']} | {r['single_graphs']:.0f} | {r['single_eager']:.0f} | "
              f"{r['single_graphs'] / r['single_eager']:.2f}x | {r['step_ms']:.2f} "
              f"({r['gpu_step_ms'] or float('nan'):.2f}) | {r['ceiling_tok_s']:.0f} | "
              f"{r['fraction_of_ceiling']:.0%} | {agg} | {pre} | "
              f"{r['batched_equals_alone']} (graphs = eager: {r['graphs_equal_eager']}) |")
    for r in results["models"]:
        ms = [r.get(k) or float("nan") for k in ("gpu_step_ms_graphs_sync", "gpu_step_ms",
                                                   "gpu_step_ms_graphs_no_pdl")]
        print(f"{r['model']}, 1 stream with graphs: async scheduling off / on "
              f"{r['single_graphs_sync']:.0f} / {r['single_graphs']:.0f} tok/s "
              f"({r['single_graphs'] / r['single_graphs_sync']:.2f}x); programmatic dependent "
              f"launch off / on {r['single_graphs_no_pdl']:.0f} / {r['single_graphs']:.0f} "
              f"tok/s ({r['single_graphs'] / r['single_graphs_no_pdl']:.2f}x); graph replay ms "
              f"sync {ms[0]:.3f}, default {ms[1]:.3f}, no PDL {ms[2]:.3f}")


if __name__ == "__main__":
    main()
