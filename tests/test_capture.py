"""`logitserve capture`: shards a dataset's top-k to safetensors; killed halfway and rerun, the result equals an
uninterrupted capture byte for byte (teacher in exact batching); the reader gives back what the teacher serves."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from helpers import VOCAB, build_model, serve_dir
from logitserve.client import TeacherClient
from logitserve.client.capture import CaptureConfig, capture, read_capture, verify

pytestmark = pytest.mark.live_server

CFG = CaptureConfig(topk=8, logprobs=True, shard_samples=4, batch_samples=2, in_flight=2)


@pytest.fixture(scope="module")
def exact_teacher(tmp_path_factory):
    from logitserve.demo import demo_tokenizer

    directory = build_model(tmp_path_factory.mktemp("cap") / "llama", "llama")
    demo_tokenizer(VOCAB).save_pretrained(directory)
    server = serve_dir(directory, batching="exact")
    server.directory = directory
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    with open(path, "w") as f:
        for i in range(240):
            if i % 10 == 3:
                f.write(json.dumps({"text": " ".join(f"t{x}" for x in rng.integers(3, VOCAB, 20))}) + "\n")
            else:
                f.write(json.dumps({"ids": rng.integers(0, VOCAB, int(rng.integers(2, 120))).tolist()}) + "\n")
    return path


def _cli_capture(address, data, out, *extra):
    return [sys.executable, "-m", "logitserve.server.cli", "capture", address, "--input", str(data), "--out", str(out),
            "--topk", "8", "--logprobs", "--shard-samples", "4", "--batch-samples", "2", "--in-flight", "2",
            "--no-progress", *extra]


def test_a_capture_killed_halfway_and_rerun_equals_an_uninterrupted_one(exact_teacher, dataset, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    with TeacherClient(exact_teacher.address) as c:
        capture(c, dataset, whole, CFG, progress=False)
    proc = subprocess.Popen(_cli_capture(exact_teacher.address, dataset, resumed), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(resumed.glob("shard-*.safetensors"))) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    done = len(list(resumed.glob("shard-*.safetensors")))
    assert 5 <= done < 60, f"{done} of 60 shards when killed: the kill must land halfway"
    rerun = subprocess.run(_cli_capture(exact_teacher.address, dataset, resumed, "--verify", "4"),
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "verified 4 samples" in rerun.stdout
    names = sorted(p.name for p in whole.iterdir())
    assert names == sorted(p.name for p in resumed.iterdir()) and len(names) == 61          # 60 shards + manifest
    for name in names:
        assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name


def test_the_reader_gives_back_what_the_teacher_serves(exact_teacher, dataset, tmp_path):
    from transformers import AutoTokenizer

    with TeacherClient(exact_teacher.address) as c:
        capture(c, dataset, tmp_path / "fp32", CFG, progress=False)
        capture(c, dataset, tmp_path / "bf16", CaptureConfig(topk=8, dtype="bf16", shard_samples=64), progress=False)
        samples = list(read_capture(tmp_path / "fp32"))
        halves = list(read_capture(tmp_path / "bf16"))
        lines = [json.loads(x) for x in open(dataset)]
        assert [s.index for s in samples] == list(range(len(lines)))
        tok = AutoTokenizer.from_pretrained(exact_teacher.directory)
        for s in samples[:24]:
            line = lines[s.index]
            assert s.input_ids.tolist() == (line["ids"] if "ids" in line else tok(line["text"])["input_ids"])
            r = c.forward([s.input_ids], logprobs=True, topk=8, topk_as_logprobs=True, topk_tail=True)
            assert np.array_equal(s.topk_values, r.topk_values[0]) and np.array_equal(s.topk_ids, r.topk_ids[0])
            assert np.array_equal(s.topk_tail, r.topk_tail[0]) and np.array_equal(s.logprobs, r.logprobs[0])
            h = halves[s.index]
            rounded = torch.from_numpy(r.topk_values[0]).bfloat16().float().numpy()        # bf16 on disk, exactly
            assert np.array_equal(h.topk_values, rounded) and h.logprobs is None
        assert verify(c, tmp_path / "bf16", samples=4) <= np.abs(samples[0].topk_values).max() * 2.0 ** -8 + 1e-5
    with pytest.raises(ValueError, match="another request"):
        with TeacherClient(exact_teacher.address) as c:
            capture(c, dataset, tmp_path / "fp32", CaptureConfig(topk=9), progress=False)


def test_prompt_lengths_capture_only_the_response_rows(exact_teacher, tmp_path):
    rng = np.random.default_rng(3)
    data = tmp_path / "rl.jsonl"
    rows = []
    with open(data, "w") as f:
        for i in range(20):
            ids = rng.integers(0, VOCAB, int(rng.integers(3, 60))).tolist()
            row = {"ids": ids} if i % 4 == 0 else {"ids": ids, "prompt_length": int(rng.integers(1, len(ids) + 1))}
            rows.append(row)
            f.write(json.dumps(row) + "\n")
    with TeacherClient(exact_teacher.address) as c:
        capture(c, data, tmp_path / "out", CFG, progress=False)
        samples = list(read_capture(tmp_path / "out"))
        for s, row in zip(samples, rows):
            P = row.get("prompt_length")
            assert s.prompt_length == P and s.input_ids.tolist() == row["ids"]
            r = c.forward([row["ids"]], logprobs=True, topk=8, topk_as_logprobs=True, topk_tail=True)
            first = 0 if P is None else P - 1                       # row j of a span predicts token P + j
            last = len(row["ids"]) if P is None else len(row["ids"]) - 1
            assert np.array_equal(s.topk_ids, r.topk_ids[0][first:last])
            assert np.array_equal(s.topk_values, r.topk_values[0][first:last])
            assert np.array_equal(s.logprobs, r.logprobs[0] if P is None else r.logprobs[0][P:])
        assert verify(c, tmp_path / "out", samples=6) <= 1e-5
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ids": [1, 2, 3], "prompt_length": 4}) + "\n")
    with pytest.raises(ValueError, match="prompt_length 4"):
        with TeacherClient(exact_teacher.address) as c:
            capture(c, bad, tmp_path / "bad", CFG, progress=False)


def _small(tmp_path, rows, name="small.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SMALL = [{"ids": [5 + i, 6, 7, 8, 9]} for i in range(8)]


def test_a_shard_corrupted_on_disk_is_refused_on_resume_and_by_the_reader(exact_teacher, tmp_path):
    """Issue 43: a shard altered on disk was skipped on resume and read back as altered values with no error."""
    data, out = _small(tmp_path, SMALL), tmp_path / "out"
    with TeacherClient(exact_teacher.address) as c:
        capture(c, data, out, CFG, progress=False)
        shard = out / "shard-00001.safetensors"
        raw = bytearray(shard.read_bytes())
        raw[-8] ^= 0x40                                  # one bit of the last value
        shard.write_bytes(bytes(raw))
        with pytest.raises(ValueError, match="shard-00001.safetensors: checksum"):
            list(read_capture(out))
        with pytest.raises(ValueError, match="shard-00001.safetensors: checksum"):
            capture(c, data, out, CFG, progress=False)
    check = subprocess.run(_cli_capture(exact_teacher.address, data, out, "--verify", "2"), capture_output=True,
                           text=True, timeout=300)
    assert check.returncode != 0 and "shard-00001.safetensors: checksum" in check.stderr, check.stderr[-2000:]


def test_shards_without_a_manifest_are_not_adopted(exact_teacher, tmp_path):
    """Issue 43: an --out whose manifest was deleted adopted another capture's shards (k=8 shards under k=16)."""
    data, out = _small(tmp_path, SMALL), tmp_path / "out"
    with TeacherClient(exact_teacher.address) as c:
        capture(c, data, out, CFG, progress=False)
        (out / "manifest.json").unlink()
        with pytest.raises(ValueError, match="no manifest.json"):
            capture(c, data, out, CaptureConfig(topk=16, shard_samples=4, batch_samples=2), progress=False)
        assert not (out / "manifest.json").exists()


