"""Grouped routing meets placement: a DeepSeek-V3 cluster started by `moeserve up` on 2 nodes of
2 workers (``--workers-per-node 2``) starts with every group's replicas on one node, tells the
balancer its 4 expert groups (the admin API's ``model.num_expert_groups``), and a rebalance
plans hierarchically: every replica of every group stays on one node, the placement changes,
and the greedy tokens stay those of the single-process model before and after."""

import numpy as np
import pytest
from cluster_util import moe_info, prompts_for, reference_generate, reference_model, tiny_checkpoint
from control_util import Up

from moeserve.cluster.rank import initial_placement
from moeserve.config import ClusterConfig, EplbConfig

WORKERS, PER_NODE, REDUNDANT = 4, 2, 4  # 20 slots, 5 per worker, 10 per node
MAX_TOKENS = 16
QUIET = "1000000"  # a step interval the balancer's loop never reaches


def group_nodes(phy2log: np.ndarray, group_size: int, slots_per_node: int) -> list[dict[int, set[int]]]:
    """Per MoE layer, the nodes that hold a replica of each expert group."""
    out = []
    for row in phy2log:
        nodes: dict[int, set[int]] = {}
        for slot, expert in enumerate(row):
            nodes.setdefault(int(expert) // group_size, set()).add(slot // slots_per_node)
        out.append(nodes)
    return out


def test_the_default_start_placement_puts_each_group_on_one_node(tmp_path):
    """16 experts in 4 groups, 20 slots on 2 nodes of 2 workers: node 0 holds groups 0 and 1
    and copies of its first experts, node 1 groups 2 and 3; without nodes, slot p holds p mod E."""
    eplb = EplbConfig(enable_eplb=True, num_redundant_experts=REDUNDANT)
    cfg = ClusterConfig(str(tmp_path), workers=WORKERS, workers_per_node=PER_NODE, eplb=eplb)
    row = list(range(8)) + [0, 1] + list(range(8, 16)) + [8, 9]
    assert initial_placement(cfg, 2, 16, num_groups=4).phy2log.tolist() == [row, row]
    flat = list(range(16)) + [0, 1, 2, 3]
    assert initial_placement(cfg, 1, 16).phy2log.tolist() == [flat]  # no groups
    one_node = ClusterConfig(str(tmp_path), workers=WORKERS, eplb=eplb)
    assert initial_placement(one_node, 1, 16, num_groups=4).phy2log.tolist() == [flat]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds-nodes")
    path = tiny_checkpoint(tmp / "model", "deepseek_v3", hot_experts=2)  # 16 experts, 4 groups of 4
    info = moe_info(path)
    model = reference_model(path)
    prompts = prompts_for(model.config.vocab_size, lengths=(5, 11, 3, 9, 7, 4))
    want = [reference_generate(model, p, MAX_TOKENS) for p in prompts]
    up = Up(
        path,
        "--routers",
        "1",
        "--workers",
        str(WORKERS),
        "--workers-per-node",
        str(PER_NODE),
        "--enable-eplb",
        "--num-redundant-experts",
        str(REDUNDANT),
        "--eplb-step-interval",
        QUIET,
        "--migration-bytes-per-step",
        str(info.expert_bytes),
    )
    yield dict(up=up, info=info, prompts=prompts, want=want)
    up.stop()


@pytest.mark.slow  # it starts processes
@pytest.mark.timeout(600)
def test_a_rebalance_keeps_every_groups_replicas_on_one_node_and_serving_exact(setup):
    serving, admin, balancer = setup["up"].clients()
    assert admin.status().model.num_expert_groups == 4
    group, per_node = setup["info"].num_logical_experts // 4, (setup["info"].num_logical_experts + REDUNDANT) // 2
    start = admin.placement().phy2log
    assert all(len(n) == 1 for layer in group_nodes(start, group, per_node) for n in layer.values())

    def generate():
        return [
            serving.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True).token_ids
            for p in setup["prompts"]
        ]

    assert generate() == setup["want"]  # (and the load window now holds the hot experts)
    result = balancer.rebalance(wait=True)
    assert result.applied, result.note
    after = admin.placement().phy2log
    assert not np.array_equal(after, start)
    layers = group_nodes(after, group, per_node)
    assert all(len(n) == 1 for layer in layers for n in layer.values()), layers  # each group on one node
    assert all(sorted(layer) == [0, 1, 2, 3] for layer in layers)
    assert generate() == setup["want"]
