"""Prints the README's vLLM compatibility table from `ferrollm.engine.arg_list`, or rewrites it
in place, so the table cannot drift from what `EngineArgs` does.

    python tools/compat_table.py              # print the table
    python tools/compat_table.py README.md    # rewrite the block between the README's markers

One row per group and outcome: the options that work, the ones accepted because their meaning
already holds here, and the refused ones per reason, in vLLM's group order.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from ferrollm.engine.arg_list import ENGINE_ARGS, VLLM_VERSION  # noqa: E402

START, END = "<!-- engine-args:start -->\n", "<!-- engine-args:end -->"


def _outcome(arg) -> str:
    if arg.works is None:
        return f"refused: {arg.refused}"
    return arg.works if arg.works.startswith("accepted:") else "works"


def compat_table() -> str:
    """The markdown table: | group | options | what ferrollm does |."""
    rows: dict[tuple[str, str], list[str]] = {}
    for arg in ENGINE_ARGS:
        rows.setdefault((arg.group, _outcome(arg)), []).append(f"`{arg.name}`")
    num_works = sum(a.works is not None for a in ENGINE_ARGS)
    lines = [
        f"{len(ENGINE_ARGS)} options ({num_works} work, {len(ENGINE_ARGS) - num_works} refused unless left at "
        f"vLLM's default), vLLM {VLLM_VERSION}'s `EngineArgs` plus ferrollm's own:",
        "",
        "| group | options | ferrollm |",
        "|---|---|---|",
    ]
    lines += [f"| {group} | {', '.join(names)} | {outcome} |" for (group, outcome), names in rows.items()]
    return "\n".join(lines) + "\n"


def update_readme(path: str) -> bool:
    """Rewrites the block between the markers; returns whether it changed."""
    text = Path(path).read_text()
    head, found, rest = text.partition(START)
    if not found:
        raise SystemExit(f"{path} has no {START.strip()} marker")
    _, _, tail = rest.partition(END)
    new = head + START + compat_table() + END + tail
    if new != text:
        Path(path).write_text(new)
    return new != text


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(f"{sys.argv[1]} updated" if update_readme(sys.argv[1]) else "up to date")
    else:
        print(compat_table(), end="")
