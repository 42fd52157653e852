"""Prometheus metrics of one server (its own registry, so tests can build several), served on --metrics-port."""
from __future__ import annotations

import os
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0.0


class Metrics:
    """Requests by output and status, tokens, bytes, queue, batches, latencies, memory."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("logitserve_requests", "Finished requests by output asked for and final status",
                                ["output", "status"], registry=r)
        self.tokens = Counter("logitserve_tokens", "Tokens of the requests that finished OK", registry=r)
        self.bytes_sent = Counter("logitserve_response_bytes", "Bytes of the response messages sent", registry=r)
        self.queue_requests = Gauge("logitserve_queue_requests", "Requests waiting for a batch", registry=r)
        self.queued_tokens = Gauge("logitserve_queued_tokens", "Tokens waiting or running", registry=r)
        self.batch_requests = Histogram("logitserve_batch_requests", "Requests per batch", registry=r,
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.batch_tokens = Histogram("logitserve_batch_tokens", "Tokens per batch", registry=r,
                                      buckets=tuple(2 ** i for i in range(4, 19)))
        self.queue_wait = Histogram("logitserve_queue_wait_seconds", "Admission to the start of its batch",
                                    registry=r, buckets=_LATENCY)
        self.compute = Histogram("logitserve_batch_compute_seconds", "One batch's compute, first to last piece",
                                 registry=r, buckets=_LATENCY)
        self.latency = Histogram("logitserve_request_seconds", "A request end to end, decode to its last message",
                                 registry=r, buckets=_LATENCY)
        rss = Gauge("logitserve_rss_bytes", "Resident memory of this process", registry=r)
        rss.set_function(_rss_bytes)
        cuda = Gauge("logitserve_cuda_memory_bytes", "CUDA memory allocated by torch (0 without a GPU)", registry=r)
        cuda.set_function(_cuda_bytes)

    def bind_scheduler(self, scheduler) -> None:
        self.queue_requests.set_function(scheduler.queue_length)
        self.queued_tokens.set_function(scheduler.queued_tokens)

    def serve(self, port: int, host: str = "0.0.0.0") -> Optional[object]:
        """Expose /metrics over HTTP on `port` (0: a free one); returns the http server."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server


def _cuda_bytes() -> float:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return 0.0
    return float(torch.cuda.memory_allocated())
