"""`leapdecode serve`: an OpenAI-compatible HTTP server on FastAPI, the engine in its own process
(worker.py).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics. Streaming is Server-Sent Events ending with `data: [DONE]`. A request may
override the server's speculation with `"speculation": {"method": ..., "num_speculative_tokens":
...}`. Bad input is a 400 (404 for an unknown model) with an OpenAI-style error body, a body
over MAX_BODY a 413, a full queue a 429 with Retry-After; a client that goes away aborts its
request and frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import chat
from ..config import SpecConfig
from ..errors import LeapDecodeError
from ..frontend import Frontend, TextStream
from . import protocol
from .protocol import APIError, GenerationRequest
from .worker import EngineClient, EngineGone, QueueFull

MAX_BODY = 1 << 20  # bytes


def _too_large() -> APIError:
    """413: a body over MAX_BODY (prompts of even the longest contexts are far smaller)."""
    return APIError(
        413,
        f"the request body is larger than this server's limit of {MAX_BODY} bytes "
        f"({MAX_BODY >> 20} MiB): send a shorter prompt or fewer messages, or split the "
        "work into several requests",
        None,
        "request_too_large",
    )


# LeapDecodeError.field -> the request parameter it came from (the rest of SpecConfig's
# fields: "speculation.<field>"; anything else: no parameter)
PARAMS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "max_new_tokens": "max_tokens",
    "prompt": "prompt",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
}


def _param_of(e: LeapDecodeError) -> str | None:
    if e.field is None or e.field in PARAMS:
        return PARAMS.get(e.field)
    return f"speculation.{e.field}" if e.field in SpecConfig.__dataclass_fields__ else None


def _error(e: APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class ClientWatch:
    """Engine events for one request, and whether its client is still there.

    The client is checked every `every` seconds, whether events keep coming or none does,
    so a client that hangs up is noticed within that, even when its request would finish in
    well under a second. (A poll with every event cost the HTTP thread about as much as the
    chunk it guarded, at 16 streams; a streamed response also notices a hang-up by itself,
    as Starlette listens for it.)"""

    def __init__(self, request, events: asyncio.Queue, every: float = 0.5) -> None:
        self.request = request
        self.events = events
        self.every = every
        self.due = time.monotonic() + every  # the next poll of the connection

    async def next(self):
        """The next engine event; None once the client has gone away."""
        while True:
            try:
                ev = self.events.get_nowait()  # most events are waiting already
            except asyncio.QueueEmpty:
                try:
                    ev = await asyncio.wait_for(self.events.get(), timeout=self.every)
                except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11 on
                    ev = None
            now = time.monotonic()
            if ev is None or now >= self.due:
                self.due = now + self.every
                if await self.request.is_disconnected():
                    return None
            if ev is not None:
                return ev


class _Guard:
    """Every request's body-size limit and API key, as plain ASGI middleware: Starlette's
    BaseHTTPMiddleware (`@app.middleware`) passed every streamed chunk through a task and a
    memory stream of its own, and was the HTTP thread's largest cost at 16 streams, time the
    engine thread waited for the GIL, when the engine ran in a thread."""

    def __init__(self, app, api_key: str | None = None) -> None:
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # lower-case byte names
        size = headers.get(b"content-length", b"").decode("latin-1")
        if size.isdigit() and int(size) > MAX_BODY:
            if int(size) <= 64 * MAX_BODY:  # read it away, so the client sees the answer
                more = True
                while more:
                    message = await receive()
                    more = message["type"] == "http.request" and message.get("more_body", False)
            response = _error(_too_large())
            await response(scope, receive, send)
            return
        if (
            self.key
            and scope["path"].startswith("/v1/")
            and headers.get(b"authorization", b"") != self.key
        ):
            response = _error(
                APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer KEY'",
                    None,
                    "invalid_api_key",
                    "authentication_error",
                )
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _usage(seq) -> dict:
    return {
        "prompt_tokens": seq.prompt_len,
        "completion_tokens": seq.n_out,
        "total_tokens": seq.prompt_len + seq.n_out,
    }


def _spec_stats(seq) -> dict:
    s = seq.stats.as_dict()
    k = 0 if seq.spec.method == "none" else seq.spec.num_speculative_tokens
    return {
        "method": seq.spec.method,
        "num_speculative_tokens": k,
        **{
            k: s[k]
            for k in (
                "proposed",
                "accepted",
                "acceptance_rate",
                "mean_accepted_tokens",
                "target_forwards",
            )
        },
    }


def _choice(kind: str, text: str, finish: str | None, delta: bool) -> dict:
    if kind == "text_completion":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if delta:
        return {
            "index": 0,
            "delta": {"content": text} if text else {},
            "logprobs": None,
            "finish_reason": finish,
        }
    return {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish,
    }


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as the OpenAI error body: HTTP errors, request validation, and (a bug)
    anything else as a 500 that says what it was."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(
            APIError(
                exc.status_code,
                str(exc.detail),
                None,
                None,
                "not_found_error" if exc.status_code == 404 else "invalid_request_error",
            )
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return _error(
            APIError(
                500,
                f"internal error: {type(exc).__name__}: {exc}",
                None,
                "internal_error",
                "server_error",
            )
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return _error(protocol.bad(f"invalid request: {exc.errors()}"))


class Routes:
    """The OpenAI-compatible endpoints' work, for `create_app` to route to: a request's body
    read and checked, its Sequence built, submitted to the engine process, answered whole or
    streamed, and aborted when its client goes away."""

    def __init__(
        self, engine: EngineClient, frontend: Frontend, spec: SpecConfig, model_name: str
    ) -> None:
        self.engine, self.frontend, self.spec = engine, frontend, spec
        self.model_name = model_name
        self.created = int(time.time())
        self.end_of_turn: list[int] | None = None  # a chat's stop ids (chat.end_of_turn_ids)

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "leapdecode",
                    "max_model_len": self.frontend.max_context,
                }
            ],
        }

    def health(self):
        if self.engine.gone:
            return JSONResponse({"status": "error", "error": self.engine.gone}, status_code=503)
        return {"status": "ok", "running": self.engine.running, "waiting": self.engine.queued()}

    async def metrics(self) -> Response:
        try:
            text = await self.engine.metrics_text()
        except (EngineGone, TimeoutError, asyncio.TimeoutError) as e:
            return _error(
                APIError(
                    503, f"the engine did not answer: {e}", None, "engine_gone", "server_error"
                )
            )
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def body(self, request: Request) -> dict:
        raw = await request.body()
        if len(raw) > MAX_BODY:  # a body sent without its length (chunked)
            raise _too_large()
        body = protocol.parse_json(raw)
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist: this server serves "
                f"{self.model_name!r} (GET /v1/models)",
                "model",
                "model_not_found",
                "not_found_error",
            )
        return body

    def chat_prompt(self, messages: list[dict], req: GenerationRequest) -> list[int]:
        """The chat's prompt as token ids (its template applied, chat.py); the request then
        stops at the template's end-of-turn tokens as well as the model's EOS."""
        tok = self.frontend.tokenizer
        try:
            ids = chat.chat_ids(
                tok, messages, self.model_name, hint="use POST /v1/completions with a prompt"
            )
        except chat.NoChatTemplate as e:
            raise protocol.bad(str(e), "messages", "no_chat_template") from None
        except LeapDecodeError as e:
            raise protocol.bad(str(e), "messages") from None
        if self.end_of_turn is None:
            self.end_of_turn = chat.end_of_turn_ids(tok)
        req.stop_token_ids = self.end_of_turn
        return ids

    def sequence(self, req: GenerationRequest, prompt, prompt_param: str = "prompt"):
        """prompt_param: what the request calls its prompt ("messages" for a chat)."""
        try:
            seq_spec = self.spec.with_overrides(req.method, req.k, req.k_table)
            if req.spec_fields:
                seq_spec = dataclasses.replace(seq_spec, **req.spec_fields)
            return self.frontend.request(prompt, spec=seq_spec, **req.options())
        except LeapDecodeError as e:  # named as the request names it
            message = str(e).replace("max_new_tokens", "max_tokens")
            param = _param_of(e)
            raise protocol.bad(message, prompt_param if param == "prompt" else param) from None

    async def run(self, request: Request, req: GenerationRequest, prompt, kind: str):
        seq = self.sequence(req, prompt, "prompt" if kind == "text_completion" else "messages")
        try:
            events = self.engine.submit(seq)
        except QueueFull:
            return _error(
                APIError(
                    429,
                    f"the server is busy ({self.engine.max_queue} requests waiting): retry later",
                    None,
                    "queue_full",
                    "rate_limit_error",
                ),
                headers={"Retry-After": "1"},
            )
        except EngineGone as e:
            return _error(
                APIError(
                    503,
                    f"the server cannot generate: {e}; restart it",
                    None,
                    "engine_gone",
                    "server_error",
                )
            )
        rid = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            return StreamingResponse(
                self.stream(request, seq, events, rid, kind, req), media_type="text/event-stream"
            )
        return await self.complete(request, seq, events, rid, kind)

    async def complete(self, request, seq, events, rid, kind):
        watch = ClientWatch(request, events)
        while True:
            ev = await watch.next()
            if ev is None:
                self.engine.abort(seq.id)
                return Response(status_code=499)
            if ev.error:
                return _error(APIError(500, ev.error, None, "internal_error", "server_error"))
            if ev.finished:
                break
        result = self.frontend.result(seq)
        finish = "stop" if result.finish_reason == "stop" else "length"
        return {
            "id": rid,
            "object": kind if kind == "text_completion" else "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [_choice(kind, result.text, finish, False)],
            "usage": _usage(seq),
            "speculation": _spec_stats(seq),
        }

    async def stream(self, request, seq, events, rid, kind, req):
        obj = "text_completion" if kind == "text_completion" else "chat.completion.chunk"

        def chunk(text: str, finish: str | None, usage: dict | None = None) -> str:
            body = {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [_choice(kind, text, finish, True)],
            }
            if usage is not None:
                body["usage"] = usage
                body["speculation"] = _spec_stats(seq)
            return f"data: {json.dumps(body)}\n\n"

        watch = ClientWatch(request, events)
        text = TextStream(seq, self.frontend.decode, self.frontend.result)
        done = False
        try:
            if kind != "text_completion":
                yield chunk("", None).replace('"delta": {}', '"delta": {"role": "assistant"}')
            while True:
                ev = await watch.next()
                if ev is None:
                    return
                if ev.error:
                    err = APIError(500, ev.error, None, "internal_error", "server_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                    done = True
                    return
                if ev.finished:
                    break
                if piece := text.piece():
                    yield chunk(piece, None)
            finish = "stop" if seq.finish_reason == "stop" else "length"
            yield chunk(text.rest(), finish, _usage(seq) if req.include_usage else None)
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done and not seq.finished:
                self.engine.abort(seq.id)  # the client went away: free the slot

    async def handle(self, request: Request, chat: bool):
        try:
            body = await self.body(request)
            if chat:
                messages, req = protocol.parse_chat(body)
                prompt = self.chat_prompt(messages, req)
                return await self.run(request, req, prompt, "chat.completion")
            req = protocol.parse_completion(body)
            return await self.run(request, req, req.prompt, "text_completion")
        except APIError as e:
            return _error(e)


def create_app(
    engine: EngineClient,
    frontend: Frontend,
    spec: SpecConfig,
    model_name: str,
    api_key: str | None = None,
) -> FastAPI:
    """engine: the engine process, loaded (EngineClient.wait_ready); frontend: requests'
    tokenizer side, with the engine's capabilities; spec: the server's default speculation."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        engine.stop()

    app = FastAPI(title="leapdecode", version="1", lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(_Guard, api_key=api_key)
    _add_error_handlers(app)
    routes = Routes(engine, frontend, spec, model_name)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await routes.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await routes.handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return routes.models()

    @app.get("/health")
    async def health():
        return routes.health()

    @app.get("/metrics")
    async def prometheus():
        return await routes.metrics()

    return app


class Server(uvicorn.Server):
    """uvicorn's server, saying what it does on Ctrl-C / SIGTERM: the requests in flight
    finish first (a second Ctrl-C stops at once), otherwise a silent wait."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            busy = len(self.engine.requests)
            what = (
                f"finishing {busy} request{'s' * (busy != 1)} in flight (Ctrl-C again to stop now)"
                if busy
                else "bye"
            )
            print(f"leapdecode: stopping: {what}", flush=True)
        elif not self.force_exit:
            print("leapdecode: stopping now", flush=True)
        super().handle_exit(sig, frame)
