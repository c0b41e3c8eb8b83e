"""The fused routing kernel (moeserve/kernels/triton_routing.py), run by Triton's interpreter on
CPU tensors: for every routing it serves it chooses the ids torch's ``route`` chooses, in the
same (descending) order, with the same weights (fp32 within 1e-6, bf16 within a step of the
dtype: the interpreter truncates where the GPU rounds); ``route`` takes it only where it
should, and MOESERVE_FUSED_ROUTING=0 or a CPU tensor keeps torch's sequence."""

import dataclasses

import pytest
import torch
from triton_util import needs_triton

from moeserve import kernels
from moeserve.models.config import RoutingSpec
from moeserve.models.routing import MoEBlock, route

pytestmark = needs_triton

# (spec, E, K, logits dtype, correction bias): the routings the kernel serves
CASES = {
    "ernie": (
        RoutingSpec(gate_fp32=True, correction_bias=True, renormalize=True, renorm_min=1e-12),
        64,
        6,
        torch.float32,
        True,
    ),
    "qwen3": (RoutingSpec(renormalize=True), 128, 8, torch.bfloat16, False),
    "qwen3-no-renorm": (RoutingSpec(), 128, 8, torch.bfloat16, False),
    "mixtral": (RoutingSpec(renormalize=True), 8, 2, torch.bfloat16, False),
    "dsv3-one-group": (
        RoutingSpec(
            scoring="sigmoid",
            gate_fp32=True,
            correction_bias=True,
            renormalize=True,
            renorm_min=1e-20,
            scaling_factor=2.5,
        ),
        256,
        8,
        torch.float32,
        True,
    ),
    "e512-k16": (RoutingSpec(renormalize=True), 512, 16, torch.float32, False),
    "groups-of-3": (RoutingSpec(renormalize=True, n_group=4, topk_group=2), 12, 5, torch.bfloat16, False),
    "groups-of-1": (RoutingSpec(n_group=8, topk_group=3), 8, 2, torch.float32, False),
}


# DeepSeek-V3's group-limited selection (MOESERVE_FUSED_GROUPED_ROUTING; the tests turn it on)
CASES["dsv3"] = (dataclasses.replace(CASES["dsv3-one-group"][0], n_group=8, topk_group=4), *CASES["dsv3-one-group"][1:])


@pytest.fixture(autouse=True)
def _grouped_routing_on(monkeypatch):
    """The grouped selection runs fused only where MOESERVE_FUSED_GROUPED_ROUTING=1 puts it
    (off by default): these tests hold the kernel to torch's sequence with it on."""
    monkeypatch.setattr(kernels, "GROUPED_ROUTING_DEVICES", ("cuda", "cpu"))


def distinct_logits(t: int, e: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits [T, E] in ``dtype`` with no two equal in a row (so that no choice ties:
    torch.topk's order among equal values is unspecified)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(t):
        pool = torch.unique((torch.randn(8 * e, generator=g) * 2).to(dtype))  # distinct values of the dtype
        rows.append(pool[torch.randperm(pool.numel(), generator=g)[:e]])
    x = torch.stack(rows)
    assert all(len(set(r.tolist())) == e for r in x)
    return x


def bias_for(e: int, seed: int) -> torch.Tensor:
    return torch.randn(e, generator=torch.Generator().manual_seed(seed + 1000)) * 0.05


def weights_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    else:  # one rounding to the dtype: equal, or a step apart (the interpreter truncates)
        assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 1e-2).all()


SIZES = [(name, t) for name in CASES for t in ([1, 3, 65] if name != "e512-k16" else [1, 9])]


@pytest.mark.parametrize("name,t", SIZES, ids=[f"{n}-T{t}" for n, t in SIZES])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_routing_equals_the_torch_route(name, t, out_dtype):
    spec, e, k, dtype, has_bias = CASES[name]
    logits = distinct_logits(t, e, dtype, seed=t * 7 + e)
    bias = bias_for(e, t) if has_bias else None
    ref = route(spec, logits, k, bias, out_dtype)  # torch's sequence (a CPU tensor)
    ids, weights = kernels.fused_route(
        logits,
        k,
        spec.scoring,
        bias,
        spec.renormalize,
        spec.renorm_min,
        spec.scaling_factor,
        out_dtype,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
    )
    assert ids.dtype == torch.long and ids.shape == (t, k)
    assert torch.equal(ids, ref.ids)  # the same experts in the same (descending) order
    weights_close(weights, ref.weights)
    if spec.renormalize and spec.scaling_factor == 1.0:  # the weights are renormalised, not raw scores
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(t), rtol=2e-2, atol=0)


