"""The family-neutral decoder: varlen steps, the KV cache, the expert seam, generate's semantics."""

import hf_oracle as hf
import pytest
import torch

from moeserve.models import CheckpointError, KVCache, StepBatch, init_model, load_model
from moeserve.models.moe import LocalExperts


@pytest.fixture(scope="module", params=["llama4", "ernie45"])
def model(request, tmp_path_factory):
    return load_model(init_model(tmp_path_factory.mktemp(request.param), request.param, seed=1))


def _ids(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_varlen_step_with_several_sequences_equals_separate_runs(model):
    seqs = {"a": _ids(21, 1), "b": _ids(5, 2), "c": _ids(13, 3)}
    full = {k: model(v[None])[0] for k, v in seqs.items()}  # [n, V] each
    cache = model.new_cache()
    # step 1: three prefills of different lengths; step 2: a later chunk, a decode token, a chunk
    plan = [{"a": (0, 9), "b": (0, 4), "c": (0, 11)}, {"a": (9, 21), "b": (4, 5), "c": (11, 13)}]
    for step in plan:
        batch = StepBatch(tuple(step), tuple(e - s for s, e in step.values()), tuple(s for s, _ in step.values()))
        ids = torch.cat([seqs[k][s:e] for k, (s, e) in step.items()])
        logits = model.logits(model.step(ids, batch, cache))  # [T, V]
        for i, (k, (s, e)) in enumerate(step.items()):
            a, b = batch.offsets[i], batch.offsets[i + 1]
            assert (logits[a:b] - full[k][s:e]).abs().max() < 1e-4, k
    assert {k: cache.length(k) for k in seqs} == {"a": 21, "b": 5, "c": 13}


def test_step_batch_positions_and_offsets():
    b = StepBatch((3, 9), (2, 3), (5, 0))
    assert b.positions.tolist() == [5, 6, 0, 1, 2]
    assert b.num_tokens == 5 and b.offsets == (0, 2, 5)
    assert b.last_token_index.tolist() == [1, 4]
    with pytest.raises(ValueError, match="distinct"):
        StepBatch((1, 1), (1, 1), (0, 0))
    with pytest.raises(ValueError, match="lens"):
        StepBatch((1,), (0,), (0,))


def test_cache_start_must_equal_the_cached_length(model):
    cache = model.new_cache()
    model.step(_ids(4, 0), StepBatch.prefill([7], [4]), cache)
    with pytest.raises(ValueError, match="has 4 cached tokens but the step starts it at 3"):
        model.step(_ids(1, 0), StepBatch((7,), (1,), (3,)), cache)
    with pytest.raises(ValueError, match="not in the KV cache, so its start must be 0"):
        model.step(_ids(1, 0), StepBatch((8,), (1,), (2,)), cache)
    with pytest.raises(ValueError, match="lens sum to 2"):
        model.step(_ids(3, 0), StepBatch((7,), (2,), (4,)), cache)
    cache.release(7)
    assert 7 not in cache
    model.step(_ids(2, 0), StepBatch.prefill([7], [2]), cache)  # a released id starts again at 0
    assert cache.length(7) == 2


def test_out_of_vocabulary_ids_are_rejected(model):
    with pytest.raises(ValueError, match="token id 512 out of range 0..511"):
        model(torch.tensor([[1, 512]]))


class Recorder:
    """An ExpertsBackend that runs LocalExperts and records the calls of the seam."""

    def __init__(self, model, inner):
        self.inner, self.calls = inner, []
        for m, block in enumerate(model.moe_blocks):
            block.shared = self._spy(m, block.shared)

    def _spy(self, m, fn):
        def shared(u):
            self.calls.append(("shared", m, u.shape[0]))
            return fn(u)

        return shared

    def dispatch(self, moe_layer, hidden, routing):
        self.calls.append(("dispatch", moe_layer, hidden.shape[0]))
        return moe_layer, self.inner.dispatch(moe_layer, hidden, routing)

    def combine(self, handle):
        self.calls.append(("combine", handle[0], None))
        return self.inner.combine(handle[1])


def test_each_moe_layer_runs_route_dispatch_shared_combine_with_the_moe_layer_index(tmp_path):
    m = load_model(init_model(tmp_path, "ernie45", seed=2))  # layer 0 dense: MoE layer m = decoder layer m+1
    rec = Recorder(m, m.experts)
    m.step(_ids(5, 0), StepBatch.prefill([0], [5]), m.new_cache(), experts=rec)
    expected = [
        (kind, i, None if kind == "combine" else 5) for i in range(3) for kind in ("dispatch", "shared", "combine")
    ]
    assert rec.calls == expected
    assert m.moe_info.moe_layer_ids == (1, 2, 3)


def test_an_empty_step_still_takes_part_in_every_moe_layer(tmp_path):
    m = load_model(init_model(tmp_path, "llama4", seed=2))
    rec = Recorder(m, m.experts)
    out = m.step(torch.zeros(0, dtype=torch.long), StepBatch((), (), ()), m.new_cache(), experts=rec)
    assert out.shape == (0, 64)
    assert [c for c in rec.calls if c[0] == "dispatch"] == [("dispatch", 0, 0), ("dispatch", 1, 0)]


def test_router_side_model_reads_no_routed_expert_weights(tmp_path):
    """A checkpoint with every routed expert tensor removed still loads with load_experts=False."""
    full_path = init_model(tmp_path / "full", "llama4", seed=3)
    full = load_model(full_path)
    stripped = {k: v for k, v in hf.read_all(full_path).items() if ".experts." not in k}
    path = hf.rewrite(full_path, tmp_path / "router_only", stripped)
    router = load_model(path, load_experts=False)
    assert router.experts is None
    ids = _ids(9, 4)
    with pytest.raises(ValueError, match="load_experts=False"):
        router.step(ids, StepBatch.prefill([0], [9]), router.new_cache())
    with pytest.raises(CheckpointError, match="experts.gate_up_proj' is missing"):
        load_model(path)
    got = router.logits(router.step(ids, StepBatch.prefill([0], [9]), router.new_cache(), experts=full.experts))
    assert torch.equal(got, full(ids[None])[0])


def test_moe_info_describes_what_eplb_needs(tmp_path):
    l4 = load_model(init_model(tmp_path / "l4", "llama4"), load_experts=False)
    i = l4.moe_info
    assert (
        i.num_moe_layers,
        i.moe_layer_ids,
        i.num_logical_experts,
        i.num_shared_experts,
        i.top_k,
        i.num_expert_groups,
    ) == (2, (1, 3), 8, 1, 1, 1)
    assert i.expert_spec.shapes == {"gate_up": (64, 64), "down": (32, 64)}
    assert i.expert_bytes == (64 * 64 + 32 * 64) * 4 == i.expert_spec.nbytes
    er = load_model(init_model(tmp_path / "er", "ernie45"), dtype=torch.bfloat16, load_experts=False)
    i = er.moe_info
    assert (i.num_moe_layers, i.moe_layer_ids, i.num_logical_experts, i.num_shared_experts, i.top_k) == (
        3,
        (1, 2, 3),
        16,
        2,
        4,
    )
    assert i.expert_spec.dtype == torch.bfloat16 and i.expert_bytes == 3 * 64 * 32 * 2


def test_local_experts_hold_canonical_stacked_weights(model):
    assert isinstance(model.experts, LocalExperts)
    e, h, i = model.config.num_experts, 64, 32
    assert len(model.experts.weights) == model.moe_info.num_moe_layers
    assert model.experts.weights[0]["gate_up"].shape == (e, h, 2 * i)
    assert model.experts.weights[0]["down"].shape == (e, i, h)


@pytest.fixture(scope="module", params=["llama4", "ernie45"])
def hf_case(request, tmp_path_factory):
    build = hf.build_llama4 if request.param == "llama4" else hf.build_ernie
    path = hf.save(build(seed=5), tmp_path_factory.mktemp(request.param))
    return hf.load_oracle(path), load_model(path)


def test_generate_stops_at_eos_and_pads_like_transformers(hf_case):
    oracle, model = hf_case
    ids = hf.prompts(2, 5, seed=9)
    free = hf.hf_greedy(oracle, ids, 12)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else None
    # row 0 stops early and is padded; row 1 runs to max_new_tokens (unless it meets row 0's EOS too)
    eos = [int(free[0, 5 + 2])]
    ref = hf.hf_greedy(oracle, ids, 12, eos=eos, pad=pad if pad is not None else eos[0])
    got = model.generate(ids, max_new_tokens=12, eos_token_ids=eos)
    assert torch.equal(got, ref)
    assert got[0, 5 + 3 :].eq(pad if pad is not None else eos[0]).all()
    # every row stopped: the output is shorter than T + max_new_tokens, as in transformers
    eos = [int(free[0, 5 + 1]), int(free[1, 5 + 2])]
    ref = hf.hf_greedy(oracle, ids, 12, eos=eos, pad=pad if pad is not None else eos[0])
    got = model.generate(ids, max_new_tokens=12, eos_token_ids=eos)
    assert torch.equal(got, ref) and got.shape[1] < 5 + 12
    # ignore_eos runs to the end
    assert model.generate(ids, max_new_tokens=12, eos_token_ids=eos, ignore_eos=True).shape == (2, 17)


def test_sampling_is_deterministic_per_seed_and_independent_of_the_batch(model):
    p = torch.stack([_ids(6, 10), _ids(6, 11)])
    kw = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
    both = model.generate(p, seed=5, **kw)
    assert torch.equal(both[0], model.generate(p[:1], seed=5, **kw)[0])
    assert torch.equal(both[1], model.generate(p[1:], seed=5, **kw)[0])
    assert not torch.equal(both, model.generate(p, seed=6, **kw))


def test_generate_ids_continues_prompts_of_different_lengths(model):
    from moeserve.sampling import SamplingParams

    prompts = [_ids(3, 20).tolist(), _ids(11, 21).tolist(), _ids(1, 22).tolist()]
    out = model.generate_ids(prompts, [SamplingParams()] * 3, 8, ignore_eos=True)
    for p, new in zip(prompts, out):
        alone = model.generate(torch.tensor([p]), max_new_tokens=8, ignore_eos=True)[0, len(p) :]
        assert new == alone.tolist()


def test_kv_cache_grows_past_its_first_capacity():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2)
    cache.begin(StepBatch.prefill([0], [10]))
    k = torch.arange(20.0).view(10, 1, 2)
    cache.write(0, 0, 0, k, k)
    cache.commit(StepBatch.prefill([0], [10]))
    cache.begin(StepBatch((0,), (30,), (10,)))
    keys, _ = cache.write(0, 0, 10, torch.ones(30, 1, 2), torch.ones(30, 1, 2))
    assert keys.shape == (40, 1, 2) and torch.equal(keys[:10], k)
