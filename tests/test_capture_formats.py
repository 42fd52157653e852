"""`logitserve capture --format axolotl|distillkit|hf`: each capture, read back as its trainer reads it (Axolotl's
KD dataset loader; `datasets.load_dataset`; DistillKit's decompressor, ported), equals the served top-k; a rerun
after lost shards rebuilds them byte for byte; a format that cannot hold the request is refused, naming the flag.

DistillKit is not on PyPI, so its reader here is a port of distillkit/compression (bitpack.unpack_from_bytes and
monotonic_logprobs.decompress_monotonic_logprobs at arcee-ai/DistillKit a61c2e7d), kept to the lossless
config the capture writes. Axolotl installs without its dependencies into a folder of the venv outside site-packages
(`make install`: $(VENV)/axolotl-no-deps, so `pip check` stays clean), put on sys.path here; its test is skipped,
with the reason, only where `axolotl` cannot be imported, and the schema reader below still checks the rows.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import VOCAB, build_model, serve_dir
from logitserve.client import TeacherClient
from logitserve.client.capture import CaptureConfig, capture

pytestmark = pytest.mark.live_server

K = 8
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"     # word-level demo tokenizer: no specials
AXOLOTL_DIR = Path(sys.prefix) / "axolotl-no-deps"      # the Makefile's $(AXOLOTL)
if AXOLOTL_DIR.is_dir() and str(AXOLOTL_DIR) not in sys.path:
    sys.path.append(str(AXOLOTL_DIR))
HAVE_AXOLOTL = importlib.util.find_spec("axolotl") is not None


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from transformers import AutoTokenizer

    from logitserve.demo import demo_tokenizer

    directory = build_model(tmp_path_factory.mktemp("fmt") / "llama", "llama")
    demo_tokenizer(VOCAB).save_pretrained(directory)
    server = serve_dir(directory, batching="exact")
    server.tok = AutoTokenizer.from_pretrained(directory)
    server.tok.chat_template = TEMPLATE
    yield server
    server.stop()


def _ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def chats(teacher, tmp_path_factory):
    """Chats as jsonl rows: messages, their ids under the chat template, and a prompt length on every other row."""
    rng = np.random.default_rng(11)
    rows = []
    for i in range(22):
        words = lambda n: " ".join(f"t{x}" for x in rng.integers(3, VOCAB, n))       # noqa: E731
        messages = [{"role": "user", "content": words(int(rng.integers(1, 12)))},
                    {"role": "assistant", "content": words(int(rng.integers(1, 30)))}]
        row = {"ids": _ids(teacher.tok, messages), "messages": messages}
        if i % 2:
            row["prompt_length"] = len(_ids(teacher.tok, messages[:1]))
        rows.append(row)
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


@pytest.fixture(scope="module")
def served(teacher, chats):
    """Each chat's served top-k over the whole sequence (row t: position t, predicting token t+1)."""
    with TeacherClient(teacher.address) as c:
        r = c.forward([row["ids"] for row in chats[1]], logprobs=True, topk=K, topk_as_logprobs=True, topk_tail=True)
    return [(r.topk_values[j], r.topk_ids[j], r.topk_tail[j], r.logprobs[j]) for j in range(len(chats[1]))]


def _capture(teacher, data, out, fmt, **kw):
    with TeacherClient(teacher.address) as c:
        capture(c, data, out, CaptureConfig(topk=K, format=fmt, shard_samples=5, batch_samples=3, **kw),
                progress=False)


def _load(out):
    """The capture directory as DistillKit (and a user) loads it: `datasets.load_dataset(DIR)`, which picks the
    parquet shards over manifest.json; a private cache, as datasets caches by directory name and file stamps."""
    import datasets

    return datasets.load_dataset(str(out), split="train", cache_dir=str(out.parent / f"{out.name}-cache"))


def test_hf_dataset_read_by_datasets_equals_the_served_topk(teacher, chats, served, tmp_path):
    _capture(teacher, chats[0], tmp_path / "hf", "hf", logprobs=True)
    ds = _load(tmp_path / "hf")
    assert len(ds) == len(chats[1])
    for row, ref, got in zip(chats[1], served, ds):
        P = row.get("prompt_length")
        first = 0 if P is None else P - 1                 # with P the rows are positions P-1..L-2
        last = len(row["ids"]) if P is None else len(row["ids"]) - 1
        assert got["input_ids"] == row["ids"] and got["prompt_length"] == P and got["messages"] == row["messages"]
        assert np.array_equal(np.array(got["topk_ids"]), ref[1][first:last])
        np.testing.assert_allclose(np.array(got["topk_logprobs"]), ref[0][first:last], rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.array(got["topk_tail"]), ref[2][first:last], rtol=0, atol=1e-6)
        np.testing.assert_allclose(np.array(got["logprobs"]), ref[3] if P is None else ref[3][P:], rtol=0, atol=1e-6)


