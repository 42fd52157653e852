"""Generated gRPC stubs of proto/logitserve/v1/logitserve.proto (built by setup.py, never edited)."""
