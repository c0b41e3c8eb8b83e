"""Decode steps through DecodeGraphs' padded static buffers (moeserve.router.graphs).

On CPU nothing is captured: every step runs the padded batch eagerly through the same buffers
and the same scratch block a CUDA graph would use, so these tests check the padding itself:
real rows equal an unpadded step, padded rows write only the scratch block.
"""

import pytest
import torch

from moeserve.models import init_model, load_model
from moeserve.models.paged import PagedBatch
from moeserve.router.graphs import DecodeGraphs, applies, bucket_sizes

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
