"""Ask a running logitserve container from outside it: gRPC through TeacherClient, HTTP GET /v1/models; print JSON.

    python deploy/container_probe.py 127.0.0.1:50051 http://127.0.0.1:8000 [--out FILE]

Client side only (grpcio, protobuf, numpy; no torch): deploy/container_check.sh runs it on the host against the
published ports; tests/test_container.py checks its answers against a float64 reference of the same demo model.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.request

# Token ids in the demo's 32000-token vocabulary; fixed so the reference can recompute the same rows.
PROBE_SEQ = [1, 306, 4658, 278, 6964, 310, 7849, 29889, 2]


def probe(address: str, http: str, timeout_s: float = 60.0) -> dict:
    """The model's identity and one sequence's token logprobs over gRPC, and the HTTP model list."""
    from logitserve.client import TeacherClient

    with TeacherClient(address) as client:
        info = client.wait_ready(timeout_s)
        [logprobs] = client.logprobs([PROBE_SEQ])
    with urllib.request.urlopen(f"{http}/v1/models", timeout=timeout_s) as answer:
        models = dict(status=answer.status, body=json.loads(answer.read()))
    return dict(seq=PROBE_SEQ, logprobs=[float(x) for x in logprobs], model=info.name,
                content_hash=info.content_hash, vocab_size=info.vocab_size, server_version=info.server_version,
                models=models)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("address", help="gRPC host:port")
    p.add_argument("http", help="HTTP base URL")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    text = json.dumps(probe(args.address, args.http))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
