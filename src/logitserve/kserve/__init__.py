"""Generated stubs of the KServe v2 / Open Inference Protocol gRPC service (proto/logitserve/kserve)."""
