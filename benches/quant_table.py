"""Formats the quantized side-by-side (benches/quant_bench.py) as a markdown table, then issue #21's
targets with their verdicts: ferrollm's batch-1 decode at least llama.cpp's on every GGUF and
at least 85% of the bandwidth bound of the quantized bytes; W8A8 mixed throughput at least 1.5x
ferrollm's fp32; resident weight memory within 10% of the quantized bytes."""

from __future__ import annotations

MiB = 1 << 20
NAMES = {"ferrollm": "ferrollm", "llamacpp": "llama.cpp"}
# Issue #21's targets.
BOUND_SHARE, W8A8_OVER_FP32, RESIDENT_SLACK = 0.85, 1.5, 0.10


def _figure(report: dict, variant: str, engine: str, workload: str, key: str) -> float | None:
    figures = report["runs"].get(variant, {}).get(engine, {})
    return figures.get(workload, {}).get(key) if isinstance(figures.get(workload), dict) else None


def resident_mib(report: dict, variant: str, engine: str) -> float | None:
    """The weight bytes the engine held, in MiB: ferrollm's start-up log, llama.cpp's model size."""
    figures = report["runs"].get(variant, {}).get(engine, {})
    if "weight_bytes" in figures:
        return figures["weight_bytes"] / MiB
    for workload in report["workloads"]:
        value = _figure(report, variant, engine, workload, "weights_mib")
        if value is not None:
            return value
    return None


def _bound(report: dict, variant: str) -> dict | None:
    return report.get("roofline", {}).get("variants", {}).get(variant)


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:,.{digits}f}{suffix}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else ""


def _row(report: dict, variant: str, engine: str) -> list[str]:
    bound = _bound(report, variant)
    decode = _figure(report, variant, engine, "latency", "decode_tokens_per_second")
    mixed = _figure(report, variant, engine, "mixed", "tokens_per_second")
    share = f" ({decode / bound['batch1_tokens_per_s']:.0%})" if decode and bound else ""
    resident = resident_mib(report, variant, engine)
    quant_mib = bound["decode_bytes"] / MiB if bound else None
    ours = engine == "ferrollm"
    peer = _figure(report, variant, "llamacpp", "latency", "decode_tokens_per_second") if ours else None
    fp32 = _figure(report, "fp32", "ferrollm", "mixed", "tokens_per_second") if ours and variant != "fp32" else None
    return [variant, NAMES.get(engine, engine), _fmt(quant_mib, 0), _fmt(resident, 0),
            _ratio(resident, quant_mib), _fmt(bound and bound["batch1_tokens_per_s"], 1),
            _fmt(decode) + share, _ratio(decode, peer), _fmt(mixed),
            _fmt(_figure(report, variant, engine, "mixed", "output_tokens_per_second")), _ratio(mixed, fp32),
            " / ".join(_fmt(_figure(report, variant, engine, w, "peak_rss_mib"), 0) for w in report["workloads"])]


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "MISS")


