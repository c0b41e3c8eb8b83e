"""Decode steps through DecodeGraphs' padded static buffers (moeserve.router.graphs).

On CPU nothing is captured: every step runs the padded batch eagerly through the same buffers
and the same scratch block a CUDA graph would use, so these tests check the padding itself:
real rows equal an unpadded step, padded rows write only the scratch block.
"""

import pytest
import torch

from moeserve.models import init_model, load_model
from moeserve.models.paged import PagedBatch
from moeserve.router.graphs import DecodeGraphs, applies, bucket_sizes, mixed_buckets

pytestmark = pytest.mark.timeout(120)
BS = 4


@pytest.fixture(scope="module", params=["llama4", "ernie45"])
def model(request, tmp_path_factory):
    return load_model(init_model(tmp_path_factory.mktemp(request.param), request.param, seed=3))


def test_bucket_sizes_cover_every_batch_up_to_the_limit():
    assert bucket_sizes(1) == [1] and bucket_sizes(4) == [1, 2, 4] and bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    for m in (1, 3, 8, 17, 64, 100, 256):
        sizes = bucket_sizes(m)
        assert sizes == sorted(set(sizes)) and sizes[-1] == m
        for s in range(1, m + 1):
            b = next(x for x in sizes if x >= s)
            assert b - s < max(16, s)  # never more than one bucket step of padding
    assert bucket_sizes(256)[:5] == [1, 2, 4, 8, 16] and bucket_sizes(256)[-1] == 256


def test_graphs_apply_only_on_cuda_with_the_direct_exchange(model):
    ok, why = applies(model, None, None, enforce_eager=True)
    assert not ok and why == "enforce_eager"
    ok, why = applies(model, None, None, enforce_eager=False)
    assert not ok and "CUDA" in why


def _prefill(model, cache, prompts, tables):
    lens = [len(p) for p in prompts]
    batch = PagedBatch.build(lens, [0] * len(prompts), tables, BS)
    ids = torch.tensor([t for p in prompts for t in p])
    hidden = model.step(ids, batch, cache)
    return model.logits(hidden.index_select(0, batch.last_token_index))