def test_the_bias_selects_and_the_unbiased_scores_weigh():
    """A bias that lifts a low-scoring expert into the top-k: it is chosen, and weighs by its
    own score, not by the biased one."""
    e, k = 16, 2
    logits = torch.linspace(2.0, -2.0, e)[None, :]  # expert 0 best, 15 worst
    bias = torch.zeros(e)
    bias[15] = 1.0
    ids, w = kernels.fused_route(logits, k, "softmax", bias, False, None, 1.0, torch.float32)
    assert ids.tolist() == [[15, 0]]
    scores = torch.softmax(logits, -1)
    torch.testing.assert_close(w, scores[:, [15, 0]], rtol=1e-6, atol=0)
    ids, w = kernels.fused_route(logits, k, "softmax", None, False, None, 1.0, torch.float32)
    assert ids.tolist() == [[0, 1]]


def test_the_renormalisation_floor_and_the_scaling_factor():
    logits = torch.full((1, 8), -30.0)  # sigmoid scores ~1e-13: their sum is below the floor
    logits[0, 3] = -29.0
    ids, w = kernels.fused_route(logits, 2, "sigmoid", None, True, 1e-6, 3.0, torch.float32)
    s = torch.sigmoid(logits)
    assert ids[0, 0].item() == 3
    torch.testing.assert_close(w, s.gather(-1, ids) / 1e-6 * 3.0, rtol=1e-6, atol=0)
    ids, w = kernels.fused_route(logits, 2, "sigmoid", None, True, 0.0, 1.0, torch.float32)  # no floor
    torch.testing.assert_close(w.sum(-1), torch.ones(1), rtol=1e-6, atol=0)


def test_equal_choices_take_the_lowest_index_first():
    logits = torch.tensor([[0.0, 1.0, 0.5, 1.0, 1.0, 0.5]])
    ids, _ = kernels.fused_route(logits, 4, "softmax", None, True, None, 1.0, torch.float32)
    assert ids.tolist() == [[1, 3, 4, 2]]


def test_a_tokens_routing_does_not_depend_on_the_batch():
    spec, e, k, dtype, _ = CASES["ernie"]
    logits, bias = distinct_logits(37, e, dtype, seed=5), bias_for(e, 5)
    ids, w = kernels.fused_route(logits, k, "softmax", bias, True, 1e-12, 1.0, torch.bfloat16)
    for lo, hi in [(0, 1), (5, 6), (3, 20), (36, 37)]:
        i1, w1 = kernels.fused_route(logits[lo:hi].clone(), k, "softmax", bias, True, 1e-12, 1.0, torch.bfloat16)
        assert torch.equal(i1, ids[lo:hi]) and torch.equal(w1, w[lo:hi])
    i0, w0 = kernels.fused_route(logits[:0], k, "softmax", bias, True, 1e-12, 1.0, torch.bfloat16)
    assert i0.shape == (0, k) and w0.shape == (0, k) and i0.dtype == torch.long


