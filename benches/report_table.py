"""Formats side_by_side.py's figures as a table: each engine's figure with the fraction of the
roofline it reaches, then ferrollm's figure divided by each peer's."""

from __future__ import annotations

# (workload, key in the engine's figures, label, roofline bound or None, higher is better)
ROWS = [
    ("startup", "startup_time", "start-up to 1st token (s)", None, False),
    ("mixed", "output_tokens_per_second", "output tok/s", None, True),
    ("mixed", "tokens_per_second", "total tok/s", "batched_tokens_per_s", True),
    ("fixed", "output_tokens_per_second", "output tok/s", None, True),
    ("fixed", "tokens_per_second", "total tok/s", "batched_tokens_per_s", True),
    ("latency", "decode_tokens_per_second", "decode tok/s (batch 1)", "batch1_tokens_per_s", True),
    ("latency", "avg_latency", "latency (s)", None, False),
]


def _bound(report: dict, engine: str, key: str | None) -> float | None:
    roof = report.get("roofline")
    if key is None or roof is None:
        return None
    # llama.cpp reads the GGUF as stored (possibly quantized); the others compute in fp32.
    return roof["stored" if engine == "llamacpp" else "fp32"][key]


def _cell(report: dict, engine: str, workload: str, key: str, bound_key: str | None) -> str:
    figures = report["engines"].get(engine, {})
    if "error" in figures:
        return "error"
    value = figures.get(workload, {}).get(key)
    if value is None:
        return "-"
    bound = _bound(report, engine, bound_key)
    return f"{value:.2f}" + (f" ({value / bound:.0%})" if bound else "")


def _ratio(report: dict, peer: str, workload: str, key: str) -> str:
    ours = report["engines"].get("ferrollm", {}).get(workload, {}).get(key)
    theirs = report["engines"].get(peer, {}).get(workload, {}).get(key)
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def _machine_lines(report: dict) -> list[str]:
    roof = report.get("roofline")
    if roof is None:
        return ["roofline: not measured"]
    bw = roof["bandwidth"]["read_bytes_per_s"] / 1e9
    flops = roof["matmul_flops"]["peak"] / 1e9
    m = roof["model"]
    quantized = m["weight_bytes_stored"] != m["weight_bytes_fp32"]
    stored = f", {m['weight_bytes_stored'] / 1e9:.2f} GB as stored" if quantized else ""
    stored_bound = (f"; {roof['stored']['batch1_tokens_per_s']:.1f} for llama.cpp's stored weights"
                    if quantized else "")
    return [
        f"machine ({roof['threads']} threads): read bandwidth {bw:.1f} GB/s, fp32 matmul peak {flops:.0f} GFLOP/s",
        f"model: {m['params'] / 1e6:.0f} M params, {m['weight_bytes_fp32'] / 1e9:.2f} GB fp32{stored}",
        f"bounds: batch-1 decode {roof['fp32']['batch1_tokens_per_s']:.1f} tok/s (bandwidth / fp32 weight "
        f"bytes{stored_bound}), batched {roof['fp32']['batched_tokens_per_s']:.0f} tok/s (peak FLOP/s / 2 x params)",
    ]


def format_report(report: dict, engines: list[str], workloads: list[str]) -> str:
    peers = [e for e in engines if e != "ferrollm"]
    header = ["workload", "figure", "bound", *engines]
    if "ferrollm" in engines:
        header += [f"ferrollm/{p}" for p in peers]
    rows = [header]
    for workload, key, label, bound_key, higher in ROWS:
        if workload not in workloads:
            continue
        bound = _bound(report, "ferrollm", bound_key)
        row = [workload, label + ("" if higher else " ↓"), f"{bound:.1f}" if bound else ""]
        row += [_cell(report, e, workload, key, bound_key) for e in engines]
        if "ferrollm" in engines:
            row += [_ratio(report, p, workload, key) for p in peers]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"model: {report['model']}  (↓: lower is better; (n%): fraction of the roofline bound)"]
    lines += _machine_lines(report)
    lines.append("")
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    errors = [f"{e}: {f['error']}" for e, f in report["engines"].items() if "error" in f]
    if errors:
        lines += ["", *errors]
    return "\n".join(lines)
