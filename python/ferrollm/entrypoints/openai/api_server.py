"""The ASGI app of `ferrollm serve` (FastAPI on uvicorn, as vLLM's): routes, API-key check and
the one place errors become OpenAI-style JSON. Generation goes to `serving.OpenAIServing`; the
app holds no engine state beyond the `AsyncLLM` handle.

Errors: a bad request (pydantic validation, `ValueError` such as `InvalidRequestError`, or an
unsupported feature's `NotImplementedError`) is 400 with `message`, `type` and `param`; an
unknown model name is 404; a wrong or missing key under `--api-key` is 401; anything else 500.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ferrollm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    error_body,
)
from ferrollm.entrypoints.openai.serving import OpenAIServing
from ferrollm.v1.engine.async_llm import AsyncLLM


def _error(message: str, kind: Any, code: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code, param), status_code=code)


def _param_of(message: str) -> str | None:
    """Our messages open with the parameter's name in backticks ("`n` must be ...")."""
    m = re.match(r"`([^`]+)`", message)
    return m.group(1) if m else None


async def _until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only the disconnect comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Any) -> Any:
    """Runs `work` (a coroutine) unless the client leaves first; then cancels it, which closes
    its engine generators and so aborts their requests. A streamed response is handed back at
    once, and Starlette's streaming handles its own disconnects."""
    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if handler.done():
        watcher.cancel()
        return handler.result()
    handler.cancel()
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in exc.errors())
        return _error(message or "invalid request body", "BadRequestError", 400, ".".join(loc) or None)

    @app.exception_handler(ValueError)
    @app.exception_handler(NotImplementedError)
    async def bad_request(_: Request, exc: Exception) -> JSONResponse:
        return _error(str(exc), "BadRequestError", 400, _param_of(str(exc)))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        return _error(f"{type(exc).__name__}: {exc}", "InternalServerError", 500)


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              chat_template: str | None = None, chat_template_content_format: str = "auto") -> FastAPI:
    """The server's app over a running engine.

    Args:
        engine: The `AsyncLLM` the requests run on.
        served_model_names: Names clients may put in `model`; the first is reported.
        api_key: When set, every `/v1` route needs `Authorization: Bearer <api_key>`.
        chat_template: Replaces the tokenizer's chat template.
        chat_template_content_format: "auto", "string" or "openai", as `LLM.chat` takes it.
    """
    app = FastAPI(title="ferrollm")
    serving = OpenAIServing(engine, served_model_names[0], chat_template, chat_template_content_format)
    created = int(time.time())
    _add_error_handlers(app)
    metrics = None
    try:
        from ferrollm.entrypoints.openai.metrics import StatLogger

        metrics = engine.stat_logger = StatLogger(engine.engine.core, served_model_names[0])
    except ImportError:  # prometheus_client is optional: no /metrics without it
        pass

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if (api_key is not None and request.url.path.startswith("/v1")
                and request.headers.get("authorization") != f"Bearer {api_key}"):
            return _error("Unauthorized: a valid API key must be given as `Authorization: Bearer <key>`",
                          "AuthenticationError", 401)
        return await call_next(request)

    def check_model(name: str | None) -> JSONResponse | None:
        if name is None or name in served_model_names:
            return None
        return _error(f"The model `{name}` does not exist.", "NotFoundError", 404, "model")

    async def respond(result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine.errored else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            return _error("/metrics needs prometheus_client (pip install 'ferrollm[serve]')", "NotFoundError", 404)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict[str, str]:
        from ferrollm import __version__

        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        root = str(engine.engine.args.model)
        data = [{"id": n, "object": "model", "created": created, "owned_by": "ferrollm", "root": root,
                 "parent": None, "max_model_len": engine.model_config.max_model_len} for n in served_model_names]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return check_model(req.model) or await respond(await cancel_on_disconnect(request, serving.completion(req)))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        return check_model(req.model) or await respond(await cancel_on_disconnect(request, serving.chat(req)))

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest) -> Response:
        return check_model(req.model) or JSONResponse(await serving.embeddings(req))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        if (req.prompt is None) == (req.messages is None):
            return _error("exactly one of `prompt` and `messages` must be given", "BadRequestError", 400, "prompt")
        if req.messages is not None:
            ids = serving.render_chat(req.messages, req.add_generation_prompt)["prompt_token_ids"]
        else:
            ids = serving.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        return check_model(req.model) or JSONResponse(
            {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len})

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        return check_model(req.model) or JSONResponse({"prompt": serving.tokenizer.decode(req.tokens)})

    return app


def run_server(args: argparse.Namespace) -> None:
    """Loads the engine from the parsed `ferrollm serve` flags and serves until interrupted."""
    import uvicorn

    from ferrollm.entrypoints.openai.cli_args import engine_args_from

    engine = AsyncLLM.from_engine_args(engine_args_from(args))
    try:
        names = args.served_model_name or [args.model]
        app = build_app(engine, names, args.api_key, _read_template(args.chat_template),
                        args.chat_template_content_format)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        engine.shutdown()


def _read_template(template: str | None) -> str | None:
    from ferrollm.entrypoints.llm import _load_chat_template

    return _load_chat_template(template)
