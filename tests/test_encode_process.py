"""Bulk prompt-logprob JSON encoded by a process of its own (server/encode_process.py): exact, restarted when
lost, and abandoned answers dropped."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import VOCAB, Reference, assert_close, build_model, post, random_seqs, ref_rank_bounds, serve_dir

WORKER = "logitserve.server.encode_process"


def _workers() -> list[int]:
    """Pids of this process's encoding workers."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if WORKER.encode() in cmd and ppid == os.getpid():
            found.append(int(d.name))
    return found


class _Texts:
    available = True

    def of(self, ids):
        return [f"t{i}\u2028\"" for i in ids]


V = 5000


def _rows(rng, n: int, k: int):
    logprobs = -rng.random((n, k + 1), dtype=np.float32) * 20
    return (rng.integers(0, V, n).astype(np.int64), logprobs[:, 0], rng.integers(1, V + 1, n),
            rng.integers(0, V, (n, k)).astype(np.int64), logprobs[:, 1:], 1)


def _live(enc) -> int:
    """Answers the worker holds open."""
    return enc._trip(("live", 0), enc._generation)[1]


@pytest.mark.unit
def test_the_process_sends_the_threads_bytes_and_cuts_what_a_lost_worker_held():
    from logitserve.server.encode_process import EncodeProcess, EncoderLost
    from logitserve.server.json_logprobs import VocabTables, prompt_logprobs_parts

    tables = VocabTables(_Texts(), V)
    enc = EncodeProcess(tables)
    same = lambda rows: b"".join(enc.parts(*rows)) == b"".join(prompt_logprobs_parts(*rows, tables))  # noqa: E731
    try:
        rng = np.random.default_rng(0)
        for n, k in ((40, 300), (3, 0), (1, 5000)):        # blocks of rows, no top-k, one row in column slices
            rows = _rows(rng, n, k)
            assert same(rows)
            json.loads(b"".join(prompt_logprobs_parts(*rows, tables)))
        pid = enc._proc.pid
        os.kill(pid, signal.SIGKILL)                # lost while idle: the next answer starts another
        time.sleep(0.2)
        assert same(_rows(rng, 50, 300)) and enc._proc.pid != pid
        a, b = enc.parts(*_rows(rng, 2000, 300)), enc.parts(*_rows(rng, 2000, 300))   # ~60 MB of JSON each
        next(a), next(b)
        assert _live(enc) == 2
        a.close()                                   # abandoned: the worker lets go of its rows
        assert _live(enc) == 1
        os.kill(enc._proc.pid, signal.SIGKILL)      # lost mid-answer: the answer it held is cut, not ended,
        time.sleep(0.2)
        assert same(_rows(rng, 5, 300)) and _live(enc) == 0     # even after a new answer started another worker
        with pytest.raises(EncoderLost):
            list(b)
    finally:
        enc.close()
    with pytest.raises(EncoderLost):                # closed for good (the front-end stopped)
        list(enc.parts(*_rows(rng, 5, 300)))


@pytest.mark.live_server
def test_whole_vocabulary_prompt_logprobs_through_the_process_are_exact(tmp_path):
    """/v1/completions with prompt_logprobs -1 (over a MiB of JSON, so the encoding process makes it): every
    position's whole vocabulary against float64; a killed worker is replaced for the next answer."""
    from logitserve.demo import demo_tokenizer

    directory = build_model(tmp_path / "llama", "llama")
    demo_tokenizer(VOCAB).save_pretrained(directory)
    before = set(_workers())
    server = serve_dir(directory, http_port=0)
    try:
        base, ref = f"http://127.0.0.1:{server.running.http_port}", Reference(directory)
        seq = random_seqs(np.random.default_rng(9), [23])[0].tolist()
        for attempt in range(2):
            status, out = post(base, "/v1/completions", {"prompt": seq, "max_tokens": 0, "prompt_logprobs": -1})
            assert status == 200, out
            workers = sorted(set(_workers()) - before)
            assert len(workers) == 1, workers
            plp = out["choices"][0]["prompt_logprobs"]
            z = ref.logits(seq)
            lo, hi = ref_rank_bounds(z, seq)
            assert plp[0] is None and len(plp) == len(seq)
            for t in range(1, len(seq)):
                lsm = torch.log_softmax(z[t - 1], -1)
                entry = plp[t]
                assert len(entry) == VOCAB and int(next(iter(entry))) == seq[t]
                assert lo[t] <= entry[str(seq[t])]["rank"] <= hi[t]
                ids = np.array([int(i) for i in entry])
                assert_close([e["logprob"] for e in entry.values()], lsm[ids].tolist())
            os.kill(workers[0], signal.SIGKILL)
            time.sleep(0.2)
        post(base, "/v1/completions", {"prompt": seq, "max_tokens": 0, "prompt_logprobs": -1})
        assert len(set(_workers()) - before) == 1
    finally:
        server.stop()
    assert set(_workers()) - before == set()        # stopped with the server
