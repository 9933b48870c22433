"""`ferrollm serve`'s flags: the server's own (vLLM's names) and one flag per engine option
ferrollm implements, generated from `engine/arg_list.py` so the two never drift. A refused
option has no flag (argparse names the unknown flag instead of silently taking it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from ferrollm.engine.arg_list import ENGINE_ARGS


def _flag_type(annotation: str, default: Any) -> dict[str, Any]:
    """argparse settings from the `EngineArgs` field's (string) annotation; a field left at the
    generated base's `Any` goes by vLLM's default instead."""
    annotation = annotation.removeprefix("typing.")
    if annotation == "Any" and default is not None:
        annotation = "Any" if isinstance(default, (dict, list, set)) else type(default).__name__
    elif annotation == "Any":
        annotation = "str"
    if "bool" in annotation:
        return {"action": argparse.BooleanOptionalAction}
    if any(t in annotation for t in ("dict", "list", "Any", "Config")):
        return {"type": json.loads, "metavar": "JSON"}
    if "float" in annotation:
        return {"type": float}
    if "int" in annotation:
        return {"type": int}
    return {"type": str}


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds `serve` to the `ferrollm` command's subparsers."""
    from ferrollm.engine.arg_utils import EngineArgs

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", help="checkpoint folder, .gguf file or hub id")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use in `model` (default: the model argument)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer <key>` on /v1 routes")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    p.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                   help="how the template takes message content: read from it (auto), one string with the "
                        "model's placeholder per image (string), or the list of parts (openai)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_engine_args(p)
    p.set_defaults(func=_serve)
    return p


def add_engine_args(p: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """One flag per engine option ferrollm implements (vLLM's names; unset, each is None so
    `EngineArgs` keeps its default), but those named in ``skip``, which the caller defines."""
    engine = p.add_argument_group("engine options (vLLM's EngineArgs; see `LLM`)")
    for name, (annotation, default) in _implemented_engine_args().items():
        if name not in skip:
            engine.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                                **_flag_type(annotation, default))


def given_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options whose flags were given, by `EngineArgs` field name."""
    return {n: getattr(args, n) for n in _implemented_engine_args() if getattr(args, n, None) is not None}


def _implemented_engine_args() -> dict[str, tuple[str, Any]]:
    """`EngineArgs` fields that ferrollm implements, in field order: name -> (annotation, default)."""
    from ferrollm.engine.arg_utils import EngineArgs

    works = {a.name: a.default for a in ENGINE_ARGS if a.works is not None}
    return {f.name: (str(f.type), works[f.name]) for f in dataclasses.fields(EngineArgs) if f.name in works}


def engine_args_from(args: argparse.Namespace):
    """The `EngineArgs` the flags name; unset flags keep `EngineArgs`' defaults."""
    from ferrollm.engine.arg_utils import EngineArgs

    return EngineArgs(**{**given_engine_args(args), "model": args.model})


def _serve(args: argparse.Namespace) -> None:
    if args.model_tag is not None:
        args.model = args.model_tag
    if args.model is None:
        raise SystemExit("ferrollm serve: a model is required (`ferrollm serve MODEL`)")
    try:
        from ferrollm.entrypoints.openai.api_server import run_server
    except ImportError as e:
        raise SystemExit(f"ferrollm serve needs FastAPI and uvicorn ({e}): pip install 'ferrollm[serve]'") from e

    run_server(args)
