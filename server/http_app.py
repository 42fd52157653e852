"""The HTTP front-end (--http-port): vLLM, SGLang and TRL routes on Starlette + uvicorn, in the server's own loop.

Every compute route goes through the shared request pipeline (server/requests.py), so admission,
limits, validation, the scheduler, status mapping, metrics and the access log are the gRPC ones;
this file only reads bodies, checks bearer tokens, and renders answers and errors (gRPC status ->
HTTP status in server/status.py; errors in the OpenAI shape {"error": {message, type, param,
code}}). JSON is encoded by orjson. Health routes need no token, as gRPC health.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
from typing import Awaitable, Callable, Optional

import grpc
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from logitserve.errors import InvalidRequest, TooLarge

from . import generative_scoring, openai_api, reward_api, sglang_api, trl_api
from . import http_answer as answer
from .http_answer import AnswerHold
from .http_common import Ctx, json_object, json_values_bound
from .http_conn import AcceptErrorFilter, Connections, HttpLimits, guarded_protocol
from .http_fields import check_fields
from .requests import Failed
from .status import route_error, to_http, to_status

log = logging.getLogger("logitserve.http")
# Connections the kernel queues for accept(), and so the most asyncio accepts in one turn of the loop before any
# is refused: a flood costs at most this many file descriptors beyond --http-max-connections at a time.
ACCEPT_BACKLOG = 256


def _json(content, status: int = 200, headers: Optional[dict] = None) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json", headers=headers)


def error_response(code: grpc.StatusCode, message: str, param: Optional[str] = None,
                   too_large: bool = False) -> Response:
    status, kind = to_http(code, too_large)
    return _json({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


async def no_route(request: Request, exc: HTTPException) -> Response:
    """404 (unknown path) and 405 (wrong method) in the OpenAI error shape, as every other error."""
    what = "no such route" if exc.status_code == 404 else f"{request.method} is not allowed here"
    message = f"{request.method} {request.url.path[:128]!r}: {what}"
    return _json({"error": {"message": message, "type": route_error(exc.status_code), "param": None,
                            "code": exc.status_code}}, exc.status_code, headers=exc.headers)


class HttpFrontEnd:
    """The routes, their auth and body limits, and the uvicorn server that serves them on one socket."""

    def __init__(self, ctx: Ctx, max_request_bytes: int, auth=None, limits: HttpLimits = HttpLimits()):
        self.ctx = ctx
        self.connections = Connections(limits)
        self._max_request_bytes = max_request_bytes
        self._max_values = json_values_bound(ctx.pipeline.stream_limits)   # bodies bounded before they are parsed
        self._auth = auth                   # security.TokenAuth, or None
        self._server: Optional[uvicorn.Server] = None
        self._task = None
        self.port = 0
        post = self._post
        self.app = Starlette(routes=[
            Route("/v1/completions", post(openai_api.completions), methods=["POST"]),
            Route("/inference/v1/generate", post(openai_api.generate), methods=["POST"]),
            Route("/tokenize", post(openai_api.tokenize), methods=["POST"]),
            Route("/detokenize", post(lambda c, b, _: _sync(openai_api.detokenize(c, b))), methods=["POST"]),
            Route("/v1/models", self._get(lambda: openai_api.models(ctx))),
            Route("/version", self._get(lambda: {"version": ctx.version})),
            Route("/generate", post(sglang_api.generate), methods=["POST"]),
            Route("/get_model_info", self._get(lambda: sglang_api.model_info(ctx))),
            Route("/model_info", self._get(lambda: sglang_api.model_info(ctx))),
            Route("/get_sequence_logprobs/", post(trl_api.sequence_logprobs), methods=["POST"]),
            Route("/classify", post(trl_api.classify), methods=["POST"]),
            Route("/pooling", post(trl_api.pooling), methods=["POST"]),
            Route("/get_reward", post(reward_api.get_reward), methods=["POST"]),
            Route("/v1/embeddings", post(reward_api.embeddings), methods=["POST"]),
            Route("/score", post(reward_api.score), methods=["POST"]),
            Route("/v1/score", post(reward_api.score), methods=["POST"]),
            Route("/generative_scoring", post(generative_scoring.generative_scoring), methods=["POST"]),
            Route("/health", self._health(b"")),
            Route("/health_generate", self._health(b"")),
            Route("/health/", self._health(b'{"status":"ok"}')),
        ], exception_handlers={HTTPException: no_route})

    # -- routes -----------------------------------------------------------------------------------------------
    def _health(self, body: bytes):
        async def health(request: Request) -> Response:
            if self.ctx.pipeline.draining:
                return Response(b"", status_code=503)
            return Response(body, status_code=200, media_type="application/json" if body else None)
        return health

    def _get(self, make: Callable[[], dict]):
        async def get(request: Request) -> Response:
            refused = self._refused(request)
            return refused if refused is not None else _json(make())
        return get

    def _post(self, handler: Callable[[Ctx, dict, str], Awaitable]):
        return functools.partial(self._answer, handler)

    async def _answer(self, handler: Callable[[Ctx, dict, str], Awaitable], request: Request) -> Response:
        """A POST route: the handler's answer to the request's JSON body, or the error it ended with (or the
        token's refusal); the answer's bytes are held in the memory budget from its decoding until sent."""
        response = self._refused(request)
        if response is None:
            client = self.ctx.pipeline.clients.of_http(request.headers.get("authorization", ""),
                                                       request.client.host if request.client else "")
            hold = AnswerHold(self.ctx.pipeline.scheduler, client)
            answer.begin(hold)
            try:
                body = json_object(await self._body(request), max_values=self._max_values)
                check_fields(request.url.path, body)      # a field not honoured: 400 naming it, never dropped
                result = await handler(self.ctx, body, client)
                if isinstance(result, answer.Deferred):     # encoded on a worker thread, never on the loop
                    response = ChunkedJson(await answer.off_loop(result.build, quick=hold.quick), hold, result.status)
                else:
                    response = _json(result)
            except Failed as f:
                o = f.outcome
                response = error_response(o.status, o.message, o.field, o.too_large)
            except Exception as e:     # noqa: BLE001 (before or outside the pipeline: its status, in one place)
                code, message = to_status(e)
                response = error_response(code, message, getattr(e, "field", None), isinstance(e, TooLarge))
            finally:
                if not isinstance(response, ChunkedJson):   # answered, refused, failed or cancelled: all sent
                    hold.release()
        return response

    def _refused(self, request: Request) -> Optional[Response]:
        """A refusal before the body is read: no or a wrong bearer token (401 / 403)."""
        refusal = None if self._auth is None else self._auth.check(
            request.headers.get("authorization", ""), request.url.path, "header 'Authorization: Bearer <token>'")
        return None if refusal is None else error_response(*refusal)

    async def _body(self, request: Request) -> bytes:
        """The body, refused past --max-request-bytes before it is all read."""
        limit = self._max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"body: {declared} bytes is over the server's --max-request-bytes {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"body: over the server's --max-request-bytes {limit}")
            chunks.append(chunk)
        if not size:
            raise InvalidRequest("body", "a JSON object is needed")
        return b"".join(chunks)

    # -- serving ----------------------------------------------------------------------------------------------
    async def start(self, sock: socket.socket, tls=None) -> None:
        """Serve on an open, bound socket (security.SecurityConfig for TLS / mTLS, or None)."""
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=1, http=guarded_protocol(self.connections),
                                timeout_keep_alive=self.connections.limits.keepalive_s, backlog=ACCEPT_BACKLOG,
                                **_tls_options(tls))
        _filter_accept_errors()
        self._server = _Server(config)
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()

    def limits_line(self) -> str:
        return self.connections.limits.describe()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
        await asyncio.to_thread(self.ctx.encoder.close)


def _filter_accept_errors() -> None:
    """asyncio's accept() errors (out of file descriptors) at most once per interval, on the loop's logger."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, AcceptErrorFilter) for f in logger.filters):
        logger.addFilter(AcceptErrorFilter())


class ChunkedJson(Response):
    """A JSON answer sent a slice at a time as it is encoded on a worker thread; its hold is released when the
    last byte is written or the client is gone (a stalled reader: server/http_conn.py aborts it)."""

    def __init__(self, content, hold: AnswerHold, status: int = 200):
        self._content, self._hold, self.status_code = content, hold, status
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        gone, it = asyncio.Event(), None
        listener = asyncio.create_task(_until_disconnected(receive, gone))
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": [(b"content-type", b"application/json")]})
            it = answer.pieces(self._content)
            self._content = None
            while not gone.is_set() and (chunk := await answer.next_piece(it, self._hold)) is not None:
                await send({"type": "http.response.body", "body": bytes(chunk), "more_body": True})
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                it = None
        except OSError:         # the client went away (or was cut for not reading), or the encoding process was
            pass                # lost (encode_process.EncoderLost): the answer ends unfinished, its connection cut
        finally:
            listener.cancel()
            try:
                if it is not None:      # an answer cut short stops encoding (on the thread that encodes it)
                    await answer.off_loop(it.close, quick=self._hold.quick)
            finally:
                self._hold.release()


async def _until_disconnected(receive, gone: asyncio.Event) -> None:
    """Sets `gone` when the client disconnects (or is cut for not reading: server/http_conn.py)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _sync(value):
    return value


class _Server(uvicorn.Server):
    """uvicorn in the server's own loop: SIGINT/SIGTERM stay the server's (it drains, then stops this)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _tls_options(tls) -> dict:
    if tls is None or not tls.tls_cert:
        return {}
    options = {"ssl_certfile": tls.tls_cert, "ssl_keyfile": tls.tls_key}
    if tls.tls_client_ca:
        options.update(ssl_ca_certs=tls.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


def bind(host: str, port: int) -> socket.socket:
    """The HTTP port, bound now (a port in use fails before the model loads)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"--http-port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None
    sock.listen(ACCEPT_BACKLOG)
    sock.setblocking(False)
    return sock
