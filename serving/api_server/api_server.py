"""The tier server: one engine behind the OpenAI API (as vLLM serves it), plus health,
tokenizer and Prometheus endpoints.

Every error is OpenAI-shaped JSON; bad input is a 4xx, never a 500 or a stack trace.
"""

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from serving.api_server.auth import APIKeyAuth
from serving.api_server.metrics import ServerMetrics
from serving.api_server.protocol import DetokenizeRequest, TokenizeRequest
from serving.api_server.responses import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from serving.api_server.serving_chat import chat_router
from serving.api_server.serving_completion import completions_router
from serving.api_server.serving_engine import APIError, OpenAIServing
from serving.engine.async_engine import AsyncEngine
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.checkpoint import GenerationConfigMode, sampling_defaults
from serving.model.graphs.decode import Progress
from serving.model.host_threads import build_off_thread
from serving.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message (and the offending parameter) from FastAPI's validation errors,
    without echoing the input back."""
    errors = exc.errors()
    parts, params = [], []
    for error in errors[:5]:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        if error.get("type") == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", "")
            return f"The request body is not valid JSON: {detail}", None
        if not loc and error.get("type") in ("model_attributes_type", "dict_type", "missing"):
            return "The request body must be a JSON object (Content-Type: application/json).", None
        params.append(".".join(loc))
        parts.append(f"{params[-1]}: {error.get('msg')}" if loc else str(error.get("msg")))
    more = f" (and {len(errors) - 5} more errors)" if len(errors) > 5 else ""
    return "; ".join(parts) + more, (params[0] or None) if params else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, "Internal server error.", type="server_error").response()


def warmup_body(progress: Progress) -> dict[str, int]:
    return {"graphs_compiled": progress.compiled, "graphs_wanted": progress.wanted}


def warming_response(progress: Progress) -> JSONResponse:
    """A 503 in OpenAI's error shape, with the warm-up's progress beside the error."""
    error = APIError(
        503,
        f"Warming up: {progress.compiled} of {progress.wanted} decode graphs compiled.",
        type="server_error",
        code="warming_up",
        headers={"Retry-After": "1"},
    )
    body = error.body.model_dump() | {"status": "warming_up", "warmup": warmup_body(progress)}
    return JSONResponse(body, 503, headers=error.headers)


def build_app(
    engine: AsyncEngine,
    tokenizer: Tokenizer,
    model_name: str,
    api_key: str | None = None,
    sampling_defaults: dict[str, float] | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """The app over a running engine; the caller owns the engine, and `on_shutdown`, run when
    the app shuts down, stops it. `sampling_defaults` fill the sampling fields a request
    leaves unset."""
    metrics = ServerMetrics(engine.engine, model_name)
    serving = OpenAIServing(engine, tokenizer, model_name, metrics, dict(sampling_defaults or {}))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(
        title="tierserve", summary=f"OpenAI-compatible server for {model_name}", lifespan=lifespan
    )
    if api_key:
        app.add_middleware(APIKeyAuth, api_keys=[api_key])
    install_error_handlers(app)
    app.include_router(chat_router(serving))
    app.include_router(completions_router(serving))

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        card = ModelCard(id=model_name, max_model_len=serving.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        """vLLM's semantics: 200 once the engine serves at full speed. While its decode steps
        still compile it answers (eagerly, slower), but /health says 503 with how far the
        warm-up is, so a gateway or a load balancer sends it traffic only once it is fast.
        Full speed is one stream's: graphs of more rows, compiled apart, come in after
        (`EngineConfig.compile_graphs_apart`); until then such steps run in chunks."""
        if not engine.healthy:
            raise APIError(503, "The engine is not running.", type="server_error")
        progress = engine.engine.warmup()
        if not progress.ready:
            return warming_response(progress)
        if not progress.done:  # the larger graphs still compile apart
            return JSONResponse({"status": "ok", "warmup": warmup_body(progress)})
        return JSONResponse({"status": "ok"})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        serving.check_model(body.model)
        text = body.prompt
        if text is None:
            text = serving.render_chat(
                body.messages or [],
                body.tools,
                body.add_generation_prompt,
                body.chat_template_kwargs,
            )
        tokens = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        response = TokenizeResponse(
            count=len(tokens), max_model_len=serving.max_model_len, tokens=tokens
        )
        return JSONResponse(response.model_dump())

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        serving.check_model(body.model)
        if any(t >= tokenizer.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})", param="tokens")
        return JSONResponse(
            DetokenizeResponse(
                prompt=tokenizer.decode(body.tokens, skip_special_tokens=False)
            ).model_dump()
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _not_health_checks(record: logging.LogRecord) -> bool:
    """Leave /health out of the access log: a gateway probes a warming tier ten times a
    second, which would bury the requests."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (len(args) > 2 and args[2] == "/health")


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8100,
    api_key: str | None = None,
    engine_config: EngineConfig | None = None,
    model_name: str | None = None,
    generation_config: GenerationConfigMode = "auto",
) -> None:
    """Load a checkpoint and serve it until interrupted; the model is named after its
    directory unless `model_name` says otherwise. With `generation_config="auto"` requests
    inherit the checkpoint's recommended sampling settings, as vLLM does."""
    defaults = sampling_defaults(model_dir, generation_config)
    if defaults:
        log.info(
            "Default sampling parameters from the checkpoint's generation_config.json: %s "
            "(--generation-config vllm ignores them)",
            defaults,
        )
    # Not on this thread, which then runs the event loop: see `host_threads`.
    engine = build_off_thread(lambda: LLMEngine.from_checkpoint(model_dir, engine_config))
    assert engine.tokenizer is not None  # from_checkpoint always loads one
    aengine = AsyncEngine(engine)
    name = model_name or Path(model_dir).resolve().name
    logging.getLogger("uvicorn.access").addFilter(_not_health_checks)

    def stop() -> None:
        """The engine's thread and its compile process end with the server. At the app's
        shutdown: after a SIGTERM, uvicorn raises the signal again once it has shut down, and
        its default action ends the process before a `finally` here would run."""
        aengine.stop()
        if engine.compile_apart is not None:
            engine.compile_apart.stop()

    try:
        app = build_app(aengine, engine.tokenizer, name, api_key, defaults, stop)
        uvicorn.run(app, host=host, port=port)
    finally:  # a server that never started (its port taken), or ended by an exception
        stop()