def test_padded_decode_steps_equal_unpadded_ones_and_touch_only_the_scratch_block(model):
    """3 sequences decode for 5 steps in a bucket of 4 (one padded row): their logits equal
    unpadded steps on a second cache, and the two caches agree on every real slot."""
    torch.manual_seed(0)
    v = model.config.vocab_size
    prompts = [torch.randint(3, v, (n,)).tolist() for n in (5, 9, 3)]
    num_blocks = 16
    tables = [[0, 1, 2], [3, 4, 5, 6], [7, 8]]
    padded = model.new_paged_cache(num_blocks + 1, BS)  # + the scratch block
    plain = model.new_paged_cache(num_blocks, BS)
    graphs = DecodeGraphs(model, padded, None, BS, max_seqs=4, max_model_len=16)
    assert graphs.scratch == num_blocks and graphs.sizes == [1, 2, 4]
    a = _prefill(model, padded, prompts, tables)
    b = _prefill(model, plain, prompts, tables)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    tokens = a.argmax(-1).tolist()
    starts = [len(p) for p in prompts]
    for step in range(5):
        got = graphs.run(tokens, starts, tables, step)  # [3, V]
        batch = PagedBatch.build([1, 1, 1], starts, tables, BS)
        want = model.logits(model.step(torch.tensor(tokens), batch, plain))  # [3, V]
        assert got.shape == want.shape
        assert (got.float() - want.float()).abs().max() < 1e-4, step
        tokens = want.argmax(-1).tolist()
        starts = [s + 1 for s in starts]
    # a padded batch rounds its projections differently (fp32, a few ulps): relative as well as
    # absolute, as the values reach |2.5| (ERNIE's init)
    for layer in range(model.config.num_layers):
        real = slice(0, num_blocks * BS)
        torch.testing.assert_close(padded.k[layer][real], plain.k[layer][real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded.v[layer][real], plain.v[layer][real], rtol=1e-5, atol=1e-5)
        assert padded.k[layer][num_blocks * BS :].abs().sum() > 0  # the padded row wrote its scratch slot


def test_a_batch_that_does_not_fit_is_left_to_the_eager_path(model):
    cache = model.new_paged_cache(9, BS)
    graphs = DecodeGraphs(model, cache, None, BS, max_seqs=2, max_model_len=8)  # tables of 2 blocks at most
    assert graphs.fits(2, [[0, 1], [2]])
    assert not graphs.fits(3, [[0], [1], [2]])  # more sequences than the largest bucket
    assert not graphs.fits(1, [[0, 1, 2]])  # a table wider than max_model_len allows
    assert not graphs.fits(0, [])


def test_ids_taken_from_the_device_token_buffer_equal_ids_sent_by_the_host(model):
    """Asynchronous steps: a decode whose input the leader has not seen reads it from the
    runner's ``tok_buf`` on the device (``src`` entry >= 0); the step is the same as with the
    ids sent by the host."""
    from moeserve.router.runner import RouterRunner

    class Tokens:  # the runner's device token buffer, alone
        tok_buf = torch.zeros(8, dtype=torch.long)
        select_ids = RouterRunner.select_ids

    torch.manual_seed(1)
    v = model.config.vocab_size
    prompts = [torch.randint(3, v, (n,)).tolist() for n in (4, 6, 2)]
    tables = [[0, 1], [2, 3], [4, 5]]
    caches = [model.new_paged_cache(7, BS) for _ in range(2)]
    graphs = [DecodeGraphs(model, c, None, BS, max_seqs=4, max_model_len=8) for c in caches]
    tokens = _prefill(model, caches[0], prompts, tables).argmax(-1).tolist()
    _prefill(model, caches[1], prompts, tables)
    src = [5, -1, 1]  # rows 0 and 2 from the buffer, row 1 from the host
    toks = Tokens()
    toks.tok_buf[5], toks.tok_buf[1] = tokens[0], tokens[2]
    starts = [len(p) for p in prompts]
    want = graphs[0].run(tokens, starts, tables, 0).clone()
    got = graphs[1].run([0, tokens[1], 0], starts, tables, 0, src=src, runner=toks)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert graphs[1].longs[0, :3].tolist() == tokens


def test_warmup_keys_reach_every_key_a_decode_step_can_use_and_warmup_touches_only_the_scratch_block(model):
    """--capture-graphs-at-start: the warm-up keys cover every (bucket, attention split) of a
    decode step up to max_model_len (checked with an H200's SM count, where the split varies),
    and a warm-up step writes only the scratch block."""
    cache = model.new_paged_cache(9, BS)
    graphs = DecodeGraphs(model, cache, None, BS, max_seqs=20, max_model_len=2048)
    graphs.sms = 132
    keys = graphs.warmup_keys()
    got = {(b, graphs._ns(b, msl)) for b, msl in keys}
    assert len(got) == len(keys) and {b for b, _ in keys} == set(graphs.sizes)
    for s in range(1, 21):
        b = next(x for x in graphs.sizes if x >= s)
        for msl in range(1, 2049, 7):
            assert (b, graphs._ns(b, msl)) in got, (s, msl)
    assert len({ns for _, ns in got}) > 1  # the split does vary on this GPU
    graphs.sms = None
    before = [(k.clone(), v.clone()) for k, v in zip(cache.k, cache.v)]
    graphs.warmup(4, 7, 0)  # bucket 4, the longest sequence 7 tokens
    real = slice(0, 8 * BS)
    for layer, (k, v) in enumerate(before):
        assert torch.equal(cache.k[layer][real], k[real]) and torch.equal(cache.v[layer][real], v[real])
        assert not torch.equal(cache.k[layer][8 * BS :], k[8 * BS :])  # the scratch block was written


def test_mixed_buckets_cover_every_step_up_to_the_token_budget(monkeypatch):
    monkeypatch.delenv("MOESERVE_MIXED_TOKEN_BUCKETS", raising=False)
    assert mixed_buckets(256, 0) == ([], [])
    assert mixed_buckets(256, 8192) == ([128, 256, 512, 1024, 2048], [16, 64, 256])
    assert mixed_buckets(20, 300) == ([128, 256, 300], [16, 20])
    assert mixed_buckets(4, 64) == ([64], [4])
    # other token buckets: a 2,048-token chunk beside its decodes (2,112) gets a graph of its own
    assert mixed_buckets(256, 2112, (128, 2048, 4096)) == ([128, 2048, 2112], [16, 64, 256])
    assert mixed_buckets(256, 8192, (128, 2048, 4096)) == ([128, 2048, 4096], [16, 64, 256])


def test_mixed_token_buckets_are_read_from_the_switch_and_refused_by_name_otherwise(model, monkeypatch):
    """MOESERVE_MIXED_TOKEN_BUCKETS (a measurement switch) names the token buckets a router's
    mixed graphs take; empty keeps the default; anything but increasing counts 1 .. 16,384 fails
    the router's graphs at build, saying what is allowed."""
    from moeserve.router import graphs as graphs_mod

    monkeypatch.setenv("MOESERVE_MIXED_TOKEN_BUCKETS", "")
    assert graphs_mod.mixed_token_buckets() == graphs_mod.MIXED_TOKENS
    monkeypatch.setenv("MOESERVE_MIXED_TOKEN_BUCKETS", "128,2048,2560,4096")
    assert graphs_mod.mixed_token_buckets() == (128, 2048, 2560, 4096)
    cache = model.new_paged_cache(9, BS)
    built = DecodeGraphs(model, cache, None, BS, max_seqs=4, max_model_len=16, max_tokens=3000)
    assert built.mixed_tokens == [128, 2048, 2560, 3000] and built.m_longs.shape[1] == 3000
    for bad in ("2048,1024", "128,128", "0,64", "64,20000", "64,,128", "x", "64;128"):
        monkeypatch.setenv("MOESERVE_MIXED_TOKEN_BUCKETS", bad)
        with pytest.raises(ValueError, match=f"MOESERVE_MIXED_TOKEN_BUCKETS='{bad}': allowed a comma list"):
            DecodeGraphs(model, cache, None, BS, max_seqs=4, max_model_len=16, max_tokens=3000)


def test_padded_mixed_steps_equal_unpadded_ones_and_touch_only_the_scratch_block(model):
    """Mixed steps (a decode, a prefill chunk after a cached prefix, a new prompt; one decode's
    id taken from the device token buffer) through the padded buffers of their (tokens,
    sequences) bucket: each sequence's last-token logits equal an unpadded eager step's on a
    second cache, the caches agree on every real slot, and the padded tokens wrote only the
    scratch block. Steps of more tokens than the largest bucket, or wider tables, stay eager."""
    from moeserve.router.runner import RouterRunner

    class Tokens:  # the runner's device token buffer, alone
        tok_buf = torch.zeros(8, dtype=torch.long)
        select_ids = RouterRunner.select_ids

    torch.manual_seed(2)
    v = model.config.vocab_size
    num_blocks = 24
    padded = model.new_paged_cache(num_blocks + 1, BS)
    plain = model.new_paged_cache(num_blocks, BS)
    graphs = DecodeGraphs(model, padded, None, BS, max_seqs=20, max_model_len=40, max_tokens=300)
    assert graphs.mixed_tokens == [128, 256, 300] and graphs.mixed_seqs == [16, 20]
    prompts = [torch.randint(3, v, (n,)).tolist() for n in (6, 13)]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11]]
    first = [prompts[0], prompts[1][:5]]  # sequence 1's first chunk
    a = _prefill(model, padded, first, tables[:2])
    torch.testing.assert_close(a, _prefill(model, plain, first, tables[:2]), rtol=0, atol=0)
    toks = Tokens()
    dec = int(a[0].argmax())
    toks.tok_buf[3] = dec
    new = torch.randint(3, v, (9,)).tolist()
    nxt: list[int] = []  # the tokens each sequence sampled in the step before
    for step in range(3):
        if step == 0:  # decode (its id on the device), sequence 1's next chunk of 8, a new prompt of 9
            num_new, starts = [1, 8, 9], [6, 5, 0]
            ids, src = [0, *prompts[1][5:], *new], [3] + [-1] * 17
        else:  # every sequence decodes one token, ids sent by the host
            num_new, starts = [1, 1, 1], [s + n for s, n in zip(starts, num_new)]
            ids, src = nxt, None
        assert graphs.mixed_key(num_new, tables) == (128, 16)
        got = graphs.run_mixed((128, 16), ids, src, num_new, starts, tables, step, runner=toks)  # [3, V]
        host = [dec if j >= 0 else t for t, j in zip(ids, src or [-1] * len(ids))]
        batch = PagedBatch.build(num_new, starts, tables, BS)
        want = model.logits(model.step(torch.tensor(host), batch, plain).index_select(0, batch.last_token_index))
        assert got.shape == want.shape
        assert (got.float() - want.float()).abs().max() < 1e-4, step
        nxt = want.argmax(-1).tolist()
    # 128 padded rows against 18 round the projections differently (fp32, a few ulps of values near 2.5)
    for layer in range(model.config.num_layers):
        real = slice(0, num_blocks * BS)
        torch.testing.assert_close(padded.k[layer][real], plain.k[layer][real], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(padded.v[layer][real], plain.v[layer][real], rtol=1e-4, atol=1e-4)
        assert padded.k[layer][num_blocks * BS :].abs().sum() > 0  # padded tokens wrote the scratch block
    assert graphs.mixed_key([301], [[0]]) is None  # more tokens than the largest bucket: eager
    assert graphs.mixed_key([3], [list(range(11))]) is None  # a table wider than max_model_len allows
    assert graphs.mixed_key([1] * 21, [[0]] * 21) is None  # more sequences than max_seqs
    assert DecodeGraphs(model, padded, None, BS, max_seqs=20, max_model_len=40).mixed_key([5], [[0]]) is None


def test_mixed_warmup_keys_reach_every_mixed_key_and_write_only_the_scratch_block(model):
    cache = model.new_paged_cache(9, BS)
    graphs = DecodeGraphs(model, cache, None, BS, max_seqs=20, max_model_len=64, max_tokens=200)
    mixed = [(t, s) for t, s in graphs.warmup_keys() if s < 0]  # (tokens, -sequences)
    assert sorted(mixed) == sorted((t, -s) for t in (128, 200) for s in (16, 20))
    for t in range(1, 201, 13):
        for s in range(1, min(t, 20) + 1, 3):
            tk, sk = graphs.mixed_key([t - s + 1] + [1] * (s - 1), [[0]] * s)
            assert (tk, -sk) in mixed
    before = [(k.clone(), v.clone()) for k, v in zip(cache.k, cache.v)]
    graphs.warmup(128, -16, 0)
    assert ("mixed", 128, 16) in graphs.seen
    real = slice(0, 8 * BS)
    for layer, (k, v) in enumerate(before):
        assert torch.equal(cache.k[layer][real], k[real]) and torch.equal(cache.v[layer][real], v[real])
        assert not torch.equal(cache.k[layer][8 * BS :], k[8 * BS :])


def test_every_key_writes_its_logits_into_the_one_static_buffer(model):
    """A captured graph keeps the tensors it returns allocated in the graphs' memory pool: were
    each key's logits a tensor of its own, ``max_num_seqs`` 1,024 would hold sum(Bk) x V values
    for the rank's life (about 13 GB at Scout's vocabulary). Every key, decode or mixed, writes
    its rows of the one ``logits_out`` [Bmax, V] instead."""
    torch.manual_seed(4)
    v = model.config.vocab_size
    cache = model.new_paged_cache(33, BS)
    graphs = DecodeGraphs(model, cache, None, BS, max_seqs=20, max_model_len=8, max_tokens=200)
    assert graphs.logits_out.shape == (20, model.lm_head.weight.shape[0])
    assert graphs.logits_out.dtype == model.lm_head.weight.dtype
    base = graphs.logits_out.untyped_storage().data_ptr()
    tables = [[2 * i, 2 * i + 1] for i in range(16)]
    seen = []
    for s in (1, 3, 16):  # buckets 1, 4 and 16
        got = graphs.run(torch.randint(3, v, (s,)).tolist(), [0] * s, tables[:s], 0)
        assert got.shape == (s, v) and got.untyped_storage().data_ptr() == base
        seen.append(got[0].clone())
    assert not torch.equal(seen[0], seen[1])  # each step wrote its own values there
    num_new = [5, 1, 1]
    key = graphs.mixed_key(num_new, tables[:3])
    got = graphs.run_mixed(key, torch.randint(3, v, (7,)).tolist(), None, num_new, [0, 0, 0], tables[:3], 1)
    assert got.shape == (3, v) and got.untyped_storage().data_ptr() == base
    assert {k[:1] for k in graphs.seen} == {(1,), (4,), (16,), ("mixed",)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_written_into_a_buffer_gives_the_bits_of_the_linear(dtype, bias):
    from moeserve.models.layers import Linear

    g = torch.Generator().manual_seed(5)
    lin = Linear(torch.randn(300, 64, generator=g).to(dtype), torch.randn(300, generator=g).to(dtype) if bias else None)
    x = torch.randn(7, 64, generator=g).to(dtype)
    out = torch.full((9, 300), float("nan"), dtype=dtype)
    got = lin.into(x, out[:7])
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, lin(x)) and out[7:].isnan().all()