def _axolotl_schema(row: dict) -> tuple[np.ndarray, np.ndarray]:
    """Axolotl's KD v2 rows as its transform_logprobs aligns them, from its published code: [T][k] right-aligned
    to input_ids (rows before L - T are padding), each row renormalised over its top-k (gen = kd temperature)."""
    L, lp, ids = len(row["input_ids"]), np.array(row["logprobs"], np.float64), np.array(row["target_token_ids"])
    out_lp, out_ids = np.full((L, K), -np.inf), np.zeros((L, K), np.int64)
    out_lp[L - len(lp):] = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    out_ids[L - len(lp):] = ids
    return out_lp, out_ids


def _expected_axolotl(ids, P, ref):
    """Position p holds the served row that predicts token p (position p-1), for p >= max(P, 1); float64."""
    L, first = len(ids), P or 1
    lp, tid = np.full((L, K), -np.inf), np.zeros((L, K), np.int64)
    v = ref[0][first - 1 : L - 1].astype(np.float64)
    lp[first:] = v - np.log(np.exp(v).sum(-1, keepdims=True))
    tid[first:] = ref[1][first - 1 : L - 1]
    return lp, tid


def test_axolotl_rows_by_the_published_schema_equal_the_served_topk(teacher, chats, served, tmp_path):
    _capture(teacher, chats[0], tmp_path / "axo", "axolotl", temperature=1.0)
    ds = _load(tmp_path / "axo")
    for row, ref, got in zip(chats[1], served, ds):
        P = row.get("prompt_length")
        assert got["input_ids"] == row["ids"] and got["messages"] == row["messages"] and got["temperature"] == 1.0
        assert len(got["logprobs"]) == len(row["ids"]) - (P or 1)         # the rows of tokens max(P, 1)..L-1
        lp, tid = _axolotl_schema(got)
        want_lp, want_ids = _expected_axolotl(row["ids"], P, ref)
        assert np.array_equal(tid[P or 1:], want_ids[P or 1:])
        np.testing.assert_allclose(lp, want_lp, rtol=0, atol=1e-6)


@pytest.mark.skipif(not HAVE_AXOLOTL, reason="axolotl is not importable here: `make install` adds it with --no-deps")
def test_axolotl_kd_loader_reads_the_rows_as_the_served_topk(teacher, chats, served, tmp_path):
    from axolotl.integrations.kd.chat_template import load
    from axolotl.utils.dict import DictDefault

    _capture(teacher, chats[0], tmp_path / "axo", "axolotl")
    cfg = DictDefault({"sequence_len": 4096, "train_on_inputs": False, "chat_template": "jinja",
                       "chat_template_jinja": TEMPLATE})
    strategy = load(teacher.tok, cfg, {"field_messages": "messages", "temperature": 1.0, "chat_template": "jinja",
                                       "chat_template_jinja": TEMPLATE})
    for row, ref, got in zip(chats[1], served, _load(tmp_path / "axo")):
        P = row.get("prompt_length")
        sample = strategy.tokenize_prompt({k: got[k] for k in ("messages", "logprobs", "target_token_ids")})
        assert sample["input_ids"] == row["ids"]                # Axolotl's own tokenisation of the messages
        want_lp, want_ids = _expected_axolotl(row["ids"], P, ref)
        first = P or 1
        assert np.array_equal(np.array(sample["target_token_ids"])[first:], want_ids[first:])
        np.testing.assert_allclose(np.array(sample["target_logprobs"], np.float64), want_lp, rtol=0, atol=1e-6)
        trained = np.array(sample["labels"]) != -100            # its mask: the tokens it trains on, per position
        assert np.array_equal(np.array(sample["target_mask"])[:, 0] == 1, trained & (np.arange(len(trained)) >= first))


def _unpack_from_bytes(bytes_tensor, elem_bits, original_num_elements):
    """distillkit.compression.bitpack.unpack_from_bytes (a61c2e7d), as published."""
    total_bits_needed = original_num_elements * elem_bits
    original_shape = bytes_tensor.shape
    bit_positions = torch.arange(7, -1, -1, device=bytes_tensor.device)
    bits = ((bytes_tensor.unsqueeze(-1) >> bit_positions) & 1).to(torch.uint8)
    bits_flat = bits.view(*original_shape[:-1], -1)
    bits_needed = bits_flat[..., :total_bits_needed]
    bits_needed = bits_needed.contiguous().view(*list(original_shape[:-1]), original_num_elements, elem_bits)
    powers = 2 ** torch.arange(elem_bits - 1, -1, -1, device=bits_needed.device)
    return (bits_needed * powers).sum(dim=-1).long()


