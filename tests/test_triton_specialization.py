"""Each Triton kernel of the serving path compiles once per launch configuration the launcher
chooses, whatever the step's shape.

Triton compiles a kernel anew for each distinct specialization key: the constexpr values, and
for every other argument its type plus, unless the kernel says otherwise, a class of its value:
an integer equal to 1 becomes a constant, one divisible by 16 is marked so, and a tensor whose
address is 16-byte aligned is marked so. A compile costs ~0.5-3 s of host time on the H200
host, in the middle of the step that launched it. So an integer argument that follows the
step's shape (a sequence count, a block-table width) or a tensor that is a view at an offset
that follows it (a field of a packed per-step buffer) compiles the kernel again at unforeseen
steps, long after warm-up: with three integer classes and two address classes per argument,
hundreds of keys for the attention kernel.

Here the launchers run with Triton's JIT in place of its interpreter, but every launch is
recorded instead of compiled: the key is computed by Triton's own binder
(``create_function_from_signature``, the function ``JITFunction.run`` calls) from the real
arguments. The test: over a sweep of step shapes, the launches that share their constexprs and
options share their whole key. No GPU needed.
"""

import itertools
import math
import random
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch
from triton_util import needs_triton

pytestmark = [needs_triton, pytest.mark.timeout(300)]

MODULES = (
    "moeserve.kernels.triton_attention",
    "moeserve.kernels.triton_sampling",
    "moeserve.kernels.triton_experts",
    "moeserve.kernels.triton_exchange",
    "moeserve.kernels.triton_mla",
    "moeserve.kernels.triton_norms",
    "moeserve.kernels.triton_routing",
)


def _forget_kernels():
    """Drop every imported kernel module and the launchers' caches of them, so that the next
    import reads TRITON_INTERPRET again."""
    import moeserve.kernels as K
    import moeserve.models.attention as A
    import moeserve.models.mla as M
    import moeserve.sampling as S

    for name in MODULES:
        sys.modules.pop(name, None)
    A._kernels.cache_clear()
    M._kernels.cache_clear()
    S._kernel.cache_clear()
    K._kernels.cache_clear()
    K._expert_kernels.cache_clear()
    K._norm_kernels.cache_clear()
    K._routing_kernels.cache_clear()


@pytest.fixture
def launches(monkeypatch):
    """{kernel name: [(constexprs and options, full key)]} of every launch while the test runs."""
    import triton.experimental.gluon  # noqa: F401 - the binder imports it; it wraps triton.language's
    from triton.backends.compiler import BaseBackend  # functions, which are interpreted ones here
    from triton.runtime import jit

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _forget_kernels()
    seen: dict[str, list] = defaultdict(list)
    binders: dict = {}

    def run(self, *args, grid, warmup, **kwargs):
        if self not in binders:
            binders[self] = jit.create_function_from_signature(self.signature, self.params, BaseBackend)
        _, spec, options = binders[self](*args, **kwargs)
        config = tuple((p.name, s) for p, s in zip(self.params, spec) if p.is_constexpr)
        config += tuple(sorted(options.items()))
        spec = tuple((p.name, s) for p, s in zip(self.params, spec))  # an int == 1 is a constexpr here too
        seen[self.fn.__name__].append((config, spec))
        return None

    monkeypatch.setattr(jit.JITFunction, "run", run)
    yield seen
    monkeypatch.undo()
    _forget_kernels()


def assert_one_key_per_config(seen, kernel: str, configs: range):
    """Launches of ``kernel`` with the same constexprs and options have the same key (names the
    arguments whose specialization varied), and the launch configurations the launcher chose
    number within ``configs``: a constexpr that followed the step's shape would make more."""
    assert seen[kernel], f"{kernel} was never launched"
    by_config = defaultdict(set)
    for config, spec in seen[kernel]:
        by_config[config].add(spec)
    assert len(by_config) in configs, (
        f"{kernel}: {len(by_config)} launch configurations, want "
        f"{configs.start}..{configs.stop - 1}: {sorted(by_config)}"
    )
    compiles, classes = 0, defaultdict(set)
    for specs in by_config.values():
        compiles += len(specs)
        for a, b in itertools.combinations(specs, 2):
            for (n, x), (_, y) in zip(a, b):
                if x != y:
                    classes[n] |= {str(x), str(y)}
    if classes:
        pytest.fail(
            f"{kernel}: {compiles} compiles for {len(by_config)} launch configurations; the specialization "
            f"of {dict((n, sorted(c)) for n, c in sorted(classes.items()))} follows the step's shape"
        )


