"""The loopback ceiling: a plain grpc.aio server streaming raw bytes, no protobuf schema, no math.

`python bench/raw_stream.py --serve PORT` serves; `ceiling(address, total, message)` measures bytes/s.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import grpc

METHOD = "/bench.Raw/Stream"


async def _serve(port: int) -> None:
    async def stream(request: bytes, context):
        total, size = (int(x) for x in request.decode().split(","))
        block = b"\x01" * size
        for _ in range(total // size):
            yield block

    handler = grpc.method_handlers_generic_handler("bench.Raw", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None, response_serializer=None)})
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def ceiling(address: str, total: int, message: int) -> float:
    """Seconds to receive `total` bytes in `message`-byte messages."""
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        call = ch.unary_stream(METHOD, request_serializer=None, response_deserializer=None)
        t = time.perf_counter()
        n = sum(len(m) for m in call(f"{total},{message}".encode()))
        dt = time.perf_counter() - t
    assert n == total // message * message
    return dt


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--serve", type=int, required=True)
    sys.exit(asyncio.run(_serve(p.parse_args().serve)))
