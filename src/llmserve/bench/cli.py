"""``llmserve bench serve | sweep | compare | offline``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llmserve.bench.offline import MODES
from llmserve.bench.workloads import WORKLOADS


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark a server (or the engine offline)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    serve = bsub.add_parser("serve", help="load one OpenAI-compatible server and report")
    _target_args(serve)
    _workload_args(serve)
    _arrival_args(serve)
    serve.add_argument("--output", default=None,
                       help="results JSON (default: ./bench-<time>.json)")
    serve.set_defaults(func=_cmd_serve)

    sweep = bsub.add_parser("sweep", help="one workload over several load points, plotted")
    _target_args(sweep)
    _workload_args(sweep)
    sweep.add_argument("--concurrency", default=None, help="comma-separated, e.g. 1,4,16,64")
    sweep.add_argument("--request-rate", default=None, help="comma-separated requests/s")
    sweep.add_argument("--burstiness", type=float, default=1.0)
    sweep.add_argument("--warmup", type=int, default=2)
    sweep.add_argument("--label", default=None, help="name of this server in plots and tables")
    sweep.add_argument("--output-dir", default="bench-sweep")
    sweep.set_defaults(func=_cmd_sweep)

    compare = bsub.add_parser("compare", help="side-by-side table and plot of several sweeps")
    compare.add_argument("files", nargs="+", help="sweep.json (or single result) files")
    compare.add_argument("--output", default="compare.md")
    compare.add_argument("--plot", default="compare.png")
    compare.add_argument("--title", default="throughput vs latency")
    compare.set_defaults(func=_cmd_compare)

    offline = bsub.add_parser("offline", help="engine throughput, continuous vs static")
    offline.add_argument("--model", default="smollm2-135m-instruct")
    offline.add_argument("--num-requests", type=int, default=200)
    offline.add_argument("--max-num-seqs", type=int, default=64)
    offline.add_argument("--max-num-batched-tokens", type=int, default=2048)
    offline.add_argument("--kv-cache-memory", type=float, default=6.0,
                         help="GiB; enough for a padded static batch of the workload")
    offline.add_argument("--seed", type=int, default=0)
    offline.add_argument("--quantization", default="auto",
                         help="weight format, as for `llmserve serve`")
    offline.add_argument("--modes", default=",".join(MODES),
                         help="comma-separated, some of: " + ", ".join(MODES))
    offline.add_argument("--output", default=None, help="also write the results as JSON")
    offline.set_defaults(func=_cmd_offline)


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (or .../v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of "
                   "/v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not ask the server to ignore EOS (output lengths then vary)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--slo", default=None, help="e.g. ttft=500ms,tpot=50ms (goodput)")
    p.add_argument("--reset-prefix-cache", action="store_true",
                   help="POST /reset_prefix_cache before the run (before each level of a "
                        "sweep), so that no earlier prompt is answered from the cache")
    p.add_argument("--no-progress", action="store_true")


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, default="random")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests to send (default 100, or unbounded with --duration)")
    p.add_argument("--input-len", type=int, default=256, help="prompt words (~tokens)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens")
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix words")
    p.add_argument("--num-prefixes", type=int, default=1)
    p.add_argument("--dataset", default=None, help="jsonl workload: path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=None, help="stop sending after N s")


def _arrival_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=None,
                   help="requests/s (inf sends all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times (1 = Poisson, <1 burstier)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2, help="uncounted requests sent first")


def _target(args: argparse.Namespace):
    """The server to load, after one request to it: GET {base}/v1/models, as a run would
    otherwise send every request to a server that cannot answer them."""
    from llmserve.bench.client import Target

    base = _base_url(args.base_url)
    model = _probe(base, args.model, args.api_key)
    return Target(base, model, args.endpoint, args.api_key, not args.no_ignore_eos,
                  args.temperature, args.timeout)


def _base_url(url: str) -> str:
    base = url.strip().rstrip("/")
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url must be an http:// or https:// URL with a host, e.g. "
                         f"http://127.0.0.1:8000 (or .../v1); got {url!r}")
    return base if base.endswith("/v1") else base + "/v1"


def _probe(base: str, model: str | None, api_key: str | None) -> str | None:
    """Check that ``base`` answers; return ``model``, or the first model the server lists."""
    import httpx

    url = f"{base}/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=10)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise ValueError(f"--base-url: cannot reach {url} ({type(e).__name__}: {e})") from None
    if r.status_code in (401, 403):
        hint = ("the key given with --api-key was refused" if api_key
                else "the server needs an API key: pass it with --api-key")
        raise ValueError(f"--base-url: GET {url} answered {r.status_code}: {hint}")
    if r.status_code in (404, 405):
        if model is None:
            raise ValueError(f"--base-url: GET {url} answered {r.status_code}: no model list "
                             "there; check --base-url (the server's root or its /v1), or "
                             "name the model with --model")
        print(f"warning: GET {url} answered {r.status_code}; sending to it anyway, "
              f"with --model {model}", file=sys.stderr)
        return model
    if r.status_code != 200:
        raise ValueError(f"--base-url: GET {url} answered {r.status_code}: {r.text[:200]}")
    if model is not None:
        return model
    try:
        return r.json()["data"][0]["id"]
    except (KeyError, IndexError, TypeError, ValueError):
        return None  # no model named: the server picks its own (llmserve serves one)


def _workload(args: argparse.Namespace):
    from llmserve.bench.workloads import WorkloadSpec, build_workload

    n = args.num_prompts
    if n is None:
        n = 10000 if args.duration else 100
    spec = WorkloadSpec(args.workload, n, args.input_len, args.output_len, args.range_ratio,
                        args.prefix_len, args.num_prefixes, args.dataset, args.seed)
    return spec, build_workload(spec)


def _run_point(args: argparse.Namespace, target, spec, requests, arrivals) -> dict[str, Any]:
    from dataclasses import replace

    from llmserve.bench.client import prefix_cache_hits, reset_prefix_cache
    from llmserve.bench.metrics import parse_slo
    from llmserve.bench.runner import run_benchmark
    from llmserve.bench.workloads import build_workload

    reset = reset_prefix_cache(target) if args.reset_prefix_cache else None
    hits_before = prefix_cache_hits(target)
    if reset != "reset" and hits_before:
        print(f"warning: the server reported {hits_before:.0f} prefix-cache hits before this "
              "run: it has served other prompts, and its cache may answer part of this one "
              "(use --reset-prefix-cache, or a fresh server)", file=sys.stderr)
    warm = (build_workload(replace(spec, num_requests=arrivals.warmup, seed=spec.seed + 1))
            if arrivals.warmup else [])
    result = run_benchmark(target, requests, arrivals, parse_slo(args.slo),
                           progress=not args.no_progress, warmup=warm)
    hits_after = prefix_cache_hits(target)
    result["prefix_cache"] = {
        "reset": reset, "hits_before": hits_before,
        "hits_during": None if hits_after is None or hits_before is None
        else hits_after - hits_before}
    result["seed"] = spec.seed
    result["workload"] = spec.describe()
    result["arrivals_label"] = arrivals.label()
    result["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return result


def _check_target_args(args: argparse.Namespace) -> None:
    """What the target flags allow, before anything is sent or written."""
    _base_url(args.base_url)
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise ValueError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    from llmserve.bench.metrics import parse_slo

    parse_slo(args.slo)


def _check_output_file(path: Path, flag: str) -> None:
    """``path`` can be written: its directory exists and is writable, and it is no
    directory itself. Checked before a run, whose results would otherwise be lost."""
    if path.is_dir():
        raise ValueError(f"{flag}: {path} is a directory; give the path of a file")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"{flag}: the directory {parent} of {path} does not exist; create "
                         "it first or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists()
                                                     and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag}: cannot write {path}: permission denied")


def _check_output_dir(path: Path, flag: str) -> None:
    """``path`` is a writable directory, or can be created as one (not created here)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag}: {path} exists and is not a directory")
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag}: cannot create {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: cannot write in {existing}: permission denied")


def _sweep_arrivals(args: argparse.Namespace) -> list:
    """One Arrivals per level of ``--concurrency 1,4,16`` or ``--request-rate 1,2,inf``."""
    from llmserve.bench.runner import Arrivals
    from llmserve.bench.workloads import level_seed

    if (args.concurrency is None) == (args.request_rate is None):
        raise ValueError("give exactly one of --concurrency or --request-rate (comma lists)")
    flag = "--concurrency" if args.concurrency is not None else "--request-rate"
    text = args.concurrency if args.concurrency is not None else args.request_rate
    levels = []
    for i, v in enumerate(text.split(",")):
        v = v.strip()
        try:
            number = int(v) if flag == "--concurrency" else float(v)
        except ValueError:
            allowed = ("integers >= 1, e.g. 1,4,16" if flag == "--concurrency"
                       else "numbers > 0 (or inf), e.g. 1,2,inf")
            raise ValueError(f"{flag}: {v!r} is not a number; give a comma-separated list "
                             f"of {allowed}") from None
        seed = level_seed(args.seed, i)
        if flag == "--concurrency":
            levels.append((v, Arrivals(concurrency=number, duration=args.duration,
                                       warmup=args.warmup, seed=seed)))
        else:
            levels.append((v, Arrivals(request_rate=number, burstiness=args.burstiness,
                                       duration=args.duration, warmup=args.warmup,
                                       seed=seed)))
    return levels


def _cmd_serve(args: argparse.Namespace) -> int:
    from llmserve.bench.report import summary_table
    from llmserve.bench.runner import Arrivals

    arrivals = Arrivals(args.concurrency, args.request_rate, args.burstiness,
                        args.max_concurrency, args.duration, args.warmup, args.seed)
    _check_target_args(args)
    spec, requests = _workload(args)
    out = Path(args.output or f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json")
    _check_output_file(out, "--output")
    target = _target(args)
    result = _run_point(args, target, spec, requests, arrivals)
    print(summary_table(result))
    out.write_text(json.dumps(result, indent=1))
    print(f"results: {out}")
    if result["summary"]["completed"] == 0:
        print("llmserve bench: error: no request completed (see the errors above)",
              file=sys.stderr)
        return 1
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from llmserve.bench.report import plot_sweeps, summary_table
    from llmserve.bench.workloads import build_workload

    levels = _sweep_arrivals(args)
    _check_target_args(args)
    spec, _ = _workload(args)
    out_dir = Path(args.output_dir)
    _check_output_dir(out_dir, "--output-dir")
    target = _target(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    label = args.label or target.base_url
    points = []
    for v, arrivals in levels:
        # Each level its own prompts: a level that repeated another's would be answered
        # in part from the prefix cache.
        level = replace(spec, seed=arrivals.seed)
        requests = build_workload(level)
        result = _run_point(args, target, level, requests, arrivals)
        result["label"] = label
        print(summary_table(result), flush=True)
        name = f"{'c' if args.concurrency else 'r'}{v}.json"
        (out_dir / name).write_text(json.dumps(result, indent=1))
        points.append(result)
    sweep = {"label": label, "workload": spec.describe(),
             "seeds": "one per level: seed + 7919 x level index (no level repeats another's "
                      "prompts)",
             "points": [{k: p[k] for k in ("arrivals", "summary", "arrivals_label", "seed",
                                           "prefix_cache")} for p in points]}
    (out_dir / "sweep.json").write_text(json.dumps(sweep, indent=1))
    plot_sweeps([sweep], out_dir / "sweep.png", f"{label}: {spec.describe()}")
    print(f"sweep: {out_dir / 'sweep.json'}, plot: {out_dir / 'sweep.png'}")
    failed = [p["arrivals_label"] for p in points if p["summary"]["completed"] == 0]
    if failed:
        which = "any level" if len(failed) == len(points) else ", ".join(failed)
        print(f"llmserve bench: error: no request completed at {which} (see the errors "
              "above)", file=sys.stderr)
        return 1
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from llmserve.bench.report import check_plot_path, compare_markdown, load, plot_sweeps

    sweeps = [load(f) for f in args.files]
    _check_output_file(Path(args.output), "--output")
    _check_output_file(Path(args.plot), "--plot")
    check_plot_path(args.plot)
    table = compare_markdown(sweeps)
    Path(args.output).write_text(table + "\n")
    plot_sweeps(sweeps, args.plot, args.title)
    print(table)
    print(f"table: {args.output}, plot: {args.plot}")
    return 0


def _cmd_offline(args: argparse.Namespace) -> int:
    from llmserve.bench.offline import offline_table, run_offline

    for flag, value in (("--num-requests", args.num_requests),
                        ("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not (args.kv_cache_memory > 0 and math.isfinite(args.kv_cache_memory)):
        raise ValueError(f"--kv-cache-memory must be > 0 GiB, got {args.kv_cache_memory}")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"--modes must be some of {', '.join(MODES)} (comma-separated); "
                         f"got {args.modes!r}")
    if args.output:
        _check_output_file(Path(args.output), "--output")
    report = run_offline(args.model, args.num_requests, args.seed, args.kv_cache_memory,
                         args.max_num_seqs, args.max_num_batched_tokens,
                         quantization=args.quantization, modes=modes)
    print(offline_table(report))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))
    return 0
