"""Summary tables, sweep plots and side-by-side comparisons of benchmark results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def summary_table(result: dict[str, Any]) -> str:
    s = result["summary"]
    t = result["target"]
    lines = [
        f"== llmserve bench: {t['base_url']} ({t.get('model') or 'default model'}), "
        f"{result['arrivals_label']} ==",
        f"workload:               {result['workload']}",
        f"requests:               {s['completed']} completed of {s['requests']}"
        + (f"  errors: {s['errors']}" if s["errors"] else ""),
        f"duration:               {s['duration_s']:.2f} s",
        f"request throughput:     {s['request_throughput']:.2f} req/s",
        f"output token throughput:{s['output_throughput']:>9.1f} tok/s",
        f"total token throughput: {s['total_token_throughput']:.1f} tok/s",
    ]
    for kind, detail in (s.get("error_details") or {}).items():
        lines.append(f"  {kind}: {detail or '(no detail)'}")
    if s.get("tokens_from_chunks"):
        lines.append(f"note: {s['tokens_from_chunks']} of {s['completed']} completed requests "
                     "sent no usage: their output tokens are stream chunks (a chunk may hold "
                     "several), so token throughputs are lower bounds and TPOT upper bounds")
    if s["slo"]:
        slo = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in s["slo"].items())
        lines.append(f"goodput ({slo}): {s['goodput']:.2f} req/s "
                     f"({s['goodput_fraction']:.0%} of requests)")
    lines.append(f"{'':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}  (ms)")
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = s[name]
        cells = "".join(f"{_ms(row[k]):>10}" for k in ("mean", "p50", "p90", "p95", "p99"))
        lines.append(f"{name.upper():<8}{cells}")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def load(path: str | Path) -> dict[str, Any]:
    """A sweep.json of ``llmserve bench sweep`` or a result of ``llmserve bench serve``;
    anything else is a ValueError that names the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"cannot read {path}: {reason}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    points = data.get("points", [data]) if isinstance(data, dict) else None
    if not (isinstance(points, list) and points and all(
            isinstance(p, dict) and isinstance(p.get("summary"), dict)
            and isinstance(p.get("arrivals"), dict) for p in points)):
        raise ValueError(f"{path}: not a benchmark result: expected the sweep.json of "
                         "`llmserve bench sweep` or the JSON of `llmserve bench serve`")
    return data


def check_plot_path(path: str | Path) -> None:
    """A plot file name whose suffix matplotlib can write (checked before any work)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    kinds = FigureCanvasAgg.get_supported_filetypes()
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix not in kinds:
        raise ValueError(f"--plot: cannot write a plot as {path}: the name must end in one "
                         f"of {', '.join('.' + k for k in sorted(kinds))}")


def sweep_points(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A sweep file holds {"label", "points": [result...]}; a single result is one point."""
    return data.get("points", [data])


def plot_sweeps(sweeps: list[dict[str, Any]], path: str | Path, title: str) -> None:
    """Throughput against latency: p50 and p99 of TTFT and TPOT, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for sweep in sweeps:
            pts = sweep_points(sweep)
            x = [p["summary"]["output_throughput"] for p in pts]
            for pct, style in (("p50", "-o"), ("p99", "--s")):
                y = [(p["summary"][metric][pct] or 0) * 1000 for p in pts]
                ax.plot(x, y, style, label=f"{sweep.get('label', '?')} {pct}")
                if pct == "p50":
                    for xi, yi, p in zip(x, y, pts):
                        ax.annotate(_point_label(p), (xi, yi), fontsize=7,
                                    textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        if any(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
            ax.set_yscale("log")  # (no positive value: a run where nothing completed)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _point_label(p: dict[str, Any]) -> str:
    a = p["arrivals"]
    return f"c={a['concurrency']}" if a.get("concurrency") else f"r={a['request_rate']:g}"


def compare_markdown(sweeps: list[dict[str, Any]]) -> str:
    """One row per load point, servers side by side."""
    labels = [s.get("label", f"run{i}") for i, s in enumerate(sweeps)]
    metrics = [("out tok/s", lambda s: f"{s['output_throughput']:.1f}"),
               ("req/s", lambda s: f"{s['request_throughput']:.2f}"),
               ("TTFT p50 ms", lambda s: _ms(s["ttft"]["p50"])),
               ("TTFT p99 ms", lambda s: _ms(s["ttft"]["p99"])),
               ("TPOT p50 ms", lambda s: _ms(s["tpot"]["p50"])),
               ("TPOT p99 ms", lambda s: _ms(s["tpot"]["p99"])),
               ("errors", lambda s: str(sum(s["errors"].values())))]
    header = "| load | metric | " + " | ".join(labels) + " |"
    lines = [header, "|" + "---|" * (len(labels) + 2)]
    by_point: dict[str, list[dict | None]] = {}
    for i, sweep in enumerate(sweeps):
        for p in sweep_points(sweep):
            by_point.setdefault(_point_label(p), [None] * len(sweeps))[i] = p["summary"]
    for point, summaries in by_point.items():
        for name, fmt in metrics:
            cells = [fmt(s) if s else "-" for s in summaries]
            lines.append(f"| {point} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