def _batch(lens, starts, block_size, extra_blocks=2):
    from moeserve.models.paged import PagedBatch

    need = [math.ceil((s + n) / block_size) for s, n in zip(starts, lens)]
    ids, tables = list(range(sum(need) + extra_blocks)), []
    for k in need:
        tables.append(ids[:k] + [0] * random.Random(k).randrange(3))  # tables of uneven widths
        ids = ids[k:]
    return PagedBatch.build(lens, starts, tables, block_size), sum(need) + extra_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_compiles_once_per_tile_shape_and_split(launches, dtype):
    from moeserve.models.attention import attention_config, paged_attention_triton

    rng = random.Random(0)
    hq, hkv, d, block_size = 8, 2, 64, 16
    shapes = []
    for s in list(range(1, 40)) + [63, 64, 65, 128, 255, 256]:
        decode = [1] * s, [rng.randrange(0, 700) for _ in range(s)]
        prefill = (
            [rng.randrange(1, 90) for _ in range(s)],
            [rng.choice([0, 0, rng.randrange(0, 300)]) for _ in range(s)],
        )
        mixed = [1] * (s - 1) + [rng.randrange(2, 200)], [rng.randrange(0, 400) for _ in range(s)]
        shapes += [decode, prefill, mixed]
    for lens, starts in shapes:
        batch, blocks = _batch(lens, starts, block_size)
        q = torch.empty(batch.num_tokens, hq, d, dtype=dtype)
        pool = torch.empty(blocks * block_size, hkv, d, dtype=dtype)
        for ns in {None, attention_config(batch, hq, hkv, d, 132)["NS"]}:
            paged_attention_triton(q, pool, pool, batch, scale=d**-0.5, chunk=None, num_segments=ns)
    # decode or prefill tiles x the split (1, 2, 4, 8 or 16 segments)
    assert_one_key_per_config(launches, "paged_attention_kernel", range(3, 11))
    assert_one_key_per_config(launches, "paged_attention_reduce_kernel", range(1, 5))


