"""Lists the fields of vLLM's `EngineArgs` from a vLLM source tree, with each field's vLLM
default and config group, and compares them with ferrollm's list (`ferrollm.engine.arg_list`).

    python tools/vllm_engine_args.py /path/to/vllm-0.32.0/vllm          # differences only
    python tools/vllm_engine_args.py /path/to/vllm-0.32.0/vllm --dump   # every field

It reads the source with `ast` (vLLM need not be importable): a field's default is followed to
the config class it names (`ModelConfig.seed`, `get_field(CacheConfig, ...)`), and its group is
the `add_argument_group` title under which `add_cli_args` registers it (else the config class its
default comes from). Defaults that are not literals print as their source text.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any


def _classes(root: Path) -> dict[str, ast.ClassDef]:
    out: dict[str, ast.ClassDef] = {}
    for path in sorted((root / "config").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, node)
    return out


def _field_default(cls: ast.ClassDef, name: str) -> Any:
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            return _literal(node.value)
    return "<unresolved>"


def _literal(node: ast.expr | None) -> Any:
    """A default's value: a literal, `field(default=...)`, or `field(default_factory=f)` as f()."""
    if node is None:
        return "<required>"
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("field", "Field"):
        for kw in node.keywords:
            if kw.arg == "default":
                return _literal(kw.value)
            if kw.arg == "default_factory":
                factory = ast.unparse(kw.value)
                return {"dict": {}, "list": [], "set": set()}.get(factory, f"<{factory}()>")
    try:
        return ast.literal_eval(node)
    except ValueError:
        return f"<{ast.unparse(node)}>"


def _resolve(node: ast.expr | None, classes: dict[str, ast.ClassDef]) -> tuple[Any, str | None]:
    """(default, the config class it comes from)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in classes:
        return _field_default(classes[node.value.id], node.attr), node.value.id
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "get_field":
        owner = ast.unparse(node.args[0])
        attr = ast.literal_eval(node.args[1])
        return (_field_default(classes[owner], attr) if owner in classes else "<unresolved>"), owner
    return _literal(node), None


def _cli_groups(func: ast.FunctionDef) -> dict[str, str]:
    """Field name -> the title of the argument group `add_cli_args` puts it in."""
    titles: dict[str, str] = {}
    out: dict[str, str] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and getattr(node.value.func, "attr", "") == "add_argument_group":
            for kw in node.value.keywords:
                if kw.arg == "title" and isinstance(kw.value, ast.Constant):
                    titles[node.targets[0].id] = kw.value.value  # type: ignore[attr-defined]
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in titles \
                and node.args and isinstance(node.args[0], ast.Constant):
            flag = str(node.args[0].value).lstrip("-").replace("-", "_")
            out.setdefault(flag, titles[node.func.value.id])
    return out


def vllm_engine_args(root: Path) -> list[tuple[str, str, Any]]:
    """(name, group, default) of every `EngineArgs` field, in vLLM's order."""
    classes = _classes(root)
    module = ast.parse((root / "engine" / "arg_utils.py").read_text())
    engine = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    add_cli = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
    groups = _cli_groups(add_cli)
    out = []
    for node in engine.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            default, owner = _resolve(node.value, classes)
            group = groups.get(node.target.id) or owner or "VllmConfig"
            out.append((node.target.id, group, default))
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    fields = vllm_engine_args(Path(argv[0]))
    if "--dump" in argv:
        for name, group, default in fields:
            print(f"{group:28} {name:40} {default!r}")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from ferrollm.engine.arg_list import ENGINE_ARGS

    ours = {a.name: a for a in ENGINE_ARGS}
    theirs = {name: (group, default) for name, group, default in fields}
    diffs = [f"missing here: {n} ({g}, default {d!r})" for n, (g, d) in theirs.items() if n not in ours]
    diffs += [f"not in vLLM: {n}" for n, a in ours.items() if n not in theirs and a.group != "ferrollm"]
    diffs += [f"default differs: {n}: vLLM {theirs[n][1]!r}, list {ours[n].default!r}"
              for n in ours if n in theirs and not str(theirs[n][1]).startswith("<")
              and theirs[n][1] != ours[n].default]
    print("\n".join(diffs) or "the list matches vLLM's EngineArgs")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
