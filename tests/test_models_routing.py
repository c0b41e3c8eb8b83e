"""The routing function as data (moeserve.models.routing.route) equals transformers' own routers,
one RoutingSpec per family, and DeepSeek-V3's grouped top-k with its routed scaling factor; the
shared experts' sigmoid gate equals Qwen2-MoE's."""

import pytest
import torch

from moeserve.models.config import RoutingSpec
from moeserve.models.layers import Linear, SwiGLU
from moeserve.models.routing import MoEBlock, route

H, E, T = 32, 16, 64


def _hidden(seed: int = 0) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


def _hf_router(name: str):
    """(a transformers router module with random weights, the RoutingSpec that mirrors it)."""
    torch.manual_seed(0)
    if name == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=4, norm_topk_prob=True)
        return Qwen3MoeTopKRouter(cfg), RoutingSpec(renormalize=True), 4
    if name == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

        cfg = MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2)
        return MixtralTopKRouter(cfg), RoutingSpec(renormalize=True), 2
    if name == "gpt_oss":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

        cfg = GptOssConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=4)
        return GptOssTopKRouter(cfg), RoutingSpec(topk_first=True, gate_bias=True), 4
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=H, n_routed_experts=E, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    spec = RoutingSpec(
        scoring="sigmoid",
        gate_fp32=True,
        correction_bias=True,
        n_group=4,
        topk_group=2,
        renormalize=True,
        renorm_min=1e-20,
        scaling_factor=2.5,
    )
    return DeepseekV3TopkRouter(cfg), spec, 4


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_route_equals_the_transformers_router(name):
    hf_router, spec, k = _hf_router(name)
    with torch.no_grad():
        for p in hf_router.parameters():
            p.copy_(torch.randn(p.shape))
        bias = getattr(hf_router, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(0.3 * torch.randn(bias.shape))
        x = _hidden()
        _, want_w, want_ids = hf_router(x)
    gate_bias = getattr(hf_router, "bias", None)
    block = MoEBlock(spec, k, hf_router.weight.detach(), None if gate_bias is None else gate_bias.detach(), bias)
    got = block.route(x)
    # the same expert sets, and each expert's weight (transformers may return them unsorted)
    order_got, order_want = got.ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(got.ids.gather(-1, order_got), want_ids.gather(-1, order_want))
    torch.testing.assert_close(
        got.weights.gather(-1, order_got), want_w.float().gather(-1, order_want), atol=1e-6, rtol=1e-6
    )
    assert got.weights_on_input is False


def test_grouped_top_k_keeps_to_the_best_groups():
    """With 4 groups of 4 and topk_group 2, every token's experts lie in 2 groups, and the groups
    are those with the best sum of two scores, even when a lone high score sits elsewhere."""
    spec = RoutingSpec(scoring="sigmoid", n_group=4, topk_group=2)
    logits = torch.full((1, E), -4.0)
    logits[0, [0, 1]] = 2.0  # group 0: two good experts
    logits[0, [4, 5]] = 1.5  # group 1: two fair ones
    logits[0, 12] = 3.0  # group 3: one excellent expert alone
    got = route(spec, logits, 4)
    assert sorted(got.ids[0].tolist()) == [0, 1, 4, 5]
    ids = route(spec, torch.randn(T, E), 4).ids // 4  # [T, K] groups
    assert all(len(set(row.tolist())) <= 2 for row in ids)


def test_routed_scaling_factor_and_renormalisation_floor():
    spec = RoutingSpec(scoring="sigmoid", renormalize=True, renorm_min=1e-20, scaling_factor=2.5)
    got = route(spec, torch.randn(T, E), 3)
    torch.testing.assert_close(got.weights.sum(-1), torch.full((T,), 2.5))


def test_the_shared_experts_sigmoid_gate_equals_qwen2_moe():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(
        hidden_size=H, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=24
    )
    hf_block = Qwen2MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in hf_block.parameters():
            p.copy_(0.3 * torch.randn(p.shape))
    se = hf_block.shared_expert
    block = MoEBlock(
        RoutingSpec(),
        2,
        hf_block.gate.weight.detach(),
        shared_mlp=SwiGLU(*(Linear(m.weight.detach()) for m in (se.gate_proj, se.up_proj, se.down_proj))),
        shared_gate=Linear(hf_block.shared_expert_gate.weight.detach()),
    )
    x = _hidden(1)
    with torch.no_grad():
        want = torch.sigmoid(hf_block.shared_expert_gate(x)) * se(x)
    torch.testing.assert_close(block.shared(x), want, atol=1e-6, rtol=1e-6)
    assert (want - se(x)).abs().max() > 1e-2, "the gate acts"


def test_invalid_routing_specs_are_refused():
    with pytest.raises(ValueError, match="scoring 'relu'"):
        RoutingSpec(scoring="relu")
    with pytest.raises(ValueError, match="topk_group <= n_group"):
        RoutingSpec(n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="need the top-k taken on the scores"):
        RoutingSpec(topk_first=True, correction_bias=True)