def test_route_takes_the_kernel_only_where_it_serves(monkeypatch):
    x = torch.zeros(4, 64)
    softmax = RoutingSpec(renormalize=True)
    assert not kernels.fused_route_takes(x, softmax, 6)  # a CPU tensor: torch's sequence
    monkeypatch.setattr(kernels, "ROUTING_DEVICES", ("cuda", "cpu"))
    assert kernels.fused_route_takes(x, softmax, 6)
    assert kernels.fused_route_takes(x.bfloat16(), RoutingSpec(scoring="sigmoid", correction_bias=True), 8)
    assert not kernels.fused_route_takes(x, RoutingSpec(topk_first=True), 4)  # Llama 4, GPT-OSS
    grouped = RoutingSpec(n_group=8, topk_group=4)  # DeepSeek-V3's groups: fused where switched on
    assert kernels.fused_route_takes(x, grouped, 6)
    assert not kernels.fused_route_takes(torch.zeros(4, 60), grouped, 6)  # 60 experts in 8 groups
    assert not kernels.fused_route_takes(x, RoutingSpec(n_group=16, topk_group=1), 6)  # 6 > one group of 4
    assert not kernels.fused_route_takes(torch.zeros(4, 256), RoutingSpec(n_group=128, topk_group=4), 6)
    monkeypatch.setattr(kernels, "GROUPED_ROUTING_DEVICES", ("cuda",))  # the default: CUDA only
    assert not kernels.fused_route_takes(x, grouped, 6)
    assert kernels.fused_route_takes(x, softmax, 6)
    assert not kernels.fused_route_takes(x, softmax, 17)  # K past ROUTING_MAX_K
    assert not kernels.fused_route_takes(torch.zeros(4, 1024), softmax, 8)  # E past ROUTING_MAX_E
    assert not kernels.fused_route_takes(x.long(), softmax, 6)


class _Spy:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = kernels.fused_route

        def spy(*args, **kw):
            self.calls += 1
            return real(*args, **kw)

        monkeypatch.setattr(kernels, "fused_route", spy)


def test_route_runs_the_kernel_when_it_takes_it_and_torch_otherwise(monkeypatch):
    spec, e, k, dtype, _ = CASES["ernie"]
    logits, bias = distinct_logits(9, e, dtype, seed=2), bias_for(e, 2)
    spy = _Spy(monkeypatch)
    ref = route(spec, logits, k, bias, torch.bfloat16)  # CPU: torch's sequence, the kernel not run
    assert spy.calls == 0
    monkeypatch.setattr(kernels, "ROUTING_DEVICES", ("cuda", "cpu"))
    got = route(spec, logits, k, bias, torch.bfloat16)
    assert spy.calls == 1
    assert torch.equal(got.ids, ref.ids) and got.weights_on_input == ref.weights_on_input
    weights_close(got.weights, ref.weights)
    route(RoutingSpec(topk_first=True), logits, k)  # Llama 4's order: torch's, even where the kernel serves
    assert spy.calls == 1
    grouped = RoutingSpec(n_group=4, topk_group=2)
    ref = route(grouped, logits, k)
    assert spy.calls == 2  # grouped: fused where GROUPED_ROUTING_DEVICES puts it
    monkeypatch.setattr(kernels, "GROUPED_ROUTING_DEVICES", ())  # MOESERVE_FUSED_GROUPED_ROUTING=0: torch's
    got = route(grouped, logits, k)
    assert spy.calls == 2 and torch.equal(got.ids, ref.ids)
    weights_close(got.weights, ref.weights)


def test_moeserve_fused_routing_0_keeps_torchs_sequence(monkeypatch):
    monkeypatch.setenv("MOESERVE_FUSED_ROUTING", "0")
    assert kernels._routing_devices() == ()
    monkeypatch.setenv("MOESERVE_FUSED_ROUTING", "1")
    assert kernels._routing_devices() == ("cuda",)
    monkeypatch.delenv("MOESERVE_FUSED_ROUTING")
    assert kernels._routing_devices() == ("cuda",)
    monkeypatch.setenv("MOESERVE_FUSED_ROUTING", "yes")
    with pytest.raises(ValueError, match="MOESERVE_FUSED_ROUTING='yes'"):
        kernels._routing_devices()
    monkeypatch.setattr(kernels, "ROUTING_DEVICES", ())  # what =0 gives at import
    spy = _Spy(monkeypatch)
    route(CASES["qwen3"][0], distinct_logits(3, 128, torch.bfloat16, 1), 8)
    assert spy.calls == 0


