"""Peak-RSS reporting of the benchmarks: `ferrollm bench`'s JSON, the peers' runner, the
side-by-side table and benches/memory.py's targets. Nothing here is timed."""

from __future__ import annotations

import json
import mmap
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[2] / "benches"
sys.path.insert(0, str(BENCHES))
sys.path.insert(0, str(BENCHES / "peers"))

import common  # noqa: E402  (benches/peers/common.py)
import memory  # noqa: E402  (benches/memory.py)
from report_table import format_report  # noqa: E402

MiB = 1 << 20


def test_ferrollm_bench_json_reports_peak_rss(tiny_llama, tmp_path, capsys):
    from ferrollm.cli import main

    path, _ = tiny_llama
    out = tmp_path / "latency.json"
    main(["bench", "latency", "--model", str(path), "--input-len", "4", "--output-len", "2", "--batch-size", "1",
          "--num-iters", "1", "--num-iters-warmup", "0", "--output-json", str(out)])
    peak = json.loads(out.read_text())["peak_rss_mib"]
    # The pytest process holds torch and the engine: hundreds of MiB, far from a unit mix-up.
    assert 50 < peak < 64 * 1024
    assert f"Peak RSS: {peak:.0f} MiB" in capsys.readouterr().out


class _Engine:
    """Writes ``hold_mib`` of memory of its own mapping while a request asks for 3 tokens; the
    mapping is returned to the kernel after (malloc might keep freed memory: ferrollm's CPU
    worker tells glibc to)."""

    def __init__(self, hold_mib: int):
        self.hold_mib = hold_mib

    def generate(self, requests):
        if any(r.output_len == 3 for r in requests):
            with mmap.mmap(-1, self.hold_mib * MiB) as held:
                for offset in range(0, len(held), mmap.PAGESIZE):
                    held[offset] = 1
        return [r.output_len for r in requests]


def test_runner_charges_each_workload_its_own_peak(tmp_path, capsys):
    for name, output_len in (("big", 3), ("small", 2)):
        data = {"kind": "throughput", "requests": [{"prompt_token_ids": [5, 6], "output_len": output_len}]}
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    if not common.reset_peak_rss():
        pytest.skip("the kernel does not let a process reset its peak RSS")
    args = common.parser("test").parse_args(["--model", "m", "--requests-dir", str(tmp_path),
                                             "--workloads", "startup,big,small"])
    common.run("fake", lambda: _Engine(256), args)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    big, small = result["big"]["peak_rss_mib"], result["small"]["peak_rss_mib"]
    assert big - small > 200  # the small workload after the big one is not charged for it
    assert small >= result["startup"]["peak_rss_mib"]
    assert result["peak_rss_mib"] == pytest.approx(big)


def _report(peaks: dict[str, float | None]) -> dict:
    engines = {}
    for engine, peak in peaks.items():
        fixed = {"tokens_per_second": 100.0, "output_tokens_per_second": 50.0}
        if peak is not None:
            fixed["peak_rss_mib"] = peak
        engines[engine] = {"fixed": fixed}
    return {"model": "qwen2", "engines": engines}


def test_side_by_side_table_shows_peak_rss_beside_throughput():
    table = format_report(_report({"ferrollm": 2000.0, "hf": 2500.0}), ["ferrollm", "hf"], ["fixed"])
    row = next(line for line in table.splitlines() if "peak RSS" in line)
    assert row.split()[:2] == ["fixed", "peak"] and "2000" in row and "2500" in row and "0.80x" in row


def test_side_by_side_table_of_an_older_report_has_no_peak_rss_row():
    table = format_report(_report({"ferrollm": None, "hf": None}), ["ferrollm", "hf"], ["fixed"])
    assert "peak RSS" not in table and "total tok/s" in table


@pytest.mark.parametrize("ours, peer, expected", [
    ({"peak_rss_mib": 2000.0, "startup_time": 1.5}, {"peak_rss_mib": 2800.0}, (True, True, True)),
    ({"peak_rss_mib": 2600.0, "startup_time": 6.7}, {"peak_rss_mib": 2500.0}, (False, False, False)),
    ({"error": "exit 1"}, {"peak_rss_mib": 2500.0}, (None, None, None)),
])
def test_memory_targets(ours, peer, expected):
    t = memory.targets(ours, peer, 1885 * MiB)
    assert t["rss_bound_mib"] == pytest.approx(1.15 * 1885 + 300)
    assert (t["rss_within_bound"], t["rss_below_peer"], t["startup_within_target"]) == expected


def test_memory_table_marks_ferrollm_rows_only():
    ours = {"peak_rss_mib": 2000.0, "startup_time": 3.0, "workload_time": 1.0}
    peer = {"peak_rss_mib": 2800.0, "startup_time": 2.0, "workload_time": 2.0}
    report = {"threads": 2, "max_model_len": 1024,
              "workload": {"num_prompts": 8, "input_len": 128, "output_len": 16},
              "models": {"qwen2": {"weight_file": "w", "weight_bytes": 1885 * MiB,
                                   "engines": {"ferrollm": ours, "hf": peer},
                                   "targets": memory.targets(ours, peer, 1885 * MiB)}}}
    rows = [line for line in memory.format_table(report).splitlines() if "ferrollm |" in line or "HF" in line]
    assert "PASS (≤ 2,468)" in rows[0] and rows[0].count("PASS") == 2 and "MISS" in rows[0]
    assert "PASS" not in rows[1] and "MISS" not in rows[1]
