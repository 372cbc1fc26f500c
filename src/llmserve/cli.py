"""Command line: ``llmserve serve | generate | chat | bench | keys | usage``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from llmserve.errors import LLMServeError
from llmserve.models.names import DEFAULT_MODEL
from llmserve.ray_serve.config import ROUTER_NAMES
from llmserve.usage.cli import add_database_args, add_usage_parsers


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["keys"], ["usage"]):  # the operator's commands: no torch to import
        from llmserve.usage.cli import build_parser

        parser = build_parser()
    else:
        parser = _build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (LLMServeError, ValueError) as e:
        message = " ".join(str(e).split())  # always one line
        print(f"llmserve: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description="LLM inference server")
    sub = parser.add_subparsers(dest="command")

    gen = sub.add_parser("generate", help="generate an answer for one prompt and print it")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt (or user message)")
    _add_sampling_args(gen)
    gen.add_argument("--no-chat-template", action="store_true",
                     help="send the prompt as raw text even if the model has a chat template")
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    _add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' (health, ready, metrics stay open)")
    srv.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                     help="the Jinja chat template to use instead of the model's own: a file, "
                          "or the template itself (default: the model's; checked at start)")
    srv.add_argument("--served-model-name", default=None,
                     help="model name in the API (default: the --model value)")
    srv.add_argument("--max-queued-requests", type=int, default=256,
                     help="waiting requests before new ones get 429")
    srv.add_argument("--max-queued-tokens", type=int, default=None,
                     help="waiting prompt tokens before new requests get 429")
    srv.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                     help="end requests that waited or ran longer than this")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="on SIGTERM, time running requests get to finish")
    srv.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    srv.add_argument("--engine-hang-timeout", type=float, default=60.0, metavar="SECONDS",
                     help="restart the engine process if it has work and makes no step for "
                          "this long")
    srv.add_argument("--engine-max-restarts", type=int, default=5,
                     help="exit (code 1) after more engine restarts than this within "
                          "--engine-restart-window")
    srv.add_argument("--engine-restart-window", type=float, default=300.0, metavar="SECONDS")
    srv.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                     help="comma-separated Host header names to answer, or '*' for any "
                          "(default: the loopback names when bound to loopback, else any)")
    srv.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="close connections whose request headers take longer than this")
    srv.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="answer 408 when a request body stalls longer than this")
    add_database_args(srv)
    srv.add_argument("--no-database", action="store_true",
                     help="no usage database: no keys but --api-key, no usage recorded")
    srv.add_argument("--request-log", choices=["off", "metadata", "full"], default="off",
                     help="keep a row per request in the usage database: metadata (key, "
                          "tokens, latency, finish reason) or full (with prompt and output)")
    srv.add_argument("--cost-per-hour", type=float, default=None, metavar="PRICE",
                     help="what the server costs per hour: the console shows the cost per "
                          "1K output tokens from it")
    ray = srv.add_argument_group(
        "replicas on Ray Serve (pip install 'llmserve[ray]')",
        "with --replicas or --min-replicas, the engine runs as Ray Serve replicas behind one "
        "endpoint with the same API; without them, in this process alone, without Ray")
    ray.add_argument("--replicas", type=int, default=None,
                     help="engine replicas (each loads the model once)")
    ray.add_argument("--ray-address", default=None, metavar="ADDRESS",
                     help="an existing Ray cluster ('auto', 'ray://host:10001'; default: start "
                          "a local one)")
    ray.add_argument("--router", choices=ROUTER_NAMES, default="prefix-aware",
                     help="which replica serves a request: in turn, the least loaded, or the "
                          "one that served the longest prefix of its prompt while loads are "
                          "balanced (default)")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0,
                     help="Ray CPUs each replica reserves (its engine's threads)")
    ray.add_argument("--gpus-per-replica", type=float, default=0.0)
    ray.add_argument("--max-ongoing-requests", type=int, default=None,
                     help="requests a replica takes at a time; more wait in the router "
                          "(default: --max-num-seqs + --max-queued-requests)")
    ray.add_argument("--min-replicas", type=int, default=None,
                     help="autoscale on queue depth between --min-replicas and --max-replicas")
    ray.add_argument("--max-replicas", type=int, default=None)
    ray.add_argument("--target-ongoing-requests", type=float, default=16.0,
                     help="autoscaling target: requests in flight per replica")
    ray.add_argument("--upscale-delay", type=float, default=10.0, metavar="SECONDS")
    ray.add_argument("--downscale-delay", type=float, default=60.0, metavar="SECONDS")
    srv.set_defaults(func=_cmd_serve)

    add_usage_parsers(sub)

    from llmserve.bench.cli import add_bench_parser

    add_bench_parser(sub)

    chat = sub.add_parser("chat", help="interactive chat that streams tokens as they come")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.add_argument("--system", default=None, help="system message")
    chat.set_defaults(func=_cmd_chat)
    return parser


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from llmserve.attention.kv_format import KV_CACHE_DTYPE_CHOICES  # imports torch
    from llmserve.config import quantization_choices
    from llmserve.layers.quantization.base import DTYPES, INT4_GROUP_SIZES

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"GGUF file, Hugging Face model directory, or a known name "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1...)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context window (default: the model's)")
    p.add_argument("--quantization", choices=quantization_choices(), default="auto",
                   help="weight format of the decoder layers: int8 (per-channel scales), "
                        "w8a8 (int8 weights and int8 activations: faster at large batches, "
                        "~4%% higher perplexity), int4 (group-wise scales), none (dense "
                        "--dtype); auto: what the file holds (a 4-bit GGUF loads as int4)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of weights kept dense (default: float32 on CPU, bfloat16 on "
                        "CUDA; float16 on CUDA only)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA: run every step eagerly (no CUDA graphs of decode steps)")
    p.add_argument("--int4-group-size", type=int, choices=INT4_GROUP_SIZES, default=32,
                   help="input channels per int4 scale")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default="auto",
                   help="KV cache storage (8-bit formats keep a scale per token and head; "
                        "auto: int8 on CPU for int4/int8/w8a8 weights, else --dtype)")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="memory for the KV cache in GiB (default: on CPU a tenth of "
                        "available RAM, 0.25 to 2 GiB; on CUDA half the free device memory)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 32 on CPU, 16 on CUDA)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--disable-hybrid-kv-cache", action="store_true",
                   help="keep every layer's whole context, sliding-window layers too (one "
                        "block table per request instead of one per KV cache group)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step at most")
    p.add_argument("--scheduling", choices=["continuous", "static"], default="continuous",
                   help="continuous batching, or static batches (a benchmark baseline)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="admission order: first come first served, or by request priority "
                        "(lower first; then arrival)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan each decode step while the one before runs on the device "
                        "(default: on with CUDA; off on CPU, where steps cannot overlap)")
    p.add_argument("--seed", type=int, default=0, help="engine seed")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as JSON like vLLM\'s: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4} or {"method": '
                        '"draft", "model": "PATH", "draft_num_layers": 8}; off by default')


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of the request")


def _engine_config(args: argparse.Namespace):
    from llmserve.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )

    speculative = None
    if args.speculative_config:
        speculative = SpeculativeConfig.from_json(args.speculative_config)
    return EngineConfig(
        model=ModelConfig(args.model, args.device, args.max_model_len,
                          quantization=args.quantization,
                          dtype=args.dtype,
                          enforce_eager=args.enforce_eager,
                          int4_group_size=args.int4_group_size),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_gib=args.kv_cache_memory,
                          enable_prefix_caching=not args.no_prefix_caching,
                          hybrid_kv_cache=not args.disable_hybrid_kv_cache,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, scheduling=args.scheduling,
                                  policy=args.scheduling_policy,
                                  async_scheduling=args.async_scheduling),
        seed=args.seed, speculative=speculative)


def _make_llm(args: argparse.Namespace):
    from llmserve.engine.llm import LLM

    return LLM.from_config(_engine_config(args))


def _cmd_serve(args: argparse.Namespace) -> int:
    engine_config, config, ray_config = serve_configs(args)
    if ray_config is not None:
        try:
            import ray.serve  # noqa: F401
        except ImportError as e:
            raise ValueError(f"--replicas needs Ray Serve ({e}); install it with "
                             "pip install 'llmserve[ray]'") from None
        from llmserve.ray_serve.launcher import serve_on_ray

        return serve_on_ray(engine_config, config, ray_config)
    from llmserve.server.launcher import serve

    return serve(engine_config, config)


def serve_configs(args: argparse.Namespace | Sequence[str]):
    """The configurations ``llmserve serve`` runs with, from its parsed arguments or its
    command line (the Ray Serve application builder reuses it): (EngineConfig,
    ServerConfig, RayServeConfig or None for the single server)."""
    from llmserve.config import ServerConfig
    from llmserve.server.http_guard import parse_allowed_hosts

    if not isinstance(args, argparse.Namespace):
        args = _build_parser().parse_args(["serve", *args])
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                          served_model_name=args.served_model_name,
                          max_queued_requests=args.max_queued_requests,
                          max_queued_tokens=args.max_queued_tokens,
                          request_timeout=args.request_timeout,
                          shutdown_timeout=args.shutdown_timeout,
                          max_body_bytes=args.max_body_bytes,
                          engine_hang_timeout=args.engine_hang_timeout,
                          engine_max_restarts=args.engine_max_restarts,
                          engine_restart_window=args.engine_restart_window,
                          allowed_hosts=parse_allowed_hosts(args.allowed_hosts, args.host),
                          header_timeout=args.header_timeout,
                          body_timeout=args.body_timeout,
                          use_database=not args.no_database, data_dir=args.data_dir,
                          database_url=args.database_url, request_log=args.request_log,
                          cost_per_hour=args.cost_per_hour,
                          chat_template=args.chat_template)
    ray_config = None
    if args.replicas is not None or args.min_replicas is not None:
        from llmserve.ray_serve.config import RayServeConfig

        ray_config = RayServeConfig(
            replicas=args.replicas if args.replicas is not None else args.min_replicas,
            address=args.ray_address,
            router=args.router, cpus_per_replica=args.cpus_per_replica,
            gpus_per_replica=args.gpus_per_replica,
            max_ongoing_requests=args.max_ongoing_requests, min_replicas=args.min_replicas,
            max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
            upscale_delay_s=args.upscale_delay, downscale_delay_s=args.downscale_delay)
    return _engine_config(args), config, ray_config


def _sampling(args: argparse.Namespace):
    from llmserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def _cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _make_llm(args)
    if llm.tokenizer.chat_template and not args.no_chat_template:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.outputs[0].text)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _make_llm(args)
    tok = llm.tokenizer
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"llmserve chat on {args.model}. Empty line or Ctrl-D to quit; /reset clears.")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line or line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        ids = tok.encode_chat(history) if tok.chat_template else tok.encode(line)
        answer = []
        for delta in llm.stream(ids, params):
            answer.append(delta)
            print(delta, end="", flush=True)
        print(flush=True)
        history.append({"role": "assistant", "content": "".join(answer)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
