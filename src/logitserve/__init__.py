"""logitserve: a teacher's or reward model's per-token outputs over streaming gRPC."""

__version__ = "0.1.0"