def test_the_block_warm_up_runs_the_kernel_where_it_serves(monkeypatch):
    g = torch.Generator().manual_seed(0)
    spec = CASES["ernie"][0]
    block = MoEBlock(spec, 6, torch.randn(64, 32, generator=g), correction_bias=torch.zeros(64))
    grouped = MoEBlock(RoutingSpec(n_group=4, topk_group=2), 6, torch.randn(64, 32, generator=g).bfloat16())
    assert block.warm_up(torch.bfloat16) == 0  # CPU
    monkeypatch.setattr(kernels, "ROUTING_DEVICES", ("cuda", "cpu"))
    spy = _Spy(monkeypatch)
    assert block.warm_up(torch.bfloat16) == 1 and spy.calls == 1
    assert grouped.warm_up(torch.bfloat16) == 1 and spy.calls == 2  # the grouped selection switched on
    monkeypatch.setattr(kernels, "GROUPED_ROUTING_DEVICES", ())
    assert grouped.warm_up(torch.bfloat16) == 0 and spy.calls == 2


def test_moeserve_fused_grouped_routing_is_on_by_default_and_read_as_0_or_1(monkeypatch):
    monkeypatch.delenv("MOESERVE_FUSED_GROUPED_ROUTING", raising=False)
    assert kernels._grouped_routing_devices() == ("cuda",)
    monkeypatch.setenv("MOESERVE_FUSED_GROUPED_ROUTING", "0")
    assert kernels._grouped_routing_devices() == ()
    monkeypatch.setenv("MOESERVE_FUSED_GROUPED_ROUTING", "on")
    with pytest.raises(ValueError, match="MOESERVE_FUSED_GROUPED_ROUTING='on': allowed 1 .* or 0"):
        kernels._grouped_routing_devices()


def test_the_grouped_selection_keeps_the_best_groups_by_their_two_best():
    """A hand-made row of 4 groups of 3: the group with the single best expert is not among the
    2 kept when its second best is poor (its score is the sum of its two best), and no expert
    outside the kept groups is chosen even where its score beats theirs."""
    logits = torch.tensor([[5.0, -9.0, -9.0, 2.0, 2.1, 0.0, 1.9, 1.8, 1.7, -1.0, 3.0, 0.5]])
    # sigmoid scores' group scores (two best): g0 0.993 + 0.000 = 0.99, g1 0.891 + 0.881 = 1.77,
    # g2 0.870 + 0.858 = 1.73, g3 0.953 + 0.622 = 1.58
    ids, _ = kernels.fused_route(logits, 3, "sigmoid", None, True, None, 1.0, torch.float32, n_group=4, topk_group=2)
    assert ids.tolist() == [[4, 3, 6]]  # from g1 and g2 only: not expert 0 (5.0) nor 10 (3.0)
    ref = route(RoutingSpec(scoring="sigmoid", renormalize=True, n_group=4, topk_group=2), logits, 3)
    assert torch.equal(ids, ref.ids)


def test_the_gate_parts_sum_to_the_fp32_weight_exactly():
    """kernels.gate_parts: three bf16 parts whose fp32 sum (hi + mid) + lo is the weight bit for
    bit, at every scale a gate has and at awkward values (ties of a bf16 rounding, a carry into
    the next binade, signed zeros, tiny and large magnitudes); each part a bf16 value."""
    g = torch.Generator().manual_seed(3)
    w = torch.cat(
        [
            torch.randn(64, 256, generator=g) * scale
            for scale in (1e-6, 1e-3, 0.02, 1.0, 300.0)  # [5 * 64, 256]
        ]
    )
    edge = torch.tensor([1.0 + 2**-8, 1.0 - 2**-9, 1.99999988, -0.0, 0.0, 3.3e38, -1e-30, 2**-126, 255.96875])
    w[0, : edge.numel()] = edge
    p = kernels.gate_parts(w)
    assert p is not None
    assert p.dtype == torch.bfloat16 and p.shape == (3 * w.shape[0], w.shape[1]) and p.is_contiguous()
    hi, mid, lo = p.float().split(w.shape[0])
    assert torch.equal((hi + mid) + lo, w)
    assert torch.equal(hi, w.to(torch.bfloat16).float())  # the first part is the weight's bf16 rounding
    assert (lo.abs() <= mid.abs() * 2**-7).all() and (mid.abs() <= hi.abs() * 2**-7).all()
    for bad in (3.4e38, float("inf"), float("nan")):  # rounds to bf16's infinity, or is not finite
        w[1, 1] = bad
        assert kernels.gate_parts(w) is None