@pytest.mark.parametrize("row, why", [({"text": None}, "text must be a non-empty string"),
                                      ({"ids": [5, 6.7, 8]}, r"ids\[1\] = 6.7 is not an integer"),
                                      ({"ids": [5, 6, 7], "prompt_length": True}, "prompt_length True"),
                                      ({"ids": [5, VOCAB, 7]}, r"ids\[1\] = %d is outside" % VOCAB),
                                      ({"ids": [5] * 600}, "600 ids is over the teacher's max_sequence_length")])
def test_a_bad_row_is_named_by_file_and_line_before_anything_is_written(exact_teacher, tmp_path, row, why):
    """Issue 43: {"text": null} was captured as the text "None", float ids truncated, a boolean prompt_length
    passed, and a bad row's error named sequences[1] of a batch and left an empty manifest.json."""
    data, out = _small(tmp_path, SMALL[:2] + [row] + SMALL[2:]), tmp_path / "out"
    with TeacherClient(exact_teacher.address) as c, pytest.raises(ValueError, match=why) as e:
        capture(c, data, out, CFG, progress=False)
    assert f"{data}:3:" in str(e.value)
    assert not (out / "manifest.json").exists() and not list(out.glob("shard-*"))


def test_a_rerun_that_skipped_everything_says_so(exact_teacher, tmp_path):
    """Issue 43: a rerun that captured nothing printed "captured 41 samples"."""
    data, out = _small(tmp_path, SMALL), tmp_path / "out"
    first = subprocess.run(_cli_capture(exact_teacher.address, data, out), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and "captured 8 samples;" in first.stdout, first.stdout + first.stderr[-2000:]
    again = subprocess.run(_cli_capture(exact_teacher.address, data, out), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "captured 0 samples, skipped 8 captured by an earlier run" in again.stdout, \
        again.stdout


def test_a_row_the_server_refuses_is_named_by_file_and_line(exact_teacher, tmp_path):
    """A text whose tokens are over the teacher's length is refused by the server: the error names the input line,
    not sequences[1] of a batch."""
    long_text = {"text": " ".join(["t5"] * 600)}
    data, out = _small(tmp_path, SMALL[:3] + [long_text] + SMALL[3:]), tmp_path / "out"
    with TeacherClient(exact_teacher.address) as c, pytest.raises(Exception, match=f"{data}:4: ") as e:
        capture(c, data, out, CFG, progress=False)
    assert "sequences[" not in str(e.value) and "texts[" not in str(e.value), e.value