def _distillkit_decompress(row: dict, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """distillkit LogprobCompressor.decompress_to_sparse for its exact-values config: the first exact_k * width
    bytes of a row are the values in exact_dtype; indices are bit-packed at ceil(log2(d)) bits (float32 log2)."""
    assert cfg["exact_k"] == cfg["k"] and not cfg["polynomial_terms"] and not cfg["residual_bins"]
    assert not cfg["delta_encoding"]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["exact_dtype"]]
    raw = torch.tensor(row["compressed_logprobs"], dtype=torch.uint8)
    width = torch.finfo(dtype).bits // 8
    values = raw[..., : cfg["exact_k"] * width].contiguous().view(dtype).reshape(*raw.shape[:-1], cfg["exact_k"])
    bits = int(torch.log2(torch.tensor(cfg["d"], dtype=torch.float32)).ceil().item())
    ids = _unpack_from_bytes(torch.tensor(row["bytepacked_indices"], dtype=torch.uint8), bits, values.shape[-1])
    return ids, values


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_distillkit_rows_decompress_to_the_served_topk(teacher, chats, served, tmp_path, dtype):
    import yaml

    _capture(teacher, chats[0], tmp_path / "dk", "distillkit", dtype=dtype)
    cfg = yaml.safe_load((tmp_path / "dk" / "compression_config.yaml").read_text())
    assert cfg["d"] == VOCAB and cfg["k"] == K
    for row, ref, got in zip(chats[1], served, _load(tmp_path / "dk")):
        P, L = row.get("prompt_length"), len(row["ids"])
        ids, values = _distillkit_decompress(got, cfg)
        assert got["input_ids"] == row["ids"] and ids.shape == (L - 1, K)          # row i predicts token i+1
        first = (P or 1) - 1                                    # rows of tokens 1..P-1 were not asked
        want = torch.from_numpy(ref[0][first : L - 1])
        if dtype == "bf16":
            want = want.bfloat16()                              # bf16 on disk, exactly as torch rounds
        assert np.array_equal(ids[first:].numpy(), ref[1][first : L - 1])
        np.testing.assert_allclose(values[first:].float().numpy(), want.float().numpy(), rtol=0, atol=1e-6)
        assert torch.isneginf(values[:first]).all() and (ids[:first] == 0).all()
        assert got["labels"] == [-100] * (P or 0) + row["ids"][P or 0:]


def test_a_rerun_rebuilds_lost_shards_byte_for_byte(teacher, chats, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _capture(teacher, chats[0], whole, "distillkit")
    shutil.copytree(whole, resumed)
    for s in (1, 3):
        (resumed / f"shard-{s:05d}.parquet").unlink()
    cli = [sys.executable, "-m", "logitserve.server.cli", "capture", teacher.address, "--input", str(chats[0]),
           "--out", str(resumed), "--topk", str(K), "--shard-samples", "5", "--batch-samples", "3", "--no-progress"]
    run = subprocess.run([*cli, "--format", "distillkit"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "into 5 shards" in run.stdout
    names = sorted(p.name for p in whole.iterdir())
    assert names == sorted(p.name for p in resumed.iterdir())
    for name in names:
        assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name
    other = subprocess.run([*cli, "--format", "hf"], capture_output=True, text=True, timeout=300)
    assert other.returncode != 0 and "another request" in other.stderr


@pytest.mark.parametrize("fmt, kw, flag", [("distillkit", {"temperature": 2.0}, "--temperature"),
                                           ("arrow", {}, "choose safetensors"),
                                           ("hf", {"dtype": "bf16"}, "--dtype"),
                                           ("axolotl", {"dtype": "bf16"}, "--dtype")])
def test_a_format_that_cannot_hold_the_request_is_refused_naming_the_flag(teacher, chats, tmp_path, fmt, kw, flag):
    with pytest.raises(ValueError, match=f"--format {fmt}.*{flag}"):
        _capture(teacher, chats[0], tmp_path / "x", fmt, **kw)
    assert not (tmp_path / "x").exists()


def test_extra_fields_get_one_schema_for_the_whole_capture(teacher, tmp_path):
    """Issue 43: --format hf exited 0 but wrote shards datasets.load_dataset could not read when an extra input field
    varied between shards (absent, int vs float, null vs string). One schema is inferred from every row first: the
    dataset loads whole; a field whose types conflict is refused naming it before anything is asked."""
    rows = [{"ids": [5 + i, 6, 7, 8]} for i in range(10)]
    rows[6]["score"], rows[8]["score"] = 1, 2.5                      # absent in shard 0, an int then a float
    rows[2]["note"], rows[7]["note"] = None, "x"                     # null in shard 0, a string in shard 1
    data = tmp_path / "varied.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "hf"
    _capture(teacher, data, out, "hf")
    got = _load(out).sort("sample_index")
    assert got["score"] == [None] * 6 + [1.0, None, 2.5, None] and got["note"] == [None] * 7 + ["x", None, None]
    rows[3]["score"] = "high"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="input field 'score' has conflicting types"):
        _capture(teacher, data, tmp_path / "conflict", "hf")
    assert not (tmp_path / "conflict").exists()
