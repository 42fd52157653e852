"""Prometheus metrics of one server (its own registry, so tests can build several), served on --metrics-port."""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .codec import outputs_of

log = logging.getLogger("logitserve.requests")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0.0


class Totals:
    """Counts and cumulative nanoseconds since start-up, as Triton's ModelStatistics reports them."""

    def __init__(self):
        self._lock = threading.Lock()
        self.success, self.fail, self.queue, self.compute = ([0, 0] for _ in range(4))   # [count, ns] each
        self.batches: dict[int, list[int]] = {}       # requests in a batch -> [batches, ns]
        self.inference_count = self.execution_count = self.last_inference_ms = 0

    def request(self, ok: bool, seconds: float, sequences: int) -> None:
        with self._lock:
            d = self.success if ok else self.fail
            d[0] += 1
            d[1] += int(seconds * 1e9)
            if ok:
                self.inference_count += sequences
                self.last_inference_ms = int(time.time() * 1e3)

    def batch(self, waits: list[float], seconds: float) -> None:
        """One batch of len(waits) requests that waited `waits` seconds each and computed for `seconds`."""
        n, ns = len(waits), int(seconds * 1e9)
        with self._lock:
            self.execution_count += 1
            self.queue[0] += n
            self.queue[1] += int(sum(waits) * 1e9)
            self.compute[0] += n
            self.compute[1] += n * ns
            b = self.batches.setdefault(n, [0, 0])
            b[0] += 1
            b[1] += ns

    def snapshot(self) -> dict:
        with self._lock:
            return dict(success=tuple(self.success), fail=tuple(self.fail), queue=tuple(self.queue),
                        compute=tuple(self.compute), batches={k: tuple(v) for k, v in sorted(self.batches.items())},
                        inference_count=self.inference_count, execution_count=self.execution_count,
                        last_inference_ms=self.last_inference_ms)


class Metrics:
    """Requests by output and status, tokens, bytes, queue, batches, latencies, memory; and the Totals."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("logitserve_requests", "Finished requests by output asked for and final status",
                                ["output", "status"], registry=r)
        self.tokens = Counter("logitserve_tokens", "Tokens of the requests that finished OK", registry=r)
        self.bytes_sent = Counter("logitserve_response_bytes", "Bytes of the response messages sent", registry=r)
        self.shared_prefix_tokens = Counter("logitserve_shared_prefix_tokens",
                                            "Prompt tokens computed once for a group instead of once per sequence",
                                            registry=r)
        self.auth_failures = Counter("logitserve_auth_failures", "Calls refused for a missing or wrong bearer token",
                                     registry=r)
        self.held_bytes = Gauge("logitserve_held_bytes", "Bytes reserved in the memory budget by requests in flight "
                                "(their inputs and output buffers)", registry=r)
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
        self.totals = Totals()

    def finished(self, outputs: tuple[str, ...], ok_status: str, seconds: float, tokens: int, sequences: int) -> None:
        """One request ended (on either API) with status `ok_status` (a grpc.StatusCode name)."""
        for output in outputs:
            self.requests.labels(output=output, status=ok_status).inc()
        self.latency.observe(seconds)
        ok = ok_status == "OK"
        if ok:
            self.tokens.inc(tokens)
        self.totals.request(ok, seconds, sequences)

    def batch_started(self, waits: list[float], tokens: int) -> None:
        self.batch_requests.observe(len(waits))
        self.batch_tokens.observe(tokens)
        for w in waits:
            self.queue_wait.observe(w)

    def batch_done(self, waits: list[float], seconds: float) -> None:
        self.compute.observe(seconds)
        self.totals.batch(waits, seconds)

    def bind_scheduler(self, scheduler) -> None:
        self.queue_requests.set_function(scheduler.queue_length)
        self.queued_tokens.set_function(scheduler.queued_tokens)
        self.held_bytes.set_function(scheduler.held_bytes)

    def serve(self, port: int, host: str = "127.0.0.1") -> Optional[object]:
        """Expose /metrics over HTTP on `port` (0: a free one); returns the http server."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server


def _cuda_bytes() -> float:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return 0.0
    return float(torch.cuda.memory_allocated())


def account(metrics: Optional[Metrics], rid: str, job, status, seconds: float) -> None:
    """A finished request's access-log line (request id, status, tokens, time) and its metrics; `job` is None
    for a request that never became one, `status` a grpc.StatusCode."""
    tokens = job.num_tokens if job is not None else 0
    log.info("request %s %s: %d tokens in %.3f s", rid, status.name, tokens, seconds,
             extra={"request_id": rid, "status": status.name, "tokens": tokens, "seconds": round(seconds, 6)})
    if metrics is not None:
        metrics.finished(outputs_of(job), status.name, seconds, tokens, len(job.sequences) if job is not None else 0)
