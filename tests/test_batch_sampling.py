"""Batch sampling on the device (moeserve.sampling.sample): the counter-based random words, batch
and position invariance, the distribution, the filters against the old per-row code, tiny
temperatures and extreme logits, log-probabilities, and the Triton race kernel (run by Triton's
interpreter here) against the torch path."""

import os
import random

import pytest
import torch

from moeserve import kernels
from moeserve.sampling import (
    Sampler,
    SamplingParams,
    SamplingTensors,
    exponentials,
    logprobs,
    philox4x32,
    random_bits,
    request_seed,
    sample,
    thresholds,
)

M32 = 0xFFFFFFFF


def build(params, seeds=None, positions=None, device="cpu"):
    seeds = list(range(100, 100 + len(params))) if seeds is None else seeds
    positions = [0] * len(params) if positions is None else positions
    return SamplingTensors.build(params, seeds, positions, device)


def logits_for(b, v, seed=0, scale=3.0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


# A mix of every kind of row: greedy (also by a tiny temperature), plain temperature, top-k,
# top-p, both, top-k >= V, top-p that keeps one token.
MIX = [
    SamplingParams(temperature=t, top_p=p, top_k=k)
    for t, p, k in [
        (0, 1, 0),
        (1.0, 1, 0),
        (0.7, 1, 0),
        (1.3, 1, 5),
        (1.0, 0.5, 0),
        (0.9, 0.8, 7),
        (2.0, 1, 1),
        (1e-7, 0.3, 2),
        (1.0, 1e-9, 0),
        (1.0, 1, 10_000),
        (5.0, 0.95, 0),
        (0.0, 0.5, 3),
    ]
]


# ----------------------------------------------------------------------------------------------
# The random words


def test_philox_matches_random123_known_answers():
    t = lambda v: torch.tensor([v], dtype=torch.long)  # noqa: E731
    kat = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for ctr, key, out in kat:
        assert tuple(int(o) for o in philox4x32(*map(t, ctr), *map(t, key))) == out


def _philox_python(ctr, key):
    c, k = list(ctr), list(key)
    for _ in range(10):
        p0, p2 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p2 >> 32) ^ c[1] ^ k[0], p2 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
        k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
    return c


def test_philox_int64_wrapping_gives_the_exact_unsigned_words():
    # Counters near 2**32 make every 32 x 32-bit product pass 2**63 (int64 wraps): the words must
    # still equal exact integer arithmetic.
    rng = random.Random(0)
    rows = [[rng.choice([rng.getrandbits(32), M32 - rng.getrandbits(4)]) for _ in range(6)] for _ in range(200)]
    cols = torch.tensor(rows, dtype=torch.long).T
    got = torch.stack(philox4x32(*cols), dim=1)
    for r, g in zip(rows, got.tolist()):
        assert g == _philox_python(r[:4], r[4:])