def targets(report: dict) -> list[str]:
    """One line per target and variant, with the figures it compares."""
    lines = []
    for variant in report["variants"]:
        decode = _figure(report, variant, "ferrollm", "latency", "decode_tokens_per_second")
        peer = _figure(report, variant, "llamacpp", "latency", "decode_tokens_per_second")
        bound = _bound(report, variant)
        quantized = not variant.startswith(("fp32", "bf16"))
        if variant.startswith(("gguf-", "smollm2-")) and decode and peer:
            lines.append(f"- {variant}: batch-1 decode ≥ llama.cpp: {_verdict(decode >= peer)} "
                         f"({decode:.2f} vs {peer:.2f} tok/s)")
        if quantized and decode and bound:
            share = decode / bound["batch1_tokens_per_s"]
            lines.append(f"- {variant}: batch-1 decode ≥ {BOUND_SHARE:.0%} of the bound: "
                         f"{_verdict(share >= BOUND_SHARE)} ({share:.0%} of {bound['batch1_tokens_per_s']:.1f} tok/s)")
        resident = resident_mib(report, variant, "ferrollm")
        if quantized and resident and bound:
            over = resident / (bound["decode_bytes"] / MiB) - 1
            lines.append(f"- {variant}: resident weights within {RESIDENT_SLACK:.0%} of the quantized bytes: "
                         f"{_verdict(abs(over) <= RESIDENT_SLACK)} ({resident:,.0f} MiB held, "
                         f"{bound['decode_bytes'] / MiB:,.0f} MiB in the file, {over:+.0%})")
    w8a8 = _figure(report, "ct-w8a8", "ferrollm", "mixed", "tokens_per_second")
    fp32 = _figure(report, "fp32", "ferrollm", "mixed", "tokens_per_second")
    if w8a8 and fp32:
        lines.append(f"- ct-w8a8: mixed throughput ≥ {W8A8_OVER_FP32}x ferrollm's fp32: "
                     f"{_verdict(w8a8 >= W8A8_OVER_FP32 * fp32)} ({w8a8 / fp32:.2f}x: {w8a8:.1f} vs {fp32:.1f} tok/s)")
    return lines


def _rounds(report: dict) -> list[str]:
    lines = []
    for variant, engines in report["runs"].items():
        for engine, figures in engines.items():
            runs = [f"{w} {' / '.join(f'{v:.2f}' for v in figures[w]['rounds'])}"
                    for w in report["workloads"] if isinstance(figures.get(w), dict) and "rounds" in figures[w]]
            loads = ", ".join(f"{a:.1f}→{b:.1f}" for a, b in (x for x in figures.get("loadavg", []) if x))
            if runs or loads:
                lines.append(f"- {variant}, {NAMES.get(engine, engine)}: {'; '.join(runs)}"
                             + (f" (1-min load before→after each round: {loads})" if loads else ""))
    return lines


def _machine(report: dict) -> list[str]:
    roof = report.get("roofline")
    if roof is None:
        return ["roofline: not measured"]
    bw = roof["bandwidth"]["read_bytes_per_s"] / 1e9
    readings = roof.get("read_readings", [])
    spread = (f" (the highest of {len(readings)} readings, one before each run: "
              f"{min(readings) / 1e9:.1f}-{max(readings) / 1e9:.1f})") if len(readings) > 1 else ""
    peaks = f"fp32 {roof['matmul_flops']['peak'] / 1e9:.0f}"
    return [(f"machine ({roof['threads']} threads): read bandwidth {bw:.1f} GB/s{spread}, matmul peak (GFLOP/s) "
             f"{peaks}; bound = read bandwidth / weight bytes read per decode step")]


def format_quant_report(report: dict) -> str:
    header = ["weights", "engine", "MiB read per token", "resident MiB", "÷ read", "batch-1 bound",
              "batch-1 decode tok/s (% of bound)", "÷ llama.cpp", "mixed total tok/s", "mixed output tok/s",
              "÷ fp32", f"peak RSS MiB ({' / '.join(report['workloads'])})"]
    rows = [_row(report, v, e) for v, engines in report["runs"].items() for e in engines]
    load = ", ".join(f"{x:.2f}" for x in report["loadavg_before"])
    lines = [f"{report['date']}, {report['threads']} threads, seed {report['seed']}; load average before "
             f"{load}, after {', '.join(f'{x:.2f}' for x in report.get('loadavg_after', ()))}"
             + "".join(f"; {k}={v}" for k, v in report.get("env", {}).items()),
             *_machine(report), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "Targets (issue #21):", *targets(report)]
    rounds = _rounds(report)
    if rounds:
        lines += ["", "Every round (the table shows the median):", *rounds]
    errors = [f"- {v}: {e}" for v, e in report.get("errors", {}).items()]
    errors += [f"- {v}, {e}: {f['error']}" for v, es in report["runs"].items() for e, f in es.items() if "error" in f]
    if errors:
        lines += ["", "Errors:", *errors]
    return "\n".join(lines)
