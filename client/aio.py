"""AsyncTeacherClient: many requests in flight on one bidirectional stream."""
from __future__ import annotations

import asyncio
import itertools
from typing import Optional, Sequence

import grpc

from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from .api import ModelInfo, OutputsMixin, model_info_of
from .assemble import Assembly, wanted_fields
from .errors import LogitServeError
from .wire import Wanted, build_request

def _pem(value) -> Optional[bytes]:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    from pathlib import Path

    return Path(value).read_bytes()


# Responses are chunked under 4 MiB by default; leave room for servers configured larger.
DEFAULT_MAX_RECEIVE = 64 << 20


class AsyncTeacherClient(OutputsMixin):
    """`async with AsyncTeacherClient("host:port") as c: lp = await c.logprobs([[1, 2, 3]])`."""

    def __init__(self, address: str, *, max_receive_bytes: int = DEFAULT_MAX_RECEIVE,
                 options: Sequence[tuple] = (), tls: bool = False, root_certificates=None,
                 certificate_chain=None, private_key=None, token: Optional[str] = None):
        """TLS when `tls` or any certificate is given (PEM bytes or a file path; no root_certificates: the
        system's roots); `certificate_chain` + `private_key`: a client certificate for mTLS; `token`: sent
        as `authorization: Bearer <token>` on every call."""
        opts = [("grpc.max_receive_message_length", max_receive_bytes), ("grpc.max_send_message_length", -1),
                *options]
        if tls or root_certificates or certificate_chain:
            creds = grpc.ssl_channel_credentials(_pem(root_certificates), _pem(private_key), _pem(certificate_chain))
            self._channel = grpc.aio.secure_channel(address, creds, options=opts)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=opts)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._stub = pb_grpc.LogitServeStub(self._channel)
        self._call = None
        self._reader: Optional[asyncio.Task] = None
        self._pending: dict[str, tuple[Assembly, asyncio.Future]] = {}
        self._ids = itertools.count()
        self._open_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()   # grpc.aio allows one write at a time per stream

    async def __aenter__(self) -> "AsyncTeacherClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        await self._channel.close()

    async def model_info(self, timeout: Optional[float] = None) -> ModelInfo:
        try:
            return model_info_of(await self._stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout,
                                                            metadata=self._metadata))
        except grpc.RpcError as e:
            raise LogitServeError.from_rpc(e) from None

    def _request(self, seqs: Sequence, wanted: Wanted, pick, bf16_as_torch: bool = False):
        async def run():
            return pick(await self.submit(seqs, wanted, bf16_as_torch))
        return run()

    async def submit(self, seqs: Sequence, wanted: Wanted, bf16_as_torch: bool = False):
        """Send one request on the shared stream and wait for its ForwardResult."""
        rid = f"r{next(self._ids)}"
        req = build_request(rid, seqs, wanted)
        call = await self._stream()
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = (Assembly(len(req.sequences) or len(req.texts), wanted_fields(req), bf16_as_torch), fut)
        # A write interrupted half way would break the whole stream: a cancel during it lets it finish.
        send = asyncio.ensure_future(self._write(call, req))
        try:
            await asyncio.shield(send)
        except (grpc.RpcError, asyncio.InvalidStateError) as e:
            self._pending.pop(rid, None)
            if isinstance(e, grpc.RpcError):
                raise LogitServeError.from_rpc(e) from None
            raise LogitServeError(grpc.StatusCode.UNAVAILABLE, "stream closed") from None
        except asyncio.CancelledError:
            self._pending.pop(rid, None)
            send.add_done_callback(lambda t: t.exception() is None and asyncio.ensure_future(self._cancel(call, rid)))
            raise
        try:
            return await fut
        except asyncio.CancelledError:
            await self._cancel(call, rid)
            raise
        finally:
            self._pending.pop(rid, None)

    async def _write(self, call, req: pb.ForwardRequest) -> None:
        async with self._write_lock:
            await call.write(req)

    async def _cancel(self, call, rid: str) -> None:
        """Tell the server, so the request's queued work is dropped and its memory freed."""
        if not call.done():
            try:
                await asyncio.shield(self._write(call, pb.ForwardRequest(request_id=rid, cancel=True)))
            except (grpc.RpcError, asyncio.InvalidStateError, asyncio.CancelledError):
                pass

    async def _stream(self):
        async with self._open_lock:
            if self._call is None or self._call.done():
                self._call = self._stub.Forward(metadata=self._metadata)
                self._reader = asyncio.create_task(self._read(self._call))
            return self._call

    async def _read(self, call) -> None:
        error = LogitServeError(grpc.StatusCode.UNAVAILABLE, "the stream ended before the request completed")
        try:
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    break
                self._dispatch(resp)
        except grpc.RpcError as e:
            error = LogitServeError.from_rpc(e)
        except asyncio.CancelledError:
            error = LogitServeError(grpc.StatusCode.CANCELLED, "client closed")
        finally:
            if self._call is call:
                self._call = None
            for _, fut in list(self._pending.values()):
                if not fut.done():
                    fut.set_exception(error)

    def _dispatch(self, resp: pb.ForwardResponse) -> None:
        entry = self._pending.get(resp.request_id)
        if entry is None or entry[1].done():
            return  # a request this client gave up on
        assembly, fut = entry
        kind = resp.WhichOneof("body")
        try:
            if kind == "chunk":
                assembly.add(resp.chunk)
            elif kind == "done":
                fut.set_result(assembly.finish(resp.done))
            elif kind == "error":
                fut.set_exception(LogitServeError.from_code(resp.error.code, resp.error.message))
        except LogitServeError as e:
            fut.set_exception(e)
