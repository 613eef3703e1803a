"""The FastAPI app: OpenAI routes, tokenize, health/ready, metrics, error bodies, and the engine's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import tidal
from tidal.sampling_params import SamplingParams
from tidal.server.errors import (
    APIError,
    bad_request,
    internal_error,
    model_not_found,
    not_found,
    not_ready,
)
from tidal.server.generation import ClientGone
from tidal.server.guards import admit, check_auth
from tidal.server.inputs import chat_tokens
from tidal.server.metrics import CONTENT_TYPE
from tidal.server.openapi import serve_openapi
from tidal.server.protocol import (
    parse_request,
)
from tidal.server.protocol_tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    parse_tokenize_request,
)
from tidal.server.responses import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from tidal.server.routes_chat import create_chat_completion
from tidal.server.routes_completions import create_completion
from tidal.server.routes_responses import create_response, stored_response
from tidal.server.state import ServerState

log = logging.getLogger(__name__)

# Rejections counted in tidal:request_rejected_total: statuses that mean "not served".
_REJECTED_STATUSES = (400, 401, 404, 413, 415, 429, 503)
# 503s for requests the engine had started are failures (tidal:requests_failed_total), not refusals.
_FAILED_CODES = ("engine_restarted", "engine_unavailable")
_WARMUP_PROMPT = "Hello"
# The signal handler only sets state.draining; the drain cut notices it within this long.
_DRAIN_POLL_S = 0.1
# Waits between warm-up attempts after a failure (the last one repeats).
_WARM_RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0)


async def warm_up(state: ServerState) -> None:
    """Run two short concurrent greedy requests (a batch of prefills, then decodes) before /ready."""
    tok = state.tokenizer
    ids = tok.encode(_WARMUP_PROMPT)[: max(1, state.limits.max_input_tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)

    async def one(i: int) -> None:
        async for _ in state.engine.generate(ids, params, f"warmup-{i}"):
            pass

    await asyncio.gather(one(0), one(1))


def warmup_status(state: ServerState) -> dict[str, object]:
    """/health's view of the warm-up: ok once done, running before the first failure, retrying
    (with the failed attempts and the last error) after one; off with server.warmup false."""
    if state.warm:
        status = "ok" if state.config.server.warmup else "off"
    else:
        status = "retrying" if state.warmup_failures else "running"
    out: dict[str, object] = {"status": status, "failed_attempts": state.warmup_failures}
    if state.warmup_error is not None:
        out["last_error"] = state.warmup_error
    return out


def build_app(state: ServerState) -> FastAPI:
    """The app for one served model; the engine starts and stops with the app's lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        warm_task = asyncio.create_task(_warm(state))
        cut_task = asyncio.create_task(_cut_drain(state))
        try:
            yield
        finally:
            state.draining = True
            warm_task.cancel()
            cut_task.cancel()
            await state.engine.shutdown()

    # /openapi.json only: a docs UI would pull its scripts from a CDN.
    app = FastAPI(
        title="tidal",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    serve_openapi(app)
    app.state.tidal = state
    if state.config.server.allowed_origins:
        # Browsers' preflight (OPTIONS) is answered here, before routes and the key check; keys
        # travel in a header, so no credentials (cookies) are allowed.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.config.server.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            max_age=600,
        )
    engine = state.engine
    for i, replica in enumerate(engine.replicas):  # one, or data parallel's N
        # None (0 bytes) for the in-thread engine
        state.metrics.watch_engine(lambda r=replica: r.engine_pid, replica=i)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        if exc.status in _REJECTED_STATUSES and exc.code not in _FAILED_CODES:
            state.metrics.rejected.labels(reason=exc.code or str(exc.status)).inc()
        return Response(exc.body(), exc.status, exc.headers, media_type="application/json")

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        err = (
            not_found(request.url.path)
            if exc.status_code == 404
            else APIError(exc.status_code, str(exc.detail))
        )
        return Response(err.body(), err.status, media_type="application/json")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        err = internal_error()
        return Response(err.body(), err.status, media_type="application/json")

    app.add_api_route("/v1/completions", create_completion, methods=["POST"])
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"])
    app.add_api_route("/v1/responses", create_response, methods=["POST"])
    for path in ("/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"):
        app.add_api_route(path, stored_response, methods=["GET", "DELETE"], include_in_schema=False)
    app.add_api_route(
        "/v1/responses/{response_id}/cancel", stored_response, methods=["POST"],
        include_in_schema=False,
    )  # fmt: skip

    def model_card() -> ModelCard:
        return ModelCard(
            id=state.served_name, root=state.model_root, max_model_len=state.limits.max_model_len
        )

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request, state)
        return Response(
            ModelList(data=[model_card()]).model_dump_json(), media_type="application/json"
        )

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        """OpenAI's retrieve-model (client.models.retrieve)."""
        check_auth(request, state)
        if model != state.served_name:
            raise model_not_found(model, [state.served_name])
        return Response(model_card().model_dump_json(), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        _, req = await admit(request, parse_tokenize_request)
        tok = state.tokenizer
        if isinstance(req, TokenizeChatRequest):
            ids = await asyncio.to_thread(chat_tokens, req, tok)
        else:
            special = bool(req.add_special_tokens)
            ids = await asyncio.to_thread(tok.encode, req.prompt, add_special_tokens=special)
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = TokenizeResponse(
            count=len(ids), max_model_len=state.limits.max_model_len, tokens=ids, token_strs=strs
        )
        return Response(body.model_dump_json(), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        _, req = await admit(request, partial(parse_request, DetokenizeRequest))
        bad = next((t for t in req.tokens if t >= state.limits.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"Invalid value for 'tokens': token id {bad} is outside the vocabulary "
                f"(expected ids in [0, {state.limits.vocab_size}))",
                "tokens",
                "invalid_value",
            )
        text = state.tokenizer.decode(req.tokens, skip_special_tokens=False)
        return Response(
            DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json"
        )

    @app.get("/health")
    async def health() -> Response:
        body: dict[str, object] = {"status": "ok", "warmup": warmup_status(state)}
        replicas = state.engine.replicas
        if len(replicas) > 1:  # data parallel: healthy while any replica serves
            body["replicas"] = [
                {"replica": i, "up": r.alive, "pid": r.engine_pid} for i, r in enumerate(replicas)
            ]
        if not state.engine.alive:
            body["status"] = "engine down"
            return JSONResponse(body, 503)
        return JSONResponse(body)

    @app.get("/ready")
    async def ready() -> Response:
        if state.draining:
            err = not_ready("The server is shutting down")
        elif not state.warm:
            err = not_ready("The model is warming up")
        elif not state.engine.alive:
            err = not_ready("The engine is down")
        else:
            return JSONResponse({"status": "ready"})
        return Response(err.body(), err.status, err.headers, media_type="application/json")

    @app.get("/version")
    async def version() -> Response:
        """vLLM's GET /version: which release answers (deploy scripts and dashboards ask)."""
        return JSONResponse({"version": tidal.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _cut_drain(state: ServerState) -> None:
    """Once draining, let running requests finish for the drain timeout less a margin, then end
    them with an error (a stream gets an error event and [DONE]) before uvicorn cancels them."""
    while not state.draining:
        await asyncio.sleep(_DRAIN_POLL_S)
    drain_s = state.config.server.drain_timeout_s
    # The margin lets the error events go out before uvicorn's own timeout (the same length,
    # started by the same signal) cancels the responses mid-stream.
    await asyncio.sleep(max(0.0, drain_s - min(1.0, drain_s / 4)))
    num = state.engine.interrupt_all("the server is shutting down")
    if num:
        log.warning("drain timeout: ended %d requests still running", num)


async def _warm(
    state: ServerState, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
) -> None:
    """Warm up, then mark the server ready. A failed warm-up (an engine that crashed and is
    being restarted, say) is retried with backoff while /ready says 503, rather than leaving the
    server unready for good."""
    attempt = 0
    while not state.draining:
        try:
            if state.config.server.warmup:
                await warm_up(state)
            state.warm = True
            state.engine.ready = True
            log.info("warm-up done")
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            delay = _WARM_RETRY_S[min(attempt, len(_WARM_RETRY_S) - 1)]
            attempt += 1
            state.warmup_failures = attempt
            state.warmup_error = f"{type(e).__name__}: {e}"
            log.exception(
                "warm-up failed (attempt %d); /ready stays 503, retrying in %.0f s", attempt, delay
            )
            await sleep(delay)
