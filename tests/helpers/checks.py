"""Comparisons shared by the tests: float64-reference closeness, near-tie masks, vLLM ranks, the packed bound."""
from __future__ import annotations

import numpy as np

from .models import VOCAB, random_seqs, ref_rank_bounds

TOL = 1e-5
PACKED_ATOL = 1e-5   # README: packed results are within this of per-sequence results (fp32)
FIELDS = ("logprobs", "topk_values", "topk_ids", "candidate_logprobs", "full_logits")


def assert_close(got, want, tol=TOL):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    err = np.abs(got[finite] - want[finite]).max(initial=0.0)
    assert err <= tol, f"max abs error {err:.3g} > {tol}"


def separated(sorted_values: np.ndarray, k: int, gap: float = 1e-5) -> np.ndarray:
    """[L, k] mask of the top-k ranks whose reference value differs from both neighbours
    (the (k+1)-th included) by more than gap: where the order is not a near-tie."""
    d = np.abs(np.diff(sorted_values, axis=-1)) > gap                  # [L, V-1]
    edge = np.ones((len(d), 1), dtype=bool)
    left = np.concatenate([edge, d], axis=-1)
    right = np.concatenate([d, edge], axis=-1)
    return (left & right)[:, :k]


def check_ranks(got, z, seq) -> None:
    """Ranks as vLLM defines them, from the float64 reference; exact wherever no other id is within 1e-5."""
    lo, hi = ref_rank_bounds(z, seq)
    assert got.dtype == np.int32 and got.shape == (len(seq),)
    assert np.all((got >= lo) & (got <= hi)), f"ranks {got} outside [{lo}, {hi}]"
    assert np.mean(lo == hi) > 0.5     # most rows decided: the check is not vacuous


def random_request(rng: np.random.Generator) -> dict:
    """TeacherClient.forward keyword arguments of a random kind (logprobs, filtered, top-k, candidates, slices)."""
    seqs = random_seqs(rng, rng.integers(1, 90, rng.integers(1, 4)))
    kind = rng.integers(0, 5)
    req = dict(seqs=seqs, temperature=float(rng.choice([1.0, 0.7, 1.3])))
    if kind == 0:
        req.update(logprobs=True)
    elif kind == 1:
        req.update(logprobs=True, top_k=int(rng.integers(1, 60)), top_p=float(rng.choice([0.5, 0.9, 1.0])))
    elif kind == 2:
        req.update(topk=int(rng.integers(1, 40)), topk_as_logprobs=bool(rng.integers(0, 2)))
    elif kind == 3:
        req.update(candidates=[rng.integers(0, VOCAB, (len(s), 3)) for s in seqs], logprobs=True)
    else:
        req.update(full_logits=True, vocab_range=(10, 400), logits_dtype="bf16")
    return req


def within_packed_bound(a, b) -> None:
    """a (packed, batched) against b (alone): fp32 within PACKED_ATOL, bf16 within one bf16 step,
    top-k ids identical wherever the sorted values are more than PACKED_ATOL apart."""
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        for u, v in zip(x or [], y or []):
            assert u.dtype == v.dtype and u.shape == v.shape, name
            if name == "topk_ids":
                continue
            rtol = 2.0 ** -7 if name == "full_logits" else 0    # random_request's slices travel as bf16
            np.testing.assert_allclose(u, v, atol=PACKED_ATOL, rtol=rtol, err_msg=name)
    for vals, u, v in zip(a.topk_values or [], a.topk_ids or [], b.topk_ids or []):
        gap = np.diff(-vals, axis=-1)                                   # [L, k-1] >= 0
        sep = np.ones_like(u, dtype=bool)
        sep[:, 1:] &= gap > PACKED_ATOL
        sep[:, :-1] &= gap > PACKED_ATOL
        assert np.array_equal(u[sep], v[sep]), "topk_ids"


def assert_same_signature(fake, real) -> None:
    """A fake stands in for `real` only if it takes the same parameters (names, kinds, defaults) as it."""
    import inspect

    def params(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]
    assert params(fake) == params(real), f"fake {inspect.signature(fake)} != real {inspect.signature(real)}"