def test_split_gate_logits_route_as_the_fp32_gate(monkeypatch):
    """An fp32 gate of bf16 rows through the three parts (the GEMM emulated on CPU by exact
    products summed in fp32): the logits within fp32 rounding of F.linear(x.float(), W), the
    same ids as the fp32 gate chooses, and the fused kernel (PARTS 3, summing while it loads)
    bit-identical to routing the summed logits; a block with a gate bias, fp32 rows or the
    switch off keeps the fp32 GEMM."""
    import torch.nn.functional as F

    spec, e, k, _, _ = CASES["ernie"]
    g = torch.Generator().manual_seed(11)
    h, t = 96, 33
    weight = torch.randn(e, h, generator=g) * h**-0.5
    bias = bias_for(e, 4)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    monkeypatch.setattr(kernels, "GATE_SPLIT_DEVICES", ("cpu",))
    block = MoEBlock(spec, k, weight, correction_bias=bias)
    assert block.gate_parts is not None
    partial = kernels.gate_split_logits(x, block.gate_parts)
    assert partial.shape == (t, 3 * e) and partial.dtype == torch.float32
    ref_logits = F.linear(x.float(), weight)
    torch.testing.assert_close(kernels.sum_gate_parts(partial), ref_logits, rtol=0, atol=2e-6)
    got = block.route(x)  # CPU: the summed logits through torch's sequence
    ref = route(spec, ref_logits, k, bias, torch.bfloat16)
    assert torch.equal(got.ids, ref.ids)
    monkeypatch.setattr(kernels, "ROUTING_DEVICES", ("cuda", "cpu"))
    spy = _Spy(monkeypatch)
    fused = block.route(x)
    assert spy.calls == 1 and torch.equal(fused.ids, got.ids)
    summed = route(spec, kernels.sum_gate_parts(partial), k, bias, torch.bfloat16)  # the kernel, PARTS 1
    assert torch.equal(fused.ids, summed.ids) and torch.equal(fused.weights, summed.weights)
    assert block.warm_up(torch.bfloat16) == 1  # compiles the PARTS 3 kernel
    # where the split does not serve
    assert MoEBlock(spec, k, weight, gate_bias=torch.zeros(e), correction_bias=bias).gate_parts is None
    assert MoEBlock(RoutingSpec(renormalize=True), k, weight.bfloat16()).gate_parts is None  # a bf16 gate
    spy.calls = 0
    block.route(x.float())  # fp32 rows: the fp32 weight
    assert spy.calls == 1
    monkeypatch.setattr(kernels, "GATE_SPLIT_DEVICES", ())  # read at each call: the fp32 GEMM now
    spy.calls = 0
    real_mm = kernels.gate_split_logits
    monkeypatch.setattr(kernels, "gate_split_logits", lambda *a: pytest.fail("split with the switch off"))
    off = block.route(x)
    assert spy.calls == 1 and torch.equal(off.ids, ref.ids)
    monkeypatch.setattr(kernels, "gate_split_logits", real_mm)
    assert MoEBlock(spec, k, weight, correction_bias=bias).gate_parts is None
    assert not kernels.fused_route_takes(partial.bfloat16(), spec, k, kernels.GATE_PARTS)  # parts are fp32


def test_moeserve_gate_split_is_read_as_0_or_1(monkeypatch):
    monkeypatch.setenv("MOESERVE_GATE_SPLIT", "0")
    assert kernels._gate_split_devices() == ()
    monkeypatch.delenv("MOESERVE_GATE_SPLIT")
    assert kernels._gate_split_devices() == ("cuda",)
    monkeypatch.setenv("MOESERVE_GATE_SPLIT", "on")
    with pytest.raises(ValueError, match="MOESERVE_GATE_SPLIT='on': allowed 1 .* or 0"):
        kernels._gate_split_devices()
