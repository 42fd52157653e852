"""The gRPC servicer: decode, validate, hand to the worker, encode. No math here."""
from __future__ import annotations

import asyncio

import grpc

from logitserve.errors import InvalidRequest
from logitserve.validate import validate_job
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from . import codec
from .status import to_status
from .worker import Worker

_FINISHED = object()
# Response messages a stream may have queued ahead of the network: bounds memory per slow client.
_STREAM_WINDOW = 8


class LogitServeServicer(pb_grpc.LogitServeServicer):
    def __init__(self, worker: Worker, info: pb.ModelInfoResponse, limits, max_message_bytes: int):
        self._worker = worker
        self._info = info
        self._identity = codec.identity_of(info)
        self._limits = limits
        self._max_message_bytes = max_message_bytes

    async def ModelInfo(self, request, context):
        return self._info

    async def Forward(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()
        window = asyncio.Semaphore(_STREAM_WINDOW)
        in_flight: set[str] = set()
        tasks: set[asyncio.Task] = set()

        async def emit(msg) -> None:
            await window.acquire()
            out.put_nowait(msg)

        async def read() -> None:
            async for req in request_iterator:
                rid = req.request_id
                if rid in in_flight:
                    code, message = to_status(InvalidRequest("request_id", f"{rid!r} is already in flight on this stream"))
                    await emit(codec.encode_error(rid, code, message))
                    continue
                in_flight.add(rid)
                task = asyncio.create_task(self._serve_one(req, emit, in_flight))
                tasks.add(task)
                task.add_done_callback(lambda t: (tasks.discard(t), out.put_nowait(_FINISHED)))

        # Done-callbacks run after a task is done, so each _FINISHED sees the state it announces.
        reader = asyncio.create_task(read())
        reader.add_done_callback(lambda _: out.put_nowait(_FINISHED))
        try:
            while True:
                item = await out.get()
                if item is _FINISHED:
                    if reader.done() and not tasks and out.empty():
                        break
                    continue
                window.release()
                yield item
        finally:
            reader.cancel()
            for t in list(tasks):
                t.cancel()

    async def _serve_one(self, req: pb.ForwardRequest, emit, in_flight: set[str]) -> None:
        rid = req.request_id
        try:
            job = codec.decode_job(req)
            validate_job(job, self._limits)
            n = 0
            async for piece in self._worker.stream(job):
                for msg in codec.encode_piece(rid, piece, self._max_message_bytes):
                    await emit(msg)
                    n += 1
            await emit(codec.encode_done(rid, job, self._identity, n))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            code, message = to_status(e)
            await emit(codec.encode_error(rid, code, message))
        finally:
            in_flight.discard(rid)
