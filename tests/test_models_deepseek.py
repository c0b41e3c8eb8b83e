"""DeepSeek-V3 (and Kimi K2's spelling) equals transformers on checkpoints transformers itself
built and saved: MLA with q and kv LoRA, a decoupled RoPE key and YaRN with its softmax-scale
correction, a dense first layer, sigmoid routing with a correction bias in 4 groups of which 2
are picked, renormalised weights times the routed scaling factor, one shared expert. Logits
within 1e-4, greedy token-identical; the latent paged cache (absorbed decode, expanded prefill,
the Triton kernel under the interpreter) equals the eager oracle; the pool holds the latent.

Dimension letters as in moeserve/models/mla.py: T tokens, Hq heads, R kv_lora_rank, Dr / Dn / Dv
the RoPE, no-RoPE and value head dims, C = R + Dr, N flat slots.
"""

import functools
import json
import sys
from pathlib import Path

import hf_oracle as hf
import pytest
import torch
from hf_oracle import FP32_LOGITS_ATOL
from triton_util import needs_triton

from moeserve.models import PagedBatch, StepBatch, init_model, load_model
from moeserve.models.config import parse_config
from moeserve.models.mla import LatentKVCache, MLAttention

VARIANTS = {
    # 4 groups of 4 experts, 2 picked; q LoRA; YaRN with mscale_all_dim (the scale corrected)
    "groups_yarn_qlora": dict(),
    # Kimi K2's shape of routing (one group), no q LoRA (q_proj), attention biases, the halves
    # RoPE (rope_interleave false) without scaling, no renormalisation
    "one_group_qproj_bias": dict(
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        attention_bias=True,
        rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        norm_topk_prob=False,
        routed_scaling_factor=2.827,
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    path = hf.save(hf.build_deepseek_v3(seed=1, **VARIANTS[request.param]), tmp_path_factory.mktemp(request.param))
    return hf.load_oracle(path), load_model(path), path


def test_the_config_is_read_as_transformers_reads_it(case):
    oracle, model, _ = case
    c = model.config
    assert c.family == "deepseek_v3" and c.moe_layer_ids == (1, 2)
    assert [hasattr(layer.mlp, "experts") for layer in oracle.model.layers] == [False, True, True]
    assert (c.mla.kv_lora_rank, c.mla.qk_rope_head_dim, c.mla.qk_nope_head_dim, c.mla.v_head_dim) == (32, 8, 16, 16)
    assert c.mla.softmax_scale == pytest.approx(oracle.model.layers[0].self_attn.scaling, rel=1e-12)
    r = c.routing
    assert (r.scoring, r.correction_bias, r.gate_fp32) == ("sigmoid", True, True)
    assert (r.n_group, r.topk_group, r.scaling_factor) == (
        oracle.config.n_group,
        oracle.config.topk_group,
        oracle.config.routed_scaling_factor,
    )
    assert model.moe_info.num_expert_groups == oracle.config.n_group


def test_logits_equal_transformers_within_1e_4(case):
    oracle, model, _ = case
    ids = hf.prompts(2, 40)
    with torch.no_grad():
        ref = oracle(ids).logits
    assert (model(ids) - ref).abs().max().item() < FP32_LOGITS_ATOL


def test_greedy_generation_of_32_tokens_is_token_identical(case):
    oracle, model, _ = case
    ids = hf.prompts(2, 6, seed=1)
    got = model.generate(ids, max_new_tokens=32, ignore_eos=True)
    assert torch.equal(got, hf.hf_greedy(oracle, ids, 32))
    assert len(set(got[0, 6:].tolist())) > 4, "the oracle is informative"


def _paged_logits(model, seqs, chunks):
    """Each sequence prefilled in ``chunks``, all sequences in one paged batch per step (a step of
    1-token chunks is a decode step: absorbed; the others expand): logits per sequence."""
    cache, bs = model.new_paged_cache(num_blocks=32, block_size=4), 4
    tables = [list(range(s * 8, s * 8 + 8))[::-1] for s in range(len(seqs))]  # blocks out of order
    done, rows = [0] * len(seqs), [[] for _ in seqs]
    for n in chunks:
        live = [s for s, q in enumerate(seqs) if done[s] < len(q)]
        lens = [min(n, len(seqs[s]) - done[s]) for s in live]
        batch = PagedBatch.build(lens, [done[s] for s in live], [tables[s] for s in live], bs)
        ids = torch.cat([seqs[s][done[s] : done[s] + k] for s, k in zip(live, lens)])
        for s, piece in zip(live, model.logits(model.step(ids, batch, cache)).split(lens)):
            rows[s].append(piece)
            done[s] += piece.shape[0]
    return [torch.cat(r) for r in rows]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_paged_steps_on_the_latent_cache_equal_the_full_forward(case, backend, monkeypatch):
    """Prefill chunks of 5 (expanded), then decode steps (absorbed: the torch path, or the
    Triton kernel under the interpreter), two sequences in each step."""
    _, model, _ = case
    monkeypatch.setattr(MLAttention, "absorbed", functools.partialmethod(MLAttention.absorbed, backend=backend))
    seqs = [hf.prompts(1, 20, seed=4)[0], hf.prompts(1, 13, seed=5)[0]]
    got = _paged_logits(model, seqs, [5, 5, 1, 1, 1, 1, 5, 5])
    for s, q in enumerate(seqs):
        assert (got[s] - model(q[None])[0]).abs().max().item() < FP32_LOGITS_ATOL


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_absorbed_attention_equals_the_eager_expanded_oracle_on_a_mixed_step(case, backend):
    """Every token of a mixed step (a decode at position 9, a chunk of 6 after 3 cached tokens,
    a fresh prefill of 4) through the absorbed path equals transformers' expanded formulation."""
    _, model, _ = case
    attn, m = model.layers[1].attn, model.config.mla
    g = torch.Generator().manual_seed(0)
    cache = LatentKVCache(1, m.latent_dim, num_blocks=12, block_size=4)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    lens, starts, tables = [1, 6, 4], [9, 3, 0], [[5, 0, 7], [2, 9, 11], [4]]
    batch = PagedBatch.build(lens, starts, tables, 4)
    t, hq = sum(lens), model.config.num_heads
    q_nope = torch.randn(t, hq, m.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(t, hq, m.qk_rope_head_dim, generator=g)
    got = attn.absorbed(q_nope, q_pe, cache.k[0], batch, backend=backend)  # [T, Hq, Dv]
    for s, (n, start, table) in enumerate(zip(lens, starts, tables)):
        a = sum(lens[:s])
        slots = [table[p // 4] * 4 + p % 4 for p in range(start + n)]
        ref = attn._expanded(q_nope[a : a + n], q_pe[a : a + n], cache.k[0, slots, 0], start)
        assert (got[a : a + n] - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_fresh_prompts_expanded_through_sdpa_equal_the_full_forward(case, backend, monkeypatch):
    """With ``MOESERVE_ATTENTION_PREFILL=sdpa`` a step's fresh prompts attend to their own
    latents expanded through kv_b, on torch's SDPA (the real function on the CPU); the
    sequences before them keep the paged path (absorbed on the Triton kernel, or expanded on
    the torch path). A step of two fresh prompts, a mixed step (a continuing chunk, then a
    fresh prompt), decodes: every logit equals the full forward's, and SDPA saw exactly the
    fresh prompts."""
    from moeserve.models import attention as attn_mod
    from moeserve.models import paged

    _, model, _ = case
    monkeypatch.setattr(MLAttention, "absorbed", functools.partialmethod(MLAttention.absorbed, backend=backend))
    monkeypatch.setitem(attn_mod.PREFILL, "backend", "sdpa")
    monkeypatch.setitem(paged.SPLIT_FRESH, "on", True)
    calls: list = []
    real = attn_mod.sdpa_prompts
    monkeypatch.setattr(
        attn_mod, "sdpa_prompts", lambda q, k, v, lens, **kw: calls.append(lens) or real(q, k, v, lens, **kw)
    )
    seqs = [hf.prompts(1, 20, seed=4)[0], hf.prompts(1, 13, seed=5)[0], hf.prompts(1, 9, seed=6)[0]]
    cache, bs = model.new_paged_cache(num_blocks=40, block_size=4), 4
    tables = [list(range(s * 12, s * 12 + 12))[::-1] for s in range(3)]
    # (sequence, start, tokens) per step: two fresh prompts; seq 0 goes on beside seq 2's fresh
    # prompt; then seq 0 finishes its prompt beside decodes of seqs 1 and 2
    plan = [[(0, 0, 8), (1, 0, 13)], [(0, 8, 6), (2, 0, 9)], [(1, 13, 1), (2, 9, 1), (0, 14, 6)]]
    extra = {s: hf.prompts(1, 1, seed=10 + s)[0] for s in range(3)}  # the decodes' tokens
    rows: dict = {s: [] for s in range(3)}
    for step in plan:
        lens, starts = [n for _, _, n in step], [a for _, a, _ in step]
        batch = PagedBatch.build(lens, starts, [tables[s] for s, _, _ in step], bs)
        ids = torch.cat([seqs[s][a : a + n] if a < len(seqs[s]) else extra[s] for s, a, n in step])
        for (s, _, _), piece in zip(step, model.logits(model.step(ids, batch, cache)).split(lens)):
            rows[s].append(piece)
    layers = model.config.num_layers  # every layer is MLA: one call each
    assert calls == [(8, 13)] * layers + [(9,)] * layers  # each step's fresh prompts, none of the others
    for s in range(3):
        full = torch.cat([seqs[s], extra[s]]) if s else seqs[s]
        want = model(full[None])[0]
        got = torch.cat(rows[s])
        assert (got - want[: got.shape[0]]).abs().max().item() < FP32_LOGITS_ATOL


def test_the_paged_pool_holds_the_latent_per_token_not_per_head_keys_and_values(case):
    _, model, _ = case
    c, m = model.config, model.config.mla
    cache = model.new_paged_cache(num_blocks=8, block_size=4)
    assert isinstance(cache, LatentKVCache) and cache.v is cache.k
    assert cache.k.shape == (c.num_layers, 32, 1, m.kv_lora_rank + m.qk_rope_head_dim)  # [Lyr, N, 1, C]
    per_token = cache.k.numel() * cache.k.element_size() // 32
    assert per_token == c.num_layers * 40 * 4  # (R + Dr) fp32 values per layer
    full = c.num_layers * c.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 4
    assert full == 4 * per_token  # per-head keys [Hq, Dn + Dr] and values [Hq, Dv] would take 4x here
    assert LatentKVCache.bytes_per_block(c.num_layers, 1, 40, 4, torch.float32) == 4 * per_token


def test_the_published_deepseek_v3_shape_caches_576_values_per_token_and_layer():
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from servinglib.shapes import DEEPSEEK_V3, DSV3_7

    cfg = parse_config(DEEPSEEK_V3)
    assert cfg.quantization is not None and cfg.quantization.format == "fp8-block"
    assert parse_config(DSV3_7).moe_layer_ids == (3, 4, 5, 6) and parse_config(DSV3_7).quantization is None
    m = cfg.mla
    assert (cfg.num_layers, cfg.num_heads, m.kv_lora_rank, m.qk_rope_head_dim) == (61, 128, 512, 64)
    assert cfg.cache_dim == 576 and cfg.moe_layer_ids == tuple(range(3, 61))
    assert (cfg.routing.n_group, cfg.routing.topk_group, cfg.top_k, cfg.num_experts) == (8, 4, 8, 256)
    latent = LatentKVCache.bytes_per_block(cfg.num_layers, 1, cfg.cache_dim, 1, torch.bfloat16)
    full = cfg.num_layers * cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 2
    assert (latent, full) == (70_272, 4_997_120)  # bytes per token in bf16: 71x less


# -- each feature acts in the tiny model (so the equalities above cover it) -------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = hf.save(hf.build_deepseek_v3(seed=1), tmp_path_factory.mktemp("base"))
    return path, load_model(path)(hf.prompts(1, 32, seed=3))


@pytest.mark.parametrize(
    "change",
    [
        dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),  # YaRN acts
        dict(rope_parameters={**hf.DEEPSEEK_V3_BASE["rope_parameters"], "mscale_all_dim": 0.0}),  # the scale
        dict(topk_group=4),  # the group limit acts
        dict(routed_scaling_factor=1.0),
        dict(norm_topk_prob=False),
    ],
    ids=["yarn", "softmax_scale", "groups", "scaling", "renormalize"],
)
def test_each_feature_changes_the_tiny_model(base, tmp_path, change):
    path, logits = base
    cfg = json.loads((path / "config.json").read_text())
    hf.rewrite(path, tmp_path / "m", hf.read_all(path), {**cfg, **change})
    assert (load_model(tmp_path / "m")(hf.prompts(1, 32, seed=3)) - logits).abs().max() > 1e-2


def test_the_correction_bias_selects_and_does_not_weigh(base, tmp_path):
    path, logits = base
    t = hf.read_all(path)
    zero = {k: torch.zeros_like(v) for k, v in t.items() if k.endswith("e_score_correction_bias")}
    hf.rewrite(path, tmp_path / "m", {**t, **zero})
    assert (load_model(tmp_path / "m")(hf.prompts(1, 32, seed=3)) - logits).abs().max() > 1e-2


def test_kimi_k2_model_type_reads_as_deepseek_v3(case):
    _, model, path = case
    raw = json.loads((path / "config.json").read_text())
    kimi = parse_config({**raw, "model_type": "kimi_k2"})
    assert kimi.family == "deepseek_v3" and kimi.mla == model.config.mla and kimi.routing == model.config.routing


def test_other_routing_methods_are_refused_by_name(case):
    _, _, path = case
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="scoring_func' is 'softmax'; DeepSeek-V3 routing: allowed: sigmoid"):
        parse_config({**raw, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="topk_method"):
        parse_config({**raw, "topk_method": "greedy"})


def test_init_model_writes_a_checkpoint_transformers_loads_and_agrees_with(tmp_path):
    path = init_model(tmp_path / "ds", "deepseek_v3", seed=7)
    oracle, model = hf.load_oracle(path), load_model(path)
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids) - oracle(ids).logits).abs().max() < FP32_LOGITS_ATOL
    got = model.generate(ids[:, :4], max_new_tokens=32, ignore_eos=True)
    assert torch.equal(got, hf.hf_greedy(oracle, ids[:, :4], 32))
    assert len(set(got[0, 4:].tolist())) > 8, "greedy output is not one repeated token"
    cache = model.new_cache()
    model.step(ids[0, :5], StepBatch.prefill([0], [5]), cache)
    assert cache.length(0) == 5


# -- block-wise FP8, the published format --------------------------------------------------------


def test_the_published_fp8_layout_quantizes_mla_and_the_mlps_and_keeps_the_router(tmp_path):
    """DeepSeek-V3's config.json (quant_method fp8, 128 x 128 blocks, no module named
    unconverted) read as dummy weights: every MLA projection, dense MLP, shared and routed
    expert in FP8 with one weight_scale_inv per block; the gate, its bias and the LM head not."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from servinglib.shapes import DSV3_13_FP8, write_model

    from moeserve.models.dummy import DummyReader

    r = DummyReader(write_model(str(tmp_path / "v3"), DSV3_13_FP8))
    fp8 = torch.float8_e4m3fn
    for name, scale in (
        ("model.layers.0.self_attn.q_a_proj", (12, 56)),
        ("model.layers.0.self_attn.q_b_proj", (192, 12)),
        ("model.layers.0.self_attn.kv_a_proj_with_mqa", (5, 56)),
        ("model.layers.0.self_attn.kv_b_proj", (256, 4)),
        ("model.layers.0.self_attn.o_proj", (56, 128)),
        ("model.layers.0.mlp.gate_proj", (144, 56)),
        ("model.layers.3.mlp.shared_experts.down_proj", (56, 16)),
        ("model.layers.12.mlp.experts.255.up_proj", (16, 56)),
    ):
        assert r.stored_dtype(f"{name}.weight") == fp8 and r.shape(f"{name}.weight_scale_inv") == scale, name
    assert r.stored_dtype("model.layers.3.mlp.gate.weight") == torch.float32  # the fp32 gate
    assert r.stored_dtype("lm_head.weight") == torch.bfloat16
    assert r.expert_spec(torch.bfloat16).quant is not None


def test_a_tiny_block_fp8_model_decodes_on_the_latent_cache_as_its_eager_forward(case, tmp_path):
    """Block-wise FP8 weights (16 x 16 blocks, MLA included): kv_b is absorbed from its
    dequantized weight in decode; the paged steps equal the eager forward."""
    import fp8_util

    _, _, path = case
    fp8, deq = fp8_util.quantize(path, tmp_path, "fp8-block", "block", (16, 16), "all")
    model = load_model(fp8)
    assert type(model.layers[1].attn.kv_b).__name__ == "QuantLinear"
    seqs = [hf.prompts(1, 14, seed=6)[0], hf.prompts(1, 9, seed=7)[0]]
    got = _paged_logits(model, seqs, [4, 1, 1, 1, 1, 1, 4, 4])
    for s, q in enumerate(seqs):
        assert (got[s] - model(q[None])[0]).abs().max().item() < FP32_LOGITS_ATOL
    with torch.no_grad():
        want = hf.load_oracle(deq)(seqs[0][None]).logits[0]
    assert (got[0] - want).abs().max().item() < FP32_LOGITS_ATOL


def test_a_router_sizes_its_pool_by_the_latent(case, tmp_path):
    """kv_blocks on a CPU rank: the cpu_kv_cache_gib budget divided by one block's latent bytes
    (layers x block_size x (R + Dr) x 4 in fp32), not by per-head keys and values."""
    from moeserve.cluster.rank import kv_blocks
    from moeserve.config import CacheConfig, ClusterConfig, Limits

    _, model, path = case
    per_block = 3 * 16 * 40 * 4  # 7,680 bytes
    cfg = ClusterConfig(
        str(path),
        cache=CacheConfig(block_size=16, cpu_kv_cache_gib=100 * per_block / 2**30),
        limits=Limits(max_model_len=4096, max_num_seqs=64),
    )
    assert kv_blocks(cfg, model.config, torch.float32, torch.device("cpu")) == 100


@needs_triton
def test_the_triton_kernel_at_deepseek_v3s_latent_width_equals_the_torch_path():
    """R = 512, Dr = 64 (the published widths), 20 heads (a partial tile of 16), blocks of 16:
    the kernel's o_c equals the paged torch attention over the latent as key and value."""
    from moeserve.models.attention import paged_attention_torch
    from moeserve.models.mla import mla_decode_triton

    g = torch.Generator().manual_seed(3)
    r, dr, hq, bs = 512, 64, 20, 16
    pool = torch.randn(6 * bs, 1, r + dr, generator=g) * 0.1  # [N, 1, C]
    batch = PagedBatch.build([1, 3], [40, 20], [[4, 1, 5], [0, 2]], bs)
    q_c, q_pe = torch.randn(4, hq, r, generator=g) * 0.1, torch.randn(4, hq, dr, generator=g) * 0.1
    scale = 192**-0.5
    got = mla_decode_triton(q_c, q_pe, pool, batch, scale=scale, kv_lora_rank=r)
    ref = paged_attention_torch(
        torch.cat([q_c, q_pe], -1), pool, pool, batch, scale=scale, chunk=None, softmax_fp32=True
    )
    assert (got - ref[..., :r]).abs().max().item() < 1e-5
