"""Formats side_by_side.py's figures as a table: each engine's figure with the fraction of the
roofline it reaches, then ferrollm's figure divided by each peer's. The bounds are those of the
run's dtype (a report without one is float32); llama.cpp's are those of the GGUF it read. Under
each workload, the peak RSS of the process that ran it; reports from before that figure leave its
rows out."""

from __future__ import annotations

from roofline import DTYPES

# (workload, key in the engine's figures, label, roofline bound or None, higher is better)
PEAK_RSS = ("peak_rss_mib", "peak RSS (MiB)", None, False)
ROWS = [
    ("startup", "startup_time", "start-up to 1st token (s)", None, False),
    ("startup", *PEAK_RSS),
    ("mixed", "output_tokens_per_second", "output tok/s", None, True),
    ("mixed", "tokens_per_second", "total tok/s", "batched_tokens_per_s", True),
    ("mixed", *PEAK_RSS),
    ("fixed", "output_tokens_per_second", "output tok/s", None, True),
    ("fixed", "tokens_per_second", "total tok/s", "batched_tokens_per_s", True),
    ("fixed", *PEAK_RSS),
    ("nanovllm", "output_tokens_per_second", "output tok/s", None, True),
    ("nanovllm", "tokens_per_second", "total tok/s", "batched_tokens_per_s", True),
    ("nanovllm", *PEAK_RSS),
    ("latency", "decode_tokens_per_second", "decode tok/s (batch 1)", "batch1_tokens_per_s", True),
    ("latency", "avg_latency", "latency (s)", None, False),
    ("latency", *PEAK_RSS),
]


def _dtype(report: dict) -> str:
    return report.get("dtype", "float32")


def _bounds(report: dict, engine: str) -> dict | None:
    roof = report.get("roofline")
    if roof is None:
        return None
    if engine == "llamacpp":
        # llama.cpp reads its GGUF as stored (possibly quantized, or the BF16 conversion); reports
        # from before --dtype sized that as "stored".
        return roof.get("llamacpp", roof["stored"])
    return roof[DTYPES[_dtype(report)].bounds]


def _bound(report: dict, engine: str, key: str | None) -> float | None:
    bounds = _bounds(report, engine)
    return None if key is None or bounds is None else bounds[key]


def _cell(report: dict, engine: str, workload: str, key: str, bound_key: str | None) -> str:
    figures = report["engines"].get(engine, {})
    if "error" in figures:
        return "error"
    value = figures.get(workload, {}).get(key)
    if value is None:
        return "-"
    bound = _bound(report, engine, bound_key)
    text = f"{value:.0f}" if key == "peak_rss_mib" else f"{value:.2f}"
    return text + (f" ({value / bound:.0%})" if bound else "")


def _measured(report: dict, engines: list[str], workload: str, key: str) -> bool:
    return any(key in report["engines"].get(e, {}).get(workload, {}) for e in engines)


def _ratio(report: dict, peer: str, workload: str, key: str) -> str:
    ours = report["engines"].get("ferrollm", {}).get(workload, {}).get(key)
    theirs = report["engines"].get(peer, {}).get(workload, {}).get(key)
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def _differ(a: dict, b: dict, key: str) -> bool:
    """More than 1% apart: a GGUF's f32 norms alone do not earn llama.cpp its own bound line."""
    return abs(a[key] - b[key]) > 0.01 * b[key]


def _machine_lines(report: dict) -> list[str]:
    roof = report.get("roofline")
    if roof is None:
        return ["roofline: not measured"]
    short = DTYPES[_dtype(report)].bounds
    bw = roof["bandwidth"]["read_bytes_per_s"] / 1e9
    peaks = ", ".join(f"{k.bounds} {roof[k.peak]['peak'] / 1e9:.0f}" for k in DTYPES.values() if k.peak in roof)
    m = roof["model"]
    weights = f"{m['weight_bytes_fp32'] / 1e9:.2f} GB fp32"
    if short != "fp32":
        weights += f", {m[f'weight_bytes_{short}'] / 1e9:.2f} GB {short}"
    if m["weight_bytes_stored"] != m["weight_bytes_fp32"]:
        weights += f", {m['weight_bytes_stored'] / 1e9:.2f} GB as stored"
    ours, theirs = roof[short], _bounds(report, "llamacpp")
    llamacpp = ""
    if "llamacpp" in report["engines"] and _differ(theirs, ours, "batch1_tokens_per_s"):
        gguf = report.get("llamacpp_gguf", "the stored weights")
        llamacpp = f"; llama.cpp on {gguf}: {theirs['batch1_tokens_per_s']:.1f}"
        if _differ(theirs, ours, "batched_tokens_per_s"):
            llamacpp += f" and {theirs['batched_tokens_per_s']:.0f} batched"
    machine = roof["device"] if roof.get("device") else f"machine ({roof['threads']} threads)"
    return [
        f"{machine}: read bandwidth {bw:.1f} GB/s, matmul peak (GFLOP/s) {peaks}",
        f"model: {m['params'] / 1e6:.0f} M params, {weights}",
        (f"bounds ({short}): batch-1 decode {ours['batch1_tokens_per_s']:.1f} tok/s (bandwidth / {short} weight "
         f"bytes), batched {ours['batched_tokens_per_s']:.0f} tok/s ({short} peak FLOP/s / 2 x params){llamacpp}"),
    ]


def _round_lines(report: dict, engines: list[str], workloads: list[str]) -> list[str]:
    """With ``--rounds``: each engine's main figure in every round, in run order."""
    lines = []
    for engine in engines:
        figures = report["engines"].get(engine, {})
        runs = [f"{w} {' / '.join(f'{v:.2f}' for v in figures[w]['rounds'])}"
                for w in workloads if isinstance(figures.get(w), dict) and "rounds" in figures[w]]
        if runs:
            lines.append(f"{engine}, every round (the table shows the median): " + "; ".join(runs))
    return ["", *lines] if lines else []


def format_report(report: dict, engines: list[str], workloads: list[str]) -> str:
    peers = [e for e in engines if e != "ferrollm"]
    header = ["workload", "figure", "bound", *engines]
    if "ferrollm" in engines:
        header += [f"ferrollm/{p}" for p in peers]
    rows = [header]
    for workload, key, label, bound_key, higher in ROWS:
        if workload not in workloads or (key == "peak_rss_mib" and not _measured(report, engines, workload, key)):
            continue
        bound = _bound(report, "ferrollm", bound_key)
        row = [workload, label + ("" if higher else " ↓"), f"{bound:.1f}" if bound else ""]
        row += [_cell(report, e, workload, key, bound_key) for e in engines]
        if "ferrollm" in engines:
            row += [_ratio(report, p, workload, key) for p in peers]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"model: {report['model']}, dtype: {_dtype(report)}  "
             + "(↓: lower is better; (n%): fraction of the roofline bound)"]
    if "llamacpp" in engines and "llamacpp_gguf" in report:
        lines.append(f"llama.cpp reads {report['llamacpp_gguf']}")
    lines += report.get("notes", [])
    lines += _machine_lines(report)
    lines.append("")
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += _round_lines(report, engines, workloads)
    errors = [f"{e}: {f['error']}" for e, f in report["engines"].items() if "error" in f]
    if errors:
        lines += ["", *errors]
    return "\n".join(lines)
