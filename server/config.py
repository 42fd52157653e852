"""The server's typed configs, each a frozen dataclass the CLI fills: model, network, scheduler and stream bounds."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from logitserve.engine import EngineConfig

from .admission import ClientLimits
from .head_rpc import HeadLimits
from .http_conn import HttpLimits
from .security import SecurityConfig


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 16384        # tokens per batch (--max-batch-tokens)
    batch_delay_s: float = 0.002         # wait this long after the first job for others to join
    share_wait_s: float = 0.005          # while more of a batch's groups arrive, wait up to this much longer
                                         # (--share-wait-ms; 0: never; server.grouping)
    max_queued_tokens: int = 1 << 20     # work tokens waiting or running (--max-queued-tokens)
    max_queued_tokens_per_client: Optional[int] = None   # one client's share (--max-queued-tokens-per-client; half)
    memory_budget_bytes: Optional[int] = None   # bound on peak estimate + bytes held by admitted requests
    max_buffered_bytes: int = 256 << 20  # per request: computed outputs its stream has not taken (--max-buffered-bytes)
    stall_timeout_s: float = 30.0        # longest the compute thread waits on one reader, when no one else waits
    overlap: bool = True                 # compute the next chunk while the last one is being sent
    idle_s: float = 2.0                  # with an idle callback: call it after this long without work
    interject_after_s: float = 0.02      # a batch running this long runs queued small jobs between its steps
                                         # (--interject-after-ms; 0: never)
    interject_tokens: int = 1024         # small: at most this many work tokens; at most this many at a time
    short_steps_s: float = 1.0           # batches with a larger job run in short steps this long after a small job
                                         # last arrived or ran between a batch's steps (0: never)

    def __post_init__(self):
        if self.max_batch_tokens < 1 or self.max_queued_tokens < 1 or self.max_buffered_bytes < 1:
            raise ValueError(f"max_batch_tokens, max_queued_tokens and max_buffered_bytes must be >= 1: {self}")
        if self.interject_after_s < 0 or self.interject_tokens < 1:
            raise ValueError(f"interject_after_s={self.interject_after_s} (--interject-after-ms) must be >= 0 and "
                             f"interject_tokens={self.interject_tokens} (--interject-tokens) >= 1")
        if self.batch_delay_s < 0 or self.share_wait_s < 0:
            raise ValueError(f"batch_delay_s={self.batch_delay_s} (--batch-delay-ms) and share_wait_s={self.share_wait_s} "
                             f"(--share-wait-ms) must be >= 0")

    @property
    def client_queued_tokens(self) -> int:
        return self.max_queued_tokens_per_client or max(1, self.max_queued_tokens // 2)

    @property
    def client_budget_bytes(self) -> Optional[int]:
        """One client's share of the bytes admitted requests hold: half the budget."""
        return None if self.memory_budget_bytes is None else self.memory_budget_bytes // 2


@dataclass(frozen=True)
class StreamLimits:
    """Per-request and per-stream bounds, refused with RESOURCE_EXHAUSTED naming the flag (per-request sizes
    as TooLarge: permanent, HTTP 413; streams and requests in flight: retry later, HTTP 429)."""

    max_sequences: int = 4096            # sequences in one request (--max-sequences-per-request)
    max_request_tokens: int = 1 << 20    # tokens in one request (--max-request-tokens)
    max_streams: int = 256               # Forward streams open at once, server-wide (--max-streams)
    max_in_flight: int = 256             # requests in flight on one stream (--max-in-flight-per-stream)
    max_text_bytes: int = 1 << 20        # UTF-8 bytes of one request's texts, checked before tokenizing (--max-text-bytes)
    max_response_bytes: int = 1 << 30    # bytes of one request's outputs, checked before it runs (--max-response-bytes)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to serve and how."""

    path: Optional[str] = None          # a local HF directory; None = the embedded demo
    demo: str = "causal"                # demo kind when path is None: causal | reward | prm
    demo_shape: str = "demo"            # demo shape when path is None: demo | body | 1b (logitserve.demo)
    dtype: str = "fp32"                 # fp32 | bf16 | fp16
    max_seq_len: Optional[int] = None   # default: the model's max_position_embeddings
    device: str = "cpu"                 # single-process serving: cpu | cuda | auto
    step_separator: Optional[str] = None   # token-classification models: the token (or id) that ends a step
    fp8_compute: str = "auto"           # FP8 checkpoints: auto | dequantize | fp8 (logitserve.fp8_linear.choose)


@dataclass(frozen=True)
class ServerConfig:
    """Network side of the server."""

    host: str = "127.0.0.1"
    port: int = 50051                   # 0 picks a free port
    max_message_bytes: int = 4 << 20    # every response message stays under this
    max_request_bytes: int = 64 << 20   # largest request message accepted
    grace_s: float = 5.0                # drain time on shutdown
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    metrics_port: Optional[int] = None  # Prometheus /metrics over HTTP on this port (0: a free one); None: off
    metrics_host: str = "127.0.0.1"     # /metrics has no auth: loopback unless --metrics-host says otherwise
    limits: StreamLimits = field(default_factory=StreamLimits)
    clients: ClientLimits = field(default_factory=ClientLimits)     # per-client shares (server/admission.py)
    head: HeadLimits = field(default_factory=HeadLimits)            # Head downloads (server/head_rpc.py)
    keepalive_s: float = 60.0           # pings on idle connections; a peer silent for keepalive_timeout_s is dropped
    keepalive_timeout_s: float = 20.0
    max_connection_idle_s: float = 3600.0   # a connection with no RPC for this long is closed (GOAWAY)
    http_port: Optional[int] = None     # vLLM / SGLang / TRL HTTP routes on this port (0: a free one); None: off
    served_model_names: tuple[str, ...] = ()   # the model's HTTP names (first: its id); empty: the model's name
    http: HttpLimits = field(default_factory=HttpLimits)   # the HTTP port's connection bounds (server/http_conn.py)

    def __post_init__(self):
        if self.max_message_bytes < 64 << 10:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} must be >= {64 << 10}")