def test_the_race_compiles_once_per_vocabulary_and_filter_whatever_the_batch(launches):
    import moeserve.sampling as sm
    from moeserve.sampling import SamplingParams, SamplingTensors

    v = 202_048
    for b in list(range(1, 300, 3)) + [1, 2, 16, 32, 64, 4096 // 1024]:
        st = SamplingTensors.build([SamplingParams(temperature=0.7, seed=1)] * b, list(range(b)), [5] * b, "cpu")
        logits = torch.empty(b, v)
        sm._race_triton(logits, st, None)
        sm._race_triton(logits, st, torch.empty(b))
    assert_one_key_per_config(launches, "race_kernel", range(2, 3))  # with and without a threshold


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_expert_kernels_compile_once_per_block_m(launches, dtype):
    from moeserve import kernels as K

    h, i, s = 128, 64, 6
    gate_up = torch.empty(s, h, 2 * i, dtype=dtype)
    down = torch.empty(s, i, h, dtype=dtype)
    buf = torch.empty(4096, h, dtype=dtype)
    for c in list(range(1, 300, 7)) + [512, 1024, 2048]:
        offs = torch.linspace(0, c, s + 1)[1:].round().to(torch.int32)
        K.expert_mlp(buf[:c], gate_up, down, offs, K.expert_block_m(c // s))
    assert_one_key_per_config(launches, "expert_matmul_kernel", range(6, 7))  # block_m 16, 32, 64 x two projections


def test_the_exchange_helpers_compile_once_whatever_the_row_count(launches):
    from moeserve import kernels as K

    for t in list(range(1, 300, 5)) + [512, 1024]:
        K.weighted_sum(torch.empty(t * 2, 96), torch.empty(t, 2))
        K.silu_mul(torch.empty(t, 2 * 48), torch.tensor([t], dtype=torch.int32))
        K.silu_mul(torch.empty(t, 2 * 48), torch.zeros(t % 13 + 1, dtype=torch.int32)[-1:])  # a slot table's last
        K.silu_mul(torch.empty(t, 2 * 48))  # every row (an MLP's)
    assert_one_key_per_config(launches, "weighted_sum_kernel", range(1, 2))
    assert_one_key_per_config(launches, "silu_mul_kernel", range(2, 3))  # with and without a device total


def test_the_norm_kernels_compile_once_whatever_the_row_count(launches):
    from moeserve import kernels as K

    for t in list(range(1, 300, 7)) + [512, 2048]:
        x = torch.empty(t, 200, dtype=torch.bfloat16)
        K.rms_norm(x, torch.empty(200, dtype=torch.bfloat16), 1e-6)
        K.rms_norm(x, torch.empty(200, dtype=torch.bfloat16), 1e-6, residual=torch.empty_like(x))
        K.rms_norm(x[1:], None, 1e-6)  # a view at an odd offset: copied to the one alignment
        cos = torch.empty(t, 32)
        for heads in (8, 2, 1):
            K.head_rope(torch.empty(t, heads, 64, dtype=torch.bfloat16), cos, cos, False, 1e-6, cos[0].bfloat16())
    assert_one_key_per_config(launches, "rms_norm_kernel", range(3, 4))  # weighted, with a residual, weightless
    assert_one_key_per_config(launches, "head_rope_kernel", range(1, 2))  # q and k of any head count alike


@pytest.mark.parametrize("family", ["llama4", "qwen3_moe", "gpt_oss"])
def test_the_norm_warm_up_compiles_every_key_a_step_can_launch(launches, family, tmp_path, monkeypatch):
    """A router runs ``DecoderModel.warm_up_norms`` at start; forward steps of any length then
    launch no key of the norm kernels that the warm-up did not compile."""
    import hf_oracle as hf

    from moeserve import kernels as K
    from moeserve.models import load_model

    build = {"llama4": hf.build_llama4, "qwen3_moe": hf.build_qwen3_moe, "gpt_oss": hf.build_gpt_oss}[family]
    model = load_model(hf.save(build(seed=1), tmp_path), dtype=torch.bfloat16)
    monkeypatch.setattr(K, "NORM_DEVICES", ("cuda", "cpu"))
    assert model.warm_up_norms() > 0
    names = ("rms_norm_kernel", "head_rope_kernel", "silu_mul_kernel")
    warm = {k: _keys(launches, k) for k in names}
    launches.clear()
    for t in (1, 5, 33):
        model(torch.zeros(1, t, dtype=torch.long))  # the kernels are not run here: only their keys matter
    for k, keys in warm.items():
        seen = _keys(launches, k)
        # silu_mul: the shared experts' (Llama 4); Qwen3-MoE and GPT-OSS have none and no dense layer
        assert seen or (k == "silu_mul_kernel" and family != "llama4"), f"{k} was never launched by a step"
        assert seen <= keys, (k, sorted(seen - keys))


def test_the_norm_warm_up_compiles_the_fused_activation_quantizer_of_w8a8_mlps(launches, tmp_path, monkeypatch):
    """With FP8 shared experts whose down projection runs cuBLAS's FP8 GEMM (W8A8, the default
    of ``--quantization fp8`` in bf16), a step quantizes silu * up in the activation's launch
    (``silu_mul_quant``): the warm-up compiles its keys, and steps of any length find them."""
    import hf_oracle as hf

    from moeserve import kernels as K
    from moeserve.models import load_model
    from moeserve.models import quant as Q

    model = load_model(hf.save(hf.build_llama4(seed=1), tmp_path), dtype=torch.bfloat16, quantization="fp8")
    monkeypatch.setattr(K, "NORM_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(  # the GPU's choice of cuBLAS's FP8 GEMM on CPU tensors (the CUDA check dropped)
        Q.QuantLinear,
        "takes_codes",
        lambda self, x: x.dim() == 2 and x.shape[0] > 0 and self.act_quant and self._scaled_mm_ok(x),
    )
    assert model.warm_up_norms() > 0
    warm = _keys(launches, "silu_mul_quant_kernel")
    assert warm, "the warm-up compiled no silu_mul_quant"
    launches.clear()
    for t in (1, 5, 33):
        model(torch.zeros(1, t, dtype=torch.long))  # the kernels are not run here: only their keys matter
    seen = _keys(launches, "silu_mul_quant_kernel")
    assert seen and seen <= warm, sorted(seen - warm)
    assert not launches["silu_mul_kernel"]  # every merged W8A8 MLP took the fused path


ROUTINGS = [  # (spec, E, K, gate dtype): ERNIE, Qwen3, Mixtral, DeepSeek-V3 without groups
    (dict(gate_fp32=True, correction_bias=True, renormalize=True, renorm_min=1e-12), 64, 6, torch.float32),
    (dict(renormalize=True), 128, 8, torch.bfloat16),
    (dict(renormalize=True), 8, 2, torch.bfloat16),
    (dict(scoring="sigmoid", gate_fp32=True, correction_bias=True, renormalize=True, scaling_factor=2.5), 256, 8,
     torch.float32),
    (dict(scoring="sigmoid", gate_fp32=True, correction_bias=True, renormalize=True, scaling_factor=2.5, n_group=8,
          topk_group=4), 256, 8, torch.float32),  # DeepSeek-V3's groups (fused by default)
]  # fmt: skip


def test_the_routing_kernel_compiles_once_per_routing_whatever_the_token_count(launches, monkeypatch):
    from moeserve import kernels as K
    from moeserve.models.config import RoutingSpec
    from moeserve.models.routing import route

    monkeypatch.setattr(K, "ROUTING_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(K, "GROUPED_ROUTING_DEVICES", ("cuda", "cpu"))
    for kw, e, k, dtype in ROUTINGS:
        spec = RoutingSpec(**kw)
        bias = torch.empty(e) if spec.correction_bias else None
        buf = torch.empty(4096, e, dtype=dtype)
        for t in list(range(1, 300, 7)) + [512, 2048]:
            route(spec, torch.empty(t, e, dtype=dtype), k, bias, torch.bfloat16)
            route(spec, buf[:t], k, bias, torch.bfloat16)  # a view of a larger buffer
    assert_one_key_per_config(launches, "fused_route_kernel", range(len(ROUTINGS), len(ROUTINGS) + 1))


@pytest.mark.parametrize("family", ["ernie", "qwen3_moe", "deepseek_v3"])
def test_the_routing_warm_up_compiles_every_key_a_step_can_launch(launches, family, tmp_path, monkeypatch):
    """A router runs ``MoEBlock.warm_up`` for each MoE layer at start (``cluster.rank._warm_up_kernels``);
    the routing of steps of any length then launches no key of the routing kernel it did not compile."""
    import hf_oracle as hf

    from moeserve import kernels as K
    from moeserve.models import load_model

    build = {"ernie": hf.build_ernie, "qwen3_moe": hf.build_qwen3_moe, "deepseek_v3": hf.build_deepseek_v3}[family]
    model = load_model(hf.save(build(seed=1), tmp_path), dtype=torch.bfloat16)
    monkeypatch.setattr(K, "ROUTING_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(K, "GROUPED_ROUTING_DEVICES", ("cuda", "cpu"))  # DeepSeek-V3's groups, switched on
    assert sum(block.warm_up(torch.bfloat16) for block in model.moe_blocks) == len(model.moe_blocks) > 0
    warm = _keys(launches, "fused_route_kernel")
    launches.clear()
    h = model.config.hidden_size
    for t in (1, 5, 33, 300):  # what a step's MoE layers launch (not run here: the ids would be garbage)
        for block in model.moe_blocks:
            block.route(torch.zeros(t, h, dtype=torch.bfloat16))
    seen = _keys(launches, "fused_route_kernel")
    assert seen, "fused_route_kernel was never launched by a step"
    assert seen <= warm, sorted(seen - warm)


def _keys(seen, kernel):
    return {spec for _, spec in seen[kernel]}


@pytest.mark.parametrize("fp8", [False, True, "a8"], ids=["bf16", "fp8", "fp8-w8a8"])
@pytest.mark.parametrize("slots", [4, 16])
def test_the_expert_warm_up_compiles_every_key_a_step_can_launch(launches, slots, fp8, monkeypatch):
    """A worker compiles the expert kernels at start (``ExpertStore.warm_up_kernels``) on layer
    0's views of its slot buffer; whatever a step's pairs, its launches find their key there.
    FP8 experts (codes and scales in one byte row per slot) take the kernels at every size; with
    FP8 activations (W8A8) the row quantizer's keys are compiled too."""
    from moeserve import kernels as K
    from moeserve.expert_worker import store as store_mod
    from moeserve.expert_worker.store import expert_block_m_for
    from moeserve.models.moe import ExpertQuant, ExpertSpec

    quant = ExpertQuant((16, 16), (16, 16)) if fp8 else None
    spec = ExpertSpec(hidden_size=96, intermediate_size=40, dtype=torch.bfloat16, quant=quant)
    layers = [spec.views(torch.empty(slots, spec.numel, dtype=spec.storage_dtype)) for _ in range(3)]

    def scales(w):
        if not fp8:
            return None
        return K.ExpertScales(w["gate_up_scale"], (16, 16), w["down_scale"], (16, 16), act_quant=fp8 == "a8")

    # W8A8 with MOESERVE_FP8_PREFILL_BLOCK_M=128: prefill steps take their own passes, warmed too
    prefill = fp8 == "a8"
    monkeypatch.setattr(store_mod, "fp8_prefill_block_m", lambda: K.FP8_PREFILL_BM if prefill else K.EXPERT_MAX_BM)
    block_ms = K.expert_block_ms(prefill=prefill)
    blocks = K.warm_up_expert_mlp(
        layers[0]["gate_up"], layers[0]["down"], scales(layers[0]), spec.dtype, None, block_ms
    )
    assert blocks == [16, 32, 64] + ([K.FP8_PREFILL_BM] if prefill else [])
    warm = _keys(launches, "expert_matmul_kernel")
    warm_q = _keys(launches, "quant_rows_kernel")
    assert bool(warm_q) == (fp8 == "a8")
    launches.clear()
    recv = torch.empty(8192, spec.hidden_size, dtype=spec.dtype)  # the receive buffer
    seen_bms = set()
    offs = torch.empty(slots, dtype=torch.int32)
    for pairs in [1, 7, 16, 100, slots * 16, slots * 33, slots * 64, slots * 500]:
        mode = "triton" if fp8 else "auto"
        bm = expert_block_m_for(pairs, slots, mode, bool(fp8), prefill) or (K.EXPERT_MAX_BM if fp8 else 0)
        seen_bms.add(bm)
        if bm:
            for w in layers:
                K.expert_mlp(recv, w["gate_up"], w["down"], offs, bm, scales(w))
    assert {cfg for cfg, _ in launches["expert_matmul_kernel"]} and _keys(launches, "expert_matmul_kernel") <= warm
    assert _keys(launches, "quant_rows_kernel") <= warm_q
    assert (K.FP8_PREFILL_BM in seen_bms) == prefill  # the sweep reached the prefill passes


def test_the_fp8_linear_compiles_once_per_block_m_whatever_the_rows(launches):
    """A quantized shared expert or dense layer (``QuantLinear`` on CUDA) at any decode batch:
    one compile per rows-per-pass class and weight shape."""
    from moeserve import kernels as K

    codes = torch.empty(96, 80, dtype=torch.float8_e4m3fn)
    scale = torch.empty(6, 5)
    for m in [1, 2, 3, 15, 16, 17, 31, 40, 63, 64, 65, 200, 511]:
        K.fp8_linear(torch.empty(m, 96, dtype=torch.bfloat16), codes, scale, (16, 16))
    by_config = defaultdict(set)
    for config, spec in launches["expert_matmul_kernel"]:
        by_config[config].add(spec)
    assert len(by_config) == 3 and all(len(v) == 1 for v in by_config.values())


def test_the_race_warm_up_compiles_every_key_a_step_can_launch(launches):
    """A router compiles the race at start (``sampling.warm_up``); batches of any size and mix
    of sampling parameters then find their key there."""
    import moeserve.sampling as sm
    from moeserve.sampling import SamplingParams, SamplingTensors

    v = 50_000
    assert sm._warm_up_race(v, torch.device("cpu")) == 2
    warm = _keys(launches, "race_kernel")
    launches.clear()
    mix = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.2, top_p=0.9, seed=2),
        SamplingParams(temperature=0.7, top_k=40, seed=3),
        SamplingParams(temperature=0.0),
    ]
    for b in [1, 2, 3, 16, 17, 64, 255, 256]:
        for k in (1, 2, 4):
            params = [mix[(i * k) % len(mix)] for i in range(b)]
            if all(p.greedy for p in params):
                continue
            st = SamplingTensors.build(params, list(range(b)), [3] * b, "cpu")
            sm.sample(torch.randn(b, v), st, backend="triton")
    assert len({cfg for cfg, _ in launches["race_kernel"]}) == 2
    assert _keys(launches, "race_kernel") <= warm


SINKS = torch.zeros(40, dtype=torch.bfloat16)  # [Hq], a GPT-OSS layer's
ATTENTION_KINDS = {
    "global": [(None, None, None)],
    "global+chunked": [(None, None, None), (8192, None, None)],
    "sliding+full, sinks": [(None, 128, SINKS), (None, None, SINKS)],
}


def test_the_attention_warm_up_launches_the_sdpa_prefill_backend_where_it_serves(launches, monkeypatch):
    """With ``MOESERVE_ATTENTION_PREFILL=sdpa`` the warm-up also runs ``sdpa_prompts`` at every
    bucket up to the longest fresh prompt (cuDNN builds a plan per length), once for all the
    kinds of layer it serves; a model whose every layer declines it (a window the warm-up
    prompt exceeds, sinks) launches none."""
    from moeserve.models import attention as attn
    from moeserve.models import paged

    calls: list = []
    real = attn.sdpa_prompts
    monkeypatch.setitem(attn.PREFILL, "backend", "sdpa")
    monkeypatch.setitem(paged.SPLIT_FRESH, "on", True)
    monkeypatch.setattr(attn, "sdpa_prompts", lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    hq, hkv, d, block_size = 40, 8, 128, 16
    pools = torch.empty(2, 4096 * block_size, hkv, d, dtype=torch.bfloat16)
    kinds = [(None, None, None), (8192, None, None), (None, 8, None), (None, None, SINKS)]
    buckets = attn.sdpa_buckets(640)
    # per kind: the decode tile at 5 splits, the prefill tile at 5 splits (short queries) and unsplit
    assert attn.warm_up_attention(pools[0], pools[1], hq, block_size, kinds, d**-0.5, 640) == 11 * len(kinds) + len(
        buckets
    )
    assert calls == buckets
    calls.clear()
    declined = [(None, 8, None), (None, None, SINKS)]
    assert attn.warm_up_attention(pools[0], pools[1], hq, block_size, declined, d**-0.5, 640) == 11 * 2
    assert calls == []


@pytest.mark.parametrize("kinds", ATTENTION_KINDS.values(), ids=ATTENTION_KINDS.keys())
def test_the_attention_warm_up_compiles_every_key_a_step_can_launch(launches, kinds):
    """A router compiles the paged attention at start (``models.attention.warm_up_attention`` on
    one layer's pool views, with each kind of layer's chunk, window and sinks): decode, prefill
    and mixed steps of any shape, at every split, then find their key among the warm-up's."""
    from moeserve.models.attention import attention_config, paged_attention_triton, warm_up_attention

    hq, hkv, d, block_size = 40, 8, 128, 16
    pools = torch.empty(2, 4096 * block_size, hkv, d, dtype=torch.bfloat16)  # [layers, slots, Hkv, D]
    k_pool, v_pool = pools[0], pools[1]
    assert warm_up_attention(k_pool, v_pool, hq, block_size, kinds * 2, d**-0.5) == 11 * len(kinds)
    warm = _keys(launches, "paged_attention_kernel") | _keys(launches, "paged_attention_reduce_kernel")
    launches.clear()
    rng = random.Random(1)
    for s in [1, 2, 3, 7, 16, 17, 64, 65, 200, 256]:
        for lens, starts in (
            ([1] * s, [rng.randrange(0, 9000) for _ in range(s)]),
            ([rng.randrange(1, 300) for _ in range(s)], [rng.choice([0, rng.randrange(0, 3000)]) for _ in range(s)]),
            ([1] * (s - 1) + [rng.randrange(2, 900)], [rng.randrange(0, 5000) for _ in range(s)]),
            # decodes and a prompt's last few tokens (4-12: the prefill tile, one per sequence) over
            # long contexts: few sequences split their keys (an H100's auto-prefill burst compiled this)
            ([1] * (s - 1) + [rng.randrange(4, 13)], [rng.randrange(2000, 5000) for _ in range(s)]),
        ):
            batch, _ = _batch(lens, starts, block_size)
            q = torch.empty(batch.num_tokens, hq, d, dtype=torch.bfloat16)
            for chunk, window, sinks in kinds:
                ns = attention_config(batch, hq, hkv, d, 132)["NS"]
                paged_attention_triton(
                    q, k_pool, v_pool, batch, scale=d**-0.5, chunk=chunk, window=window, sinks=sinks, num_segments=ns
                )
    seen = _keys(launches, "paged_attention_kernel") | _keys(launches, "paged_attention_reduce_kernel")
    assert launches["paged_attention_kernel"] and seen <= warm, sorted(seen - warm)


def test_with_the_sdpa_split_the_attention_warm_up_still_compiles_every_key(launches, monkeypatch):
    """With ``MOESERVE_ATTENTION_PREFILL=sdpa`` (or ``auto`` on CUDA) a step's trailing fresh
    prompts go to SDPA and the paged kernel runs over the sequences before them
    (``FreshSuffix.head``, views of the step's tensors): those launches too find their key
    among the warm-up's (an H100 prefill burst compiled the kernel twice while serving, 1.4 s
    each, before the warm-up launched the split)."""
    from moeserve.models import attention as attn
    from moeserve.models import paged

    monkeypatch.setitem(attn.PREFILL, "backend", "sdpa")
    monkeypatch.setitem(paged.SPLIT_FRESH, "on", True)
    monkeypatch.setattr(attn, "sdpa_prompts", lambda q, k, v, lens, *, scale, out=None: out)
    monkeypatch.setattr(attn, "_num_sms", lambda device: 132)  # split the keys as on an H100
    hq, hkv, d, block_size = 40, 8, 128, 16
    pools = torch.empty(2, 4096 * block_size, hkv, d, dtype=torch.bfloat16)
    k_pool, v_pool = pools[0], pools[1]
    kinds = [(None, None, None), (8192, None, None)]
    attn.warm_up_attention(k_pool, v_pool, hq, block_size, kinds, d**-0.5, 4096)
    warm = _keys(launches, "paged_attention_kernel") | _keys(launches, "paged_attention_reduce_kernel")
    launches.clear()
    rng = random.Random(3)
    split = 0
    for s in [1, 2, 3, 7, 16, 17, 64, 65, 200]:
        for lens, starts in (
            # decodes, then fresh prompts
            ([1] * s + [rng.randrange(2, 2000) for _ in range(2)], [rng.randrange(1, 5000) for _ in range(s)] + [0, 0]),
            # a continuing chunk, then a fresh prompt
            (
                [rng.randrange(2, 2000) for _ in range(s)] + [rng.randrange(1, 2000)],
                [rng.randrange(1, 3000) for _ in range(s)] + [0],
            ),
            # a few decodes and a prompt's last tokens over long contexts, then a fresh prompt:
            # the head's keys split (NS > 1) with the prefill tile
            (
                [1] * s + [rng.randrange(4, 13), rng.randrange(2, 2000)],
                [rng.randrange(2000, 5000) for _ in range(s + 1)] + [0],
            ),
        ):
            batch, _ = _batch(lens, starts, block_size)
            split += batch.fresh is not None and batch.fresh.head is not None
            q = torch.empty(batch.num_tokens, hq, d, dtype=torch.bfloat16)
            kv = torch.empty(batch.num_tokens, hkv, d, dtype=torch.bfloat16)
            for chunk, window, sinks in kinds:
                attn.paged_attention_triton(
                    q, k_pool, v_pool, batch, scale=d**-0.5, chunk=chunk, window=window, sinks=sinks, k_new=kv, v_new=kv
                )
    assert split > 10
    split_prefill_tiles = {
        dict(cfg)["NS"] for cfg, _ in launches["paged_attention_kernel"] if dict(cfg)["BM"] == ("constexpr", 64)
    }
    assert split_prefill_tiles - {("constexpr", 1)}  # the heads' short queries did split their keys
    seen = _keys(launches, "paged_attention_kernel") | _keys(launches, "paged_attention_reduce_kernel")
    assert launches["paged_attention_kernel"] and seen <= warm, sorted(seen - warm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mla_warm_up_compiles_every_key_a_step_can_launch(launches, dtype):
    """A DeepSeek-V3 router compiles the absorbed MLA kernel at start (``models.mla.warm_up_mla``
    on layer 0's latent pool): decode, prefill and mixed steps of any shape, on any layer's
    pool, then find its one key."""
    from moeserve.models.config import MLAConfig
    from moeserve.models.mla import mla_decode_triton, warm_up_mla

    hq, r, dr, block_size = 16, 128, 32, 16
    mla = MLAConfig(
        q_lora_rank=64, kv_lora_rank=r, qk_nope_head_dim=32, qk_rope_head_dim=dr, v_head_dim=32, softmax_scale=0.1
    )
    pools = torch.empty(3, 4096 * block_size, 1, r + dr, dtype=dtype)  # [layers, slots, 1, C]
    assert warm_up_mla(pools[0], hq, mla, block_size, 0.1) == 1
    warm = _keys(launches, "mla_decode_kernel")
    launches.clear()
    rng = random.Random(2)
    for s in [1, 2, 3, 7, 16, 17, 64, 65, 200]:
        for lens, starts in (
            ([1] * s, [rng.randrange(0, 9000) for _ in range(s)]),
            ([rng.randrange(1, 300) for _ in range(s)], [rng.choice([0, rng.randrange(0, 3000)]) for _ in range(s)]),
            ([1] * (s - 1) + [rng.randrange(2, 900)], [rng.randrange(0, 5000) for _ in range(s)]),
        ):
            batch, _ = _batch(lens, starts, block_size)
            q_c = torch.empty(batch.num_tokens, hq, r, dtype=dtype)
            q_pe = torch.empty(batch.num_tokens, hq, dr, dtype=dtype)
            mla_decode_triton(q_c, q_pe, pools[1 + s % 2], batch, scale=0.1, kv_lora_rank=r)
    seen = _keys(launches, "mla_decode_kernel")
    assert launches["mla_decode_kernel"] and seen <= warm, sorted(seen - warm)


def _exchange_stand_in(graphs: bool, rank: int = 1):
    """What NvlinkExchange.warm_up_kernels reads of its exchange, without symmetric memory: rank
    1 of 2 co-located ranks, 20 slots, top-4, hidden 64 in bf16."""
    from types import SimpleNamespace

    from moeserve.dataplane.exchange import Topology

    topo = Topology.build(2, 2, True, 20)
    return SimpleNamespace(
        device=torch.device("cpu"),
        topo=topo,
        rank=rank,
        router=topo.router_index(rank),
        worker=topo.worker_index(rank),
        worker_base=topo.worker_ranks[0],
        hidden_size=64,
        dtype=torch.bfloat16,
        pair_capacity=512 * 4,
        top_k=4,
        graphs=graphs,
        shift=torch.zeros(20, dtype=torch.long),
        offs=torch.zeros(10, dtype=torch.int32),
    )


EXCHANGE_KERNELS = ("expert_count_kernel", "route_kernel", "publish_kernel", "prep_kernel")
EXCHANGE_KERNELS += ("scatter_pairs_kernel", "return_rows_kernel")


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_the_exchange_warm_up_compiles_every_key_a_step_can_launch(launches, graphs):
    """A rank of the direct exchange compiles its kernels at start on scratch buffers
    (``NvlinkExchange.warm_up_kernels``, N = 0 pairs); the launches of serving steps then find
    their key there: eager steps' own argument row or a whole-step graph's row of any MoE layer,
    every layer's rows of the placement tables and of the load counters, any placement (one
    replica or several, with break-even counts or none), inputs scaled or not."""
    from moeserve import kernels as K
    from moeserve.dataplane.nvlink import NvlinkExchange
    from moeserve.router.dispatcher import RouterMaps

    ex = _exchange_stand_in(graphs)
    layers, e, p = 5, 16, ex.topo.num_slots
    rng = np.random.default_rng(0)
    phy2log = np.stack([np.concatenate([np.arange(e), rng.integers(0, e, p - e)]) for _ in range(layers)])
    breakeven = np.where(rng.random((layers, e)) < 0.5, 0, 8)
    maps = RouterMaps(phy2log, e, 3, breakeven=breakeven)
    assert NvlinkExchange.warm_up_kernels(ex, maps, layers) > 0
    warm = {k: _keys(launches, k) for k in EXCHANGE_KERNELS}
    launches.clear()
    r = ex.topo.world_size
    counts = torch.zeros(r, p, dtype=torch.long)
    rows = torch.zeros(r * ex.pair_capacity, ex.hidden_size, dtype=torch.bfloat16)
    meta = torch.zeros(r * ex.pair_capacity, dtype=torch.long)
    out = torch.zeros(ex.pair_capacity, ex.hidden_size, dtype=torch.bfloat16)

    def table(t):
        return torch.full((r,), t.data_ptr(), dtype=torch.long)

    step_args = torch.zeros(layers, 5, dtype=torch.long)  # a whole-step graph's rows: 40 bytes apart
    sent_rows = torch.zeros(layers, r * ex.topo.slots_per_worker + 3, dtype=torch.long)
    for tokens in (1, 7, 64, 300):
        x = torch.zeros(tokens, ex.hidden_size, dtype=torch.bfloat16)
        ids = torch.from_numpy(rng.integers(0, e, (tokens, ex.top_k)))
        w = torch.zeros(tokens * ex.top_k, dtype=torch.bfloat16)
        for layer in range(layers):
            for scaled in (False, True):
                host = K.pair_args(x, ids, w if scaled else None, tokens * ex.top_k, layer)
                args = step_args[layer] if graphs else host.clone()
                args.copy_(host)
                single = bool(maps.single[layer]) and not graphs
                slots, hist = K.route(
                    args,
                    maps.log2phy[layer],
                    maps.logcnt[layer],
                    p,
                    single,
                    ex.top_k,
                    ex.pair_capacity,
                    maps.route_breakeven(layer, always=graphs),
                    ex.router,
                    ex.topo.num_routers,
                )
                prefix = torch.empty_like(hist)
                sent = sent_rows[layer, layer % 3 : layer % 3 + p]
                K.publish(args, hist, prefix, table(counts), ex.rank, sent, p)
                K.prep(counts, ex.rank, ex.worker, ex.topo.num_workers, ex.shift, ex.offs)
                K.scatter_pairs(
                    args, ex.dtype, ex.hidden_size, ex.top_k, scaled, slots, prefix, ex.shift,
                    ex.topo.slots_per_worker, ex.worker_base, table(rows), table(meta), ex.rank * ex.pair_capacity,
                )  # fmt: skip
                K.return_rows(rows, meta, ex.offs[-1:], table(out), ex.pair_capacity)
    for k in EXCHANGE_KERNELS:
        seen = _keys(launches, k)
        if k != "expert_count_kernel" or graphs:
            assert seen, f"{k} was never launched"
        assert seen <= warm[k], (k, sorted(seen - warm[k]))


# Every kernel of the serving path and what compiles it before the server is ready. A kernel
# added to moeserve/kernels/ joins this table (and gets a test above that its warm-up covers every
# key a step can launch), or the next test fails. None: not compiled before ready yet, and why.
WARMED = {
    "paged_attention_kernel": "router: models.attention.warm_up_attention",
    "paged_attention_reduce_kernel": "router: models.attention.warm_up_attention",
    "race_kernel": "router: sampling.warm_up",
    "mla_decode_kernel": "router: models.mla.warm_up_mla",
    "expert_matmul_kernel": "worker: ExpertStore.warm_up_kernels; router: kernels.warm_up_fp8_linears",
    "quant_rows_kernel": "worker: ExpertStore.warm_up_kernels; router: kernels.warm_up_fp8_linears",  # W8A8 rows
    # torch._grouped_mm's activation (prefills); the dense MLPs' and shared experts'
    "silu_mul_kernel": "worker: ExpertStore.warm_up_kernels; router: DecoderModel.warm_up_norms",
    "silu_mul_quant_kernel": "router: DecoderModel.warm_up_norms",  # W8A8 MLPs' down projection input
    "weighted_sum_kernel": "router: cluster.rank._warm_up_kernels",  # the combine over k of weighed outputs
    "expert_count_kernel": "any rank: NvlinkExchange.warm_up_kernels",  # the direct exchange's kernels
    "route_kernel": "any rank: NvlinkExchange.warm_up_kernels",
    "publish_kernel": "any rank: NvlinkExchange.warm_up_kernels",
    "prep_kernel": "any rank: NvlinkExchange.warm_up_kernels",
    "scatter_pairs_kernel": "any rank: NvlinkExchange.warm_up_kernels",
    "return_rows_kernel": "any rank: NvlinkExchange.warm_up_kernels",
    "rms_norm_kernel": "router: DecoderModel.warm_up_norms (cluster.rank._warm_up_kernels)",  # norms + residual
    "head_rope_kernel": "router: DecoderModel.warm_up_norms (cluster.rank._warm_up_kernels)",  # qk norm + RoPE
    "fused_route_kernel": "router: MoEBlock.warm_up per MoE layer (cluster.rank._warm_up_kernels)",  # the routing
}


def test_every_serving_kernel_is_in_the_warm_up_table():
    import importlib

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    kinds = (JITFunction, InterpretedFunction)  # compiled, or run by the interpreter (these tests)
    found = set()
    for name in MODULES:
        module = importlib.import_module(name)
        found |= {n for n, f in vars(module).items() if isinstance(f, kinds) and n.endswith("_kernel")}
    assert found == set(WARMED), (
        f"kernels without a warm-up entry: {sorted(found - set(WARMED))}; stale: {sorted(set(WARMED) - found)}"
    )


def test_the_steps_of_a_prefill_burst_under_the_sdpa_split_find_the_warm_ups_keys(launches, monkeypatch):
    """A burst of 2,048-token prompts as the scheduler runs it with the split: 1-256 decodes,
    a prompt continuing its chunk, then 1-4 fresh prompts (the last one cut by the token budget);
    the paged kernel's launches over the head all find their key among the warm-up's."""
    from moeserve.models import attention as attn
    from moeserve.models import paged

    monkeypatch.setitem(attn.PREFILL, "backend", "sdpa")
    monkeypatch.setitem(paged.SPLIT_FRESH, "on", True)
    monkeypatch.setattr(attn, "sdpa_prompts", lambda q, k, v, lens, *, scale, out=None: out)
    hq, hkv, d, block_size = 40, 8, 128, 16
    pools = torch.empty(2, 4096 * block_size, hkv, d, dtype=torch.bfloat16)
    kinds = [(None, None, None), (8192, None, None)]
    attn.warm_up_attention(pools[0], pools[1], hq, block_size, kinds, d**-0.5, 4096)
    names = ("paged_attention_kernel", "paged_attention_reduce_kernel")
    warm = set().union(*(_keys(launches, n) for n in names))
    launches.clear()
    rng = random.Random(5)
    for s in range(1, 257, 3):
        for fresh in (1, 3, 4):
            c = rng.randrange(1, 2048)
            lens = [1] * s + [c] + [2048] * (fresh - 1) + [rng.randrange(1, 2048)]
            starts = [rng.randrange(2048, 2340) for _ in range(s)] + [2048 - c] + [0] * fresh
            batch, _ = _batch(lens, starts, block_size)
            assert batch.fresh is not None and batch.fresh.head is not None
            q = torch.empty(batch.num_tokens, hq, d, dtype=torch.bfloat16)
            kv = torch.empty(batch.num_tokens, hkv, d, dtype=torch.bfloat16)
            for chunk, window, sinks in kinds:
                attn.paged_attention_triton(
                    q,
                    pools[0],
                    pools[1],
                    batch,
                    scale=d**-0.5,
                    chunk=chunk,
                    window=window,
                    sinks=sinks,
                    k_new=kv,
                    v_new=kv,
                )
    seen = set().union(*(_keys(launches, n) for n in names))
    assert launches["paged_attention_kernel"] and seen <= warm, sorted(seen - warm)
