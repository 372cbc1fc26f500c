"""A randomized differential fuzz of the engine: each trial draws a configuration (model
family, weight and KV format, block size, a KV pool small enough to preempt, chunked
prefill, prefix caching, the scheduling policy, speculative decoding, async scheduling)
and requests (shared prefixes, duplicates, n > 1, seeded sampling, penalties, logit bias,
stops, logprobs, structured outputs, random aborts and arrivals), drives the engine step
by step, and compares every greedy or seeded request with the same request run alone in a
fresh engine; after every step the KV pool's integrity, at the end no block, queue entry
or per-request state left behind. Not a test (it runs for as long as it is given); session
48's fuzz found six defects with it (BENCHMARKS.md, the closing notes).

    .venv/bin/python -m tests.helpers.engine_fuzz START_SEED NUM_TRIALS [MINUTES]
    .venv/bin/python -m tests.helpers.engine_fuzz --one SEED     # replay one trial, verbose

FORCE_SPEC=1 (the default) makes most trials with speculation speculate in every step
(the speculator's budget and cost model set aside: proposals may change the speed, never
the output). Results go to engine_fuzz_<START_SEED>.jsonl in the working directory; the
tiny models are built once under $TMPDIR/llmserve-fuzz-models.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

from llmserve import LLM, SamplingParams
from llmserve.engine.output_processor import OutputProcessor
from llmserve.sampling_params import StructuredOutputsParams

logging.disable(logging.WARNING)

MODELS = ["llama-gqa", "qwen3", "gemma3", "llama-tied"]
MODEL_DIR = Path(tempfile.gettempdir()) / "llmserve-fuzz-models"
FORMATS = [
    dict(),
    dict(dtype="bfloat16"),
    dict(quantization="int8"),
    dict(quantization="w8a8"),
    dict(quantization="int4"),
    dict(kv_cache_dtype="fp8_e4m3"),
    dict(quantization="int4", kv_cache_dtype="int8"),
    dict(kv_cache_dtype="int8"),
    dict(quantization="int8", kv_cache_dtype="float32"),
]
VERBOSE = False
_REF_LLMS: dict = {}
_REF_CACHE: dict = {}


def model_path(name: str) -> str:
    """The tiny random-weight model ``name`` (tests/helpers/tiny_models.py), built once."""
    path = MODEL_DIR / name
    if not (path / "config.json").is_file():
        from tests.helpers.tiny_models import build_hf_model, save_hf_model, smollm2_tokenizer

        path.mkdir(parents=True, exist_ok=True)
        save_hf_model(build_hf_model(name), path, smollm2_tokenizer())
    return str(path)


def log(*a):
    if VERBOSE:
        print(*a, flush=True)


def ref_llm(model, fmt, bs):
    key = (model, tuple(sorted(fmt.items())), bs)
    if key not in _REF_LLMS:
        if len(_REF_LLMS) > 10:
            _REF_LLMS.pop(next(iter(_REF_LLMS)))
        _REF_LLMS[key] = LLM(model_path(model), num_kv_blocks=4096 // bs * 8, block_size=bs,
                             max_num_batched_tokens=4096, enable_prefix_caching=False,
                             max_model_len=1024, **fmt)
    return _REF_LLMS[key]


def summarize(out):
    """RequestOutput -> comparable plain data."""
    res = []
    for c in out.outputs:
        lps = None
        if c.logprobs is not None:
            lps = [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in c.logprobs]
        res.append(dict(ids=list(c.token_ids), text=c.text, fin=c.finish_reason,
                        stop=c.stop_reason, lps=lps))
    plp = None
    if out.prompt_logprobs is not None:
        plp = [None if d is None else {t: (lp.logprob, lp.rank) for t, lp in d.items()}
               for d in out.prompt_logprobs]
    return dict(outs=res, plp=plp)


def reference(model, fmt, bs, prompt, sp):
    key = (model, tuple(sorted(fmt.items())), bs, tuple(prompt), repr(sp))
    if key not in _REF_CACHE:
        llm = ref_llm(model, fmt, bs)
        out = llm.generate([prompt], sp)[0]
        _REF_CACHE[key] = summarize(out)
        if len(_REF_CACHE) > 20000:
            _REF_CACHE.clear()
    return _REF_CACHE[key]


def comparable(sp: SamplingParams) -> bool:
    return sp.greedy or sp.seed is not None


def make_params(rng, model, fmt, bs, prompt, spec_on):
    """Random SamplingParams; may probe the reference to pick stop strings/ids that hit."""
    max_tokens = rng.choice([0, 1, 5] + [rng.randint(8, 60)] * 9)
    kw = dict(max_tokens=max_tokens)
    r = rng.random()
    if r < 0.55:
        kw["temperature"] = 0
    elif r < 0.85:
        kw.update(temperature=rng.choice([0.5, 0.8, 1.0, 1.5]), seed=rng.randrange(-5, 10**6))
        if rng.random() < 0.4:
            kw["top_k"] = rng.choice([1, 5, 50])
        if rng.random() < 0.4:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.2:
            kw["min_p"] = 0.05
    else:
        kw.update(temperature=1.0)  # unseeded: noise in the batch, not compared
    kw["ignore_eos"] = rng.random() < 0.6
    if rng.random() < 0.25:
        kw["repetition_penalty"] = rng.choice([0.8, 1.2, 1.5])
    if rng.random() < 0.2:
        kw["presence_penalty"] = rng.choice([-0.5, 0.5, 1.5])
    if rng.random() < 0.2:
        kw["frequency_penalty"] = rng.choice([-0.5, 0.5, 1.0])
    if rng.random() < 0.15:
        kw["logit_bias"] = {rng.randrange(17, 49152): rng.choice([-5.0, 3.0, 8.0])
                            for _ in range(rng.randint(1, 3))}
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 1, 3, 5])
    if rng.random() < 0.08:
        kw["prompt_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.12 and max_tokens > 1:
        kw["n"] = rng.randint(2, 3)
    if rng.random() < 0.1 and max_tokens >= 3:
        kw["structured_outputs"] = rng.choice([
            StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
            StructuredOutputsParams(choice=("alpha", "beta gamma", "delta")),
            StructuredOutputsParams(json={"type": "object", "properties": {
                "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}),
        ])
        kw["max_tokens"] = max(kw["max_tokens"], 20)
    elif max_tokens >= 2 and rng.random() < 0.4:
        # stop conditions picked from what the reference would generate without them
        probe = SamplingParams(**{k: v for k, v in kw.items() if k not in ("n",)})
        if comparable(probe):
            ref = reference(model, fmt, bs, prompt, probe)["outs"][0]
            ids, text = ref["ids"], ref["text"]
            if rng.random() < 0.5 and ids:
                kw["stop_token_ids"] = [rng.choice(ids)] + ([rng.randrange(17, 49152)]
                                                            if rng.random() < 0.3 else [])
            if rng.random() < 0.6 and len(text) > 3:
                a = rng.randrange(len(text) - 1)
                s = text[a:a + rng.randint(1, 4)]
                if s:
                    kw["stop"] = [s] + (["zzqx"] if rng.random() < 0.3 else [])
                    kw["include_stop_str_in_output"] = rng.random() < 0.3
            if rng.random() < 0.5 and kw["max_tokens"] > 2:
                kw["min_tokens"] = rng.randint(1, kw["max_tokens"] - 1)
    elif rng.random() < 0.15 and max_tokens > 1:
        kw["min_tokens"] = rng.randint(1, max_tokens)
        kw["ignore_eos"] = False
    return SamplingParams(**kw)


def make_config(rng):
    model = rng.choice(MODELS)
    fmt = dict(rng.choice(FORMATS)) if rng.random() < 0.3 else {}
    bs = rng.choice([8, 16, 16, 32])
    cfg = dict(block_size=bs, enable_prefix_caching=rng.random() < 0.7,
               max_num_batched_tokens=rng.choice([8, 16, 24, 32, 64, 128]),
               max_num_seqs=rng.choice([3, 4, 6, 8, 16]), **fmt)
    if model == "gemma3" and rng.random() < 0.35:
        cfg["hybrid_kv_cache"] = False
    r = rng.random()
    if r < 0.3:
        cfg["policy"] = "priority"
    elif r < 0.37:
        cfg["scheduling"] = "static"
    spec = None
    r = rng.random()
    if r < float(os.environ.get('SPEC_P', '0.5')):
        method = rng.choice(["ngram", "suffix", "draft", "draft"])
        spec = dict(method=method, num_speculative_tokens=rng.randint(1, 6),
                    adaptive=rng.random() < 0.15)
        if method != "draft":
            lo = rng.randint(1, 3)
            spec.update(prompt_lookup_min=lo, prompt_lookup_max=lo + rng.randint(0, 2))
        else:
            same = rng.random() < 0.6
            dm = model if same else rng.choice(MODELS)
            spec["model"] = model_path(dm)
            if rng.random() < 0.4:
                spec["draft_num_layers"] = 1
            if rng.random() < 0.3:
                spec["quantization"] = rng.choice(["int4", "int8", "none"])
            hybrid = model == "gemma3" and cfg.get("hybrid_kv_cache", True)
            if same and rng.random() < 0.6 and not hybrid:
                spec["draft_kv_from_target"] = rng.random() < 0.7
            if rng.random() < 0.3:
                spec["draft_prompt_lookup"] = rng.random() < 0.5
    elif rng.random() < 0.5:
        cfg["async_scheduling"] = True
    if spec:
        cfg["speculative_config"] = spec
    return model, fmt, bs, cfg


def make_workload(rng, model, fmt, bs, max_len, tiny):
    nreq = rng.randint(2, 4) if tiny else rng.randint(4, 12)
    prefixes = [[rng.randrange(17, 49152) for _ in range(rng.randint(1, 80))]
                for _ in range(rng.randint(1, 3))]
    reqs = []
    for _ in range(nreq):
        base = list(rng.choice(prefixes)) if rng.random() < 0.6 else []
        if rng.random() < 0.4:
            piece = [rng.randrange(17, 49152) for _ in range(rng.randint(1, 8))]
            tail = piece * rng.randint(1, 8)
        else:
            tail = [rng.randrange(17, 49152) for _ in range(rng.randint(1, 80))]
        prompt = (base + tail)[:rng.randint(1, 100)]
        if rng.random() < 0.15 and reqs:  # exact duplicate prompt
            prompt = list(reqs[-1][0])
        sp = make_params(rng, model, fmt, bs, prompt, False)
        mt = sp.max_tokens or 0
        if len(prompt) + mt > max_len:
            prompt = prompt[:max(1, max_len - mt - 1)]
            if len(prompt) + mt > max_len:
                continue
        arrival = 0 if rng.random() < 0.8 else rng.randint(0, 10)
        prio = rng.randint(-2, 2)
        reqs.append((prompt, sp, arrival, prio))
    return reqs


def build_llm(model, cfg, want_len):
    """An LLM whose max_model_len is want_len and whose pool is as small as the engine takes."""
    blocks = cfg["num_kv_blocks"]
    for _ in range(40):
        try:
            return LLM(model_path(model), **{**cfg, "num_kv_blocks": blocks,
                                        "max_model_len": want_len}), blocks
        except ValueError as e:
            if "does not fit" not in str(e) and "cannot hold" not in str(e):
                raise
            blocks = blocks + max(1, blocks // 8)
    raise RuntimeError("no pool fits")


def run_trial(seed: int):
    rng = random.Random(seed)
    model, fmt, bs, cfg = make_config(rng)
    abort_rate = rng.choice([0, 0, 0, 0.05, 0.15])
    tiny = rng.random() < 0.15
    max_len = rng.choice([64, 96, 128, 160]) if not tiny else rng.choice([24, 40, 64])
    reqs = make_workload(rng, model, fmt, bs, max_len, tiny)
    if not reqs:
        return dict(seed=seed, skipped=True), []
    need = max(len(p) + (sp.max_tokens or 0) for p, sp, _, _ in reqs)
    total = sum((len(p) + (sp.max_tokens or 0)) * sp.n for p, sp, _, _ in reqs)
    want_len = max(need, min(max_len, need + rng.randint(0, 16)))
    frac = rng.choice([0.08, 0.12, 0.2, 0.3])
    groups = 6 if model == "gemma3" else 1
    cfg["num_kv_blocks"] = max(2, int(max(want_len, total * frac) // bs) * groups
                               if not tiny else (want_len // bs + 1) * groups)
    if tiny:
        cfg["num_kv_blocks"] = max(1, cfg["num_kv_blocks"] // 2)
    if cfg["max_num_batched_tokens"] < want_len and rng.random() < 0.05:
        cfg["enable_chunked_prefill"] = False
        cfg["max_num_batched_tokens"] = want_len
    info = dict(seed=seed, model=model, cfg=cfg, abort_rate=abort_rate, tiny=tiny)
    log("pre-config", json.dumps(info, default=str), want_len)
    llm, blocks = build_llm(model, cfg, want_len)
    cfg["num_kv_blocks"] = blocks
    info["blocks"] = blocks
    info["demand_tokens"] = total
    log("config", json.dumps(info, default=str))
    eng = llm.engine
    force = os.environ.get("FORCE_SPEC", "1") == "1"
    if eng.speculator is not None and force and rng.random() < 0.8:
        # test harness: speculate in every step (proposals change speed, never output)
        eng.speculator.budget = 10**9
        eng.speculator.proposer.cheap = True
        object.__setattr__(eng.speculator.config, "adaptive", False)
        info["forced_spec"] = True
    info["nreq"] = len(reqs)
    problems = []
    proc = OutputProcessor(llm.tokenizer)
    pending = sorted(enumerate(reqs), key=lambda x: x[1][2])
    live, aborted, rid_of = set(), set(), {}
    step = 0
    while pending or eng.has_unfinished():
        while pending and pending[0][1][2] <= step:
            i, (prompt, sp, _, prio) = pending.pop(0)
            rid = f"r{i}"
            eng.add_request(rid, prompt, sp, priority=prio if cfg.get("policy") else 0)
            proc.add_request(rid, None, prompt, sp)
            live.add(rid)
            rid_of[rid] = i
        if abort_rate and live and rng.random() < abort_rate:
            victim = rng.choice(sorted(live))
            st = proc.states[victim]
            if not st.finished:
                sp = reqs[rid_of[victim]][1]
                if sp.n > 1 and rng.random() < 0.5:
                    eng.abort(victim, rng.randrange(sp.n))
                else:
                    eng.abort(victim)
                aborted.add(victim)
            if victim in aborted and victim not in eng._families:
                live.discard(victim)
        if eng.has_unfinished():
            try:
                llm._step(proc)
            except ValueError as e:  # grammar failure etc.
                problems.append(f"STEPERR {e}")
                break
            eng.kv_manager.check_integrity()
            sc = eng.scheduler
            for r in sc.running:
                assert r.request_id in sc.requests
                assert eng.kv_manager._req_blocks.get(r.request_id) is not None or \
                    r.num_computed_tokens == 0, f"running {r.request_id} holds no blocks"
            for r in sc.waiting:
                assert r.request_id not in eng.kv_manager._req_blocks, \
                    f"waiting {r.request_id} holds blocks"
        for rid in list(live):
            if proc.states[rid].finished:
                live.discard(rid)
        step += 1
        if step > 4000:
            running = [r.request_id for r in eng.scheduler.running]
            waiting = [r.request_id for r in eng.scheduler.waiting]
            problems.append(f"HANG: >4000 steps; running={running} waiting={waiting}")
            break
    st = eng.stats()
    eng.kv_manager.check_integrity()
    if not any(p.startswith(("HANG", "STEPERR")) for p in problems):
        if st.kv_blocks_used != 0:
            problems.append(f"POOL: kv_blocks_used={st.kv_blocks_used} after run")
        if st.num_running or st.num_waiting:
            problems.append(f"QUEUE: running={st.num_running} waiting={st.num_waiting}")
        if eng.scheduler.requests:
            problems.append(f"LEAK: scheduler.requests={list(eng.scheduler.requests)}")
        if eng._families:
            problems.append(f"LEAK: engine._families={list(eng._families)}")
        if eng.kv_manager._req_blocks or eng.kv_manager._req_num_hashed:
            problems.append("LEAK: kv_manager request tables")
        pend = eng.scheduler._finished_ids
        lk = [k for k in eng.runner._seeds if k not in pend]
        if lk:
            problems.append(f"LEAK: runner._seeds {lk}")
        g = eng.runner.grammar
        if g is not None and [k for k in g._matchers if k not in pend]:
            problems.append(f"LEAK: grammar matchers {list(g._matchers)}")
        if eng.speculator is not None:
            p = eng.speculator.proposer
            for attr in ("_seqs", "_tokens"):
                d = getattr(p, attr, None)
                if d and [k for k in d if k not in pend]:
                    problems.append(f"LEAK: proposer.{attr} {list(d)}")
            idle = hasattr(p, "_free") and not getattr(p, "_seqs", None)
            if idle and sorted(p._free) != list(range(p.num_blocks)):
                problems.append(f"LEAK: draft pool free {len(p._free)}/{p.num_blocks}")
    info["preempt"] = st.num_preemptions
    info["spec_acc"] = st.spec_accepted_tokens
    info["spec_draft"] = st.spec_draft_tokens
    info["prefix_hits"] = st.prefix_hits
    info["steps"] = step
    for rid, i in rid_of.items():
        if rid in aborted:
            continue
        prompt, sp, _, _ = reqs[i]
        if rid not in proc.states:
            continue
        got = summarize(proc.states[rid].to_output())
        if not proc.states[rid].finished:
            if not any(p.startswith(("HANG", "STEPERR")) for p in problems):
                problems.append(f"{rid}: not finished")
            continue
        if not comparable(sp):
            continue
        want = reference(model, fmt, bs, prompt, sp)
        if got != want:
            d = describe_diff(rid, sp, prompt, got, want)
            only_noise = all(g[f] == w[f] for g, w in zip(got["outs"], want["outs"])
                             for f in ("ids", "text", "fin", "stop")) and \
                got["plp"] == want["plp"] and "inf" not in d and "shape" not in d
            if only_noise:
                d = "LPNOISE " + d
            problems.append(d)
    return info, problems


def describe_diff(rid, sp, prompt, got, want):
    lines = [f"MISMATCH {rid} len(prompt)={len(prompt)} sp={sp}"]
    for k, (g, w) in enumerate(zip(got["outs"], want["outs"])):
        for f in ("ids", "text", "fin", "stop"):
            if g[f] != w[f]:
                lines.append(f"  seq{k} {f}: got {g[f]!r}\n           want {w[f]!r}")
        if g["lps"] != w["lps"]:
            if g["lps"] is None or w["lps"] is None or len(g["lps"]) != len(w["lps"]):
                lines.append(f"  seq{k} lps shape differs")
            else:
                md = 0.0
                where = []
                for j, (dg, dw) in enumerate(zip(g["lps"], w["lps"])):
                    if dg != dw and len(where) < 4:
                        where.append((j, dg, dw))
                    if dg.keys() != dw.keys():
                        md = math.inf
                        break
                    for t in dg:
                        md = max(md, abs(dg[t][0] - dw[t][0]))
                        if dg[t][1] != dw[t][1]:
                            md = math.inf
                lines.append(f"  seq{k} logprobs differ, max abs diff {md}")
                if VERBOSE:
                    for j, dg, dw in where:
                        lines.append(f"     pos {j}: got {dg}\n              want {dw}")
    if got["plp"] != want["plp"]:
        gp, wp = got["plp"], want["plp"]
        if gp is None or wp is None or len(gp) != len(wp):
            lines.append(f"  prompt_logprobs differ in shape {gp is None} {wp is None}")
        else:
            md, bad = 0.0, []
            for j, (dg, dw) in enumerate(zip(gp, wp)):
                if dg == dw:
                    continue
                bad.append(j)
                if dg is None or dw is None or dg.keys() != dw.keys():
                    md = math.inf
                    continue
                for t in dg:
                    md = max(md, abs(dg[t][0] - dw[t][0]))
            lines.append(f"  prompt_logprobs differ at {len(bad)} positions {bad[:8]}, "
                         f"max abs diff {md}")
    return "\n".join(lines)


def main():
    global VERBOSE
    if sys.argv[1] == "--one":
        VERBOSE = True
        info, problems = run_trial(int(sys.argv[2]))
        print(json.dumps(info, default=str))
        print("\n".join(problems) or "OK")
        sys.exit(1 if problems else 0)
    start, n = int(sys.argv[1]), int(sys.argv[2])
    minutes = float(sys.argv[3]) if len(sys.argv) > 3 else 60
    t0 = time.time()
    out = open(f"engine_fuzz_{start}.jsonl", "a")  # noqa: SIM115 (written as trials end)
    for seed in range(start, start + n):
        if time.time() - t0 > minutes * 60:
            break
        t = time.time()
        try:
            info, problems = run_trial(seed)
        except Exception as e:
            info, problems = dict(seed=seed), ["EXC " + "".join(
                traceback.format_exception(e))[-3000:]]
        info["secs"] = round(time.time() - t, 1)
        info["problems"] = problems
        out.write(json.dumps(info, default=str) + "\n")
        out.flush()
        tag = "FAIL" if problems else "ok"
        print(f"{seed} {tag} {info.get('model')} {info['secs']}s "
              f"pre={info.get('preempt')} acc={info.get('spec_acc')}/{info.get('spec_draft')}"
              f" hits={info.get('prefix_hits')} blocks={info.get('blocks')}"
              f" tiny={info.get('tiny')}", flush=True)
        for p in problems:
            print("   ", p[:1500].replace("\n", "\n    "), flush=True)


if __name__ == "__main__":
    main()