def test_random_bits_are_philox_words_keyed_by_seed_and_position():
    seed = torch.tensor([0, 2**63 - 1, 12345], dtype=torch.long)
    pos = torch.tensor([0, 7, 2**40 + 3], dtype=torch.long)
    bits = random_bits(seed, pos, 10)
    assert bits.shape == (3, 10) and bits.dtype == torch.long and int(bits.min()) >= 0 and int(bits.max()) <= M32
    for b in range(3):
        s, p = int(seed[b]), int(pos[b])
        for i in range(10):
            words = _philox_python((i // 4, p & M32, p >> 32, 0), (s & M32, s >> 32))
            assert int(bits[b, i]) == words[i % 4]
    # other positions and seeds: other streams
    assert not torch.equal(random_bits(seed, pos + 1, 10), bits)
    assert not torch.equal(random_bits(seed + 1, pos, 10), bits)


# ----------------------------------------------------------------------------------------------
# Batch invariance and determinism


@pytest.mark.slow  # long-running (several seconds on 2 cores): out of the fast loop
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_rows_token_is_the_same_alone_and_in_any_batch_at_any_row(backend):
    if backend == "triton" and not kernels.available():
        if os.environ.get("CI") == "true":  # the test extra installs it; CI=true requires it
            pytest.fail("triton is not installed")
        pytest.skip("triton is not installed")
    v = 61 if backend == "triton" else 300
    pool = MIX * 2
    x = logits_for(len(pool), v, seed=1)
    seeds = [request_seed(SamplingParams()) for _ in pool]
    positions = [random.Random(i).randrange(0, 50) for i in range(len(pool))]
    alone = [
        int(sample(x[i : i + 1], build([p], [s], [q]), backend=backend))
        for i, (p, s, q) in enumerate(zip(pool, seeds, positions))
    ]
    rng = random.Random(2)
    for trial in range(3):
        rows = rng.sample(range(len(pool)), k=len(pool) if trial == 0 else rng.randrange(2, len(pool)))
        st = build([pool[i] for i in rows], [seeds[i] for i in rows], [positions[i] for i in rows])
        got = sample(x[rows], st, backend=backend)
        assert got.tolist() == [alone[i] for i in rows]


def test_the_filter_hint_only_saves_work():
    x = logits_for(len(MIX), 120, seed=3)
    st = build(MIX)
    no_hint = SamplingTensors(st.temperature, st.top_p, st.top_k, st.seed, st.position, st.all_greedy)
    # without the hint every row goes through the sort: an unfiltered row's threshold is then its
    # smallest logit instead of -inf, the same kept set
    assert torch.equal(x >= thresholds(x, st)[:, None], x >= thresholds(x, no_hint)[:, None])
    assert torch.equal(sample(x, st), sample(x, no_hint))
    # top-k alone takes topk instead of the sort: same thresholds
    topk_only = [SamplingParams(temperature=1.0, top_k=k) for k in (1, 3, 50, 120, 500)]
    st = build(topk_only)
    assert not st.needs_sort and st.max_top_k == 500
    sorted_st = SamplingTensors(st.temperature, st.top_p, st.top_k, st.seed, st.position, False, st.filter_rows)
    assert torch.equal(thresholds(x[:5], st), thresholds(x[:5], sorted_st))


def test_same_seed_and_position_same_token_other_positions_other_streams():
    x = logits_for(1, 1000, seed=4, scale=0.1).expand(64, -1)  # nearly flat: the stream decides
    p = SamplingParams(temperature=1.0)
    by_pos = sample(x, build([p] * 64, [7] * 64, list(range(64))))
    assert torch.equal(by_pos, sample(x, build([p] * 64, [7] * 64, list(range(64)))))
    assert len(set(by_pos.tolist())) > 55  # positions are not one stream
    by_seed = sample(x, build([p] * 64, list(range(64)), [5] * 64))
    assert len(set(by_seed.tolist())) > 55
    assert by_seed.tolist() != by_pos.tolist()


def test_sampler_is_sample_at_positions_0_1_2():
    rows = logits_for(12, 80, seed=5)
    for params in MIX:
        params = SamplingParams(params.temperature, params.top_p, params.top_k, seed=99)
        s = Sampler(params)
        one_by_one = [s.sample(r) for r in rows]
        assert s.seed == 99 and s.position == 12
        batch = sample(rows, build([params] * 12, [99] * 12, list(range(12))))
        assert one_by_one == batch.tolist()


def test_a_preempted_sequence_recomputed_later_samples_the_same_tokens():
    # Positions 0..9 sampled in steps of different batches; "recomputed" in one batch: same tokens.
    x = logits_for(10, 50, seed=6)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    first = [
        int(
            sample(
                torch.cat([x[i : i + 1], logits_for(i, 50, seed=i)]), build([p] + MIX[:i], [3] + [1] * i, [i] + [0] * i)
            )[0]
        )
        for i in range(10)
    ]
    again = sample(x, build([p] * 10, [3] * 10, list(range(10)))).tolist()
    assert first == again


# ----------------------------------------------------------------------------------------------
# The distribution


def _frequencies(logits_row, params, n=20_000, by="seed"):
    x = logits_row.expand(n, -1)
    seeds = list(range(n)) if by == "seed" else [11] * n
    positions = [3] * n if by == "seed" else list(range(n))
    tokens = sample(x, build([params] * n, seeds, positions))
    return torch.bincount(tokens, minlength=logits_row.numel()).double() / n


@pytest.mark.parametrize("by", ["seed", "position"])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_empirical_frequencies_follow_softmax_logits_over_t(by, temperature):
    logits = torch.tensor([1.2, -0.3, 0.0, 2.0, -1.5])
    freq = _frequencies(logits, SamplingParams(temperature=temperature), by=by)
    p = torch.softmax(logits.double() / temperature, -1)
    # 20,000 draws: the standard error of a frequency is <= 0.0036; fixed seeds, so no flakes.
    assert (freq - p).abs().max() < 0.012
    chi2 = float(((freq - p) ** 2 / p).sum() * 20_000)
    assert chi2 < 25  # 4 dof: p ~ 5e-5


def test_filtered_frequencies_follow_the_renormalised_kept_set():
    logits = torch.tensor([1.2, -0.3, 0.0, 2.0, -1.5])
    p = torch.softmax(logits.double(), -1)  # [.29, .06, .09, .64, .02]
    keep_k = torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool)  # top-3
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (freq[~keep_k] == 0).all()
    assert (freq - torch.where(keep_k, p, 0) / p[keep_k].sum()).abs().max() < 0.012
    keep_p = torch.tensor([1, 0, 0, 1, 0], dtype=torch.bool)  # top-p 0.8: .64, then .29 reaches it
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert (freq[~keep_p] == 0).all()
    assert (freq - torch.where(keep_p, p, 0) / p[keep_p].sum()).abs().max() < 0.012


def _old_kept(scores_row, params):
    """The kept set of the per-row Sampler this module replaced (its code, verbatim)."""
    p = params
    scores = scores_row / p.temperature
    if p.top_k and p.top_k < scores.numel():
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        drop = before >= p.top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return scores > float("-inf")


def test_kept_sets_equal_the_old_per_row_code():
    x = logits_for(8, 200, seed=7)
    combos = [
        SamplingParams(temperature=t, top_p=p, top_k=k)
        for t in (0.3, 1.0, 3.0)
        for p in (1.0, 0.95, 0.6, 0.2, 1e-9)
        for k in (0, 1, 4, 60, 199, 200, 1000)
    ]
    for i in range(0, len(combos), 8):
        chunk = combos[i : i + 8]
        rows = x[: len(chunk)]
        thr = thresholds(rows, build(chunk))
        kept = rows >= (thr if thr is not None else torch.full((len(chunk),), float("-inf")))[:, None]
        for r, params in enumerate(chunk):
            assert torch.equal(kept[r], _old_kept(rows[r], params)), params
        # and the sampled tokens are always in the kept set
        for trial in range(5):
            tok = sample(rows, build(chunk, [trial * 100 + j for j in range(len(chunk))]))
            assert kept.gather(1, tok[:, None]).all()


def test_ties_at_the_boundary_are_all_kept():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    thr = thresholds(x, build([SamplingParams(temperature=1.0, top_k=2)]))
    assert (x[0] >= thr[0]).tolist() == [True, False, True, True, True, False]
    thr = thresholds(x, build([SamplingParams(temperature=1.0, top_p=0.75)]))  # .58 then .21 each
    assert (x[0] >= thr[0]).tolist() == [True, False, True, True, True, False]


# ----------------------------------------------------------------------------------------------
# Greedy, tiny temperatures, extreme logits


@pytest.mark.parametrize("t", [0.0, 1e-6, 1e-30, 1e-320, 5e-324, 9.99e-6])
def test_tiny_temperatures_are_greedy(t):
    p = SamplingParams(temperature=t, top_p=0.5, top_k=3)
    assert p.greedy
    x = logits_for(4, 30, seed=8)
    x[1, 5] = x[1, 9] = x[1].max() + 1  # a tie: the lowest index
    st = build([p] * 4)
    assert st.all_greedy and float(st.temperature.abs().max()) == 0
    assert torch.equal(sample(x, st), x.argmax(-1)) and int(sample(x, st)[1]) == 5
    assert Sampler(p).sample(x[1]) == 5
    # greedy rows in a mixed batch take the race with T = 0: still the argmax
    mixed = build([p, SamplingParams(temperature=1.0)] * 2)
    assert torch.equal(sample(x, mixed)[0::2], x.argmax(-1)[0::2])
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.slow  # long-running (several seconds on 2 cores): out of the fast loop
def test_extreme_logits_and_temperatures_never_make_nan():
    neg = float("-inf")
    x = torch.tensor(
        [
            [1e30, -1e30, 3e38, -3e38, 0.0],
            [neg, neg, 7.0, neg, neg],
            [neg, -3e38, neg, neg, neg],
            [3e38, 3e38, -3e38, -3e38, 0.0],
        ]
    )
    for t in (1e-5, 1.0, 1e6, 1e30, 1e300):
        for top_p, top_k in ((1.0, 0), (0.5, 0), (1.0, 2), (1e-300, 0), (0.999, 4)):
            st = build([SamplingParams(temperature=t, top_p=top_p, top_k=top_k)] * 4, positions=[0, 1, 2, 3])
            thr = thresholds(x, st)
            assert thr is None or not thr.isnan().any()
            for backend in ("torch", "triton") if kernels.available() else ("torch",):
                tok = sample(x, st, backend=backend)
                assert tok[1] == 2 and tok[2] == 1, (t, top_p, top_k)
                if t <= 1.0 and top_p < 1:
                    assert tok[0] == 2
                assert ((0 <= tok) & (tok < 5)).all()
    e = exponentials(torch.tensor([0, 1, 2**31, M32 - 1, M32], dtype=torch.long))
    assert e.isfinite().all() and (e > 0).all()


def test_a_huge_temperature_samples_uniformly():
    logits = torch.tensor([5.0, 0.0, -5.0, 1.0])
    freq = _frequencies(logits, SamplingParams(temperature=1e300), n=8000)
    assert (freq - 0.25).abs().max() < 0.02


# ----------------------------------------------------------------------------------------------
# Log-probabilities


def test_logprobs_are_log_softmax_of_the_raw_logits():
    x = logits_for(6, 500, seed=9, scale=8.0)
    x[2, :250] = float("-inf")
    tokens = torch.tensor([0, 17, 300, 499, 5, 250])
    ref = torch.log_softmax(x.float(), -1)
    chosen, top_ids, top_lp = logprobs(x, tokens, 5)
    assert chosen.dtype == top_lp.dtype == torch.float32 and top_ids.dtype == torch.long
    assert torch.allclose(chosen, ref.gather(1, tokens[:, None]).squeeze(1), atol=1e-6, rtol=0)
    assert torch.equal(top_ids, torch.topk(x, 5, dim=-1).indices)
    assert torch.allclose(top_lp, ref.gather(1, top_ids), atol=1e-6, rtol=0)
    assert (top_lp[:, :-1] >= top_lp[:, 1:]).all()
    _, ids, lp = logprobs(x.to(torch.bfloat16), tokens, 0)
    assert ids.shape == lp.shape == (6, 0)
    with pytest.raises(ValueError, match="num_top must be in 0..500"):
        logprobs(x, tokens, 501)


# ----------------------------------------------------------------------------------------------
# The Triton race kernel (interpreted here) against the torch path


@pytest.mark.skipif(not kernels.available(), reason="triton is not installed")
@pytest.mark.parametrize("b, v", [(12, 37), (3, 2500), (5, 4)])
def test_triton_race_equals_the_torch_path(b, v):
    # Interpreted on CPU tensors in CI; compiled on CUDA ones where a GPU runs the suite with
    # TRITON_INTERPRET=0.
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.fail("without a GPU Triton runs only in its interpreter (tests/conftest.py sets TRITON_INTERPRET=1)")
    params = (MIX * 2)[:b]
    x = logits_for(b, v, seed=10 + v)
    x[0, v // 2] = x[0, v - 1] = x[0].max() + 2  # a greedy row's tie across chunks
    x = x.to(device)
    st = build(params, positions=[(3 * i) % 7 for i in range(b)], device=device)
    assert torch.equal(sample(x, st, backend="triton"), sample(x, st, backend="torch"))
    assert int(sample(x, st, backend="triton")[0]) == v // 2
    # T so large the tokens are the argmin of the random words: the words themselves agree
    flat = build([SamplingParams(temperature=1e30)] * b, positions=list(range(b)), device=device)
    assert torch.equal(sample(x, flat, backend="triton"), sample(x, flat, backend="torch"))
    # a non-contiguous and bf16 logits
    wide = torch.cat([x, x], dim=1)[:, :v]
    assert torch.equal(sample(wide, st, backend="triton"), sample(x, st, backend="torch"))
    xb = x.to(torch.bfloat16)
    assert torch.equal(sample(xb, st, backend="triton"), sample(xb, st, backend="torch"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_samples_what_the_cpu_samples():
    x = logits_for(len(MIX) * 4, 202_048, seed=11)
    params = MIX * 4
    seeds, positions = list(range(len(params))), [i * 5 for i in range(len(params))]
    cpu = sample(x, build(params, seeds, positions))
    st = build(params, seeds, positions, device="cuda")
    assert torch.equal(
        random_bits(st.seed, st.position, 1000).cpu(), random_bits(st.seed.cpu(), st.position.cpu(), 1000)
    )
    assert torch.equal(sample(x.cuda(), st, backend="torch").cpu(), cpu)
    assert torch.equal(sample(x.cuda(), st).cpu(), cpu)
