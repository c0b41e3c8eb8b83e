"""Placement policies (numpy only; importing this package does not import torch).

- :mod:`.policy`: the project's policy (``place``, ``make_policy``, ``cross_node_share``):
  migration-aware, budgeted, hierarchical or not.
- :mod:`.report`: what a proposed placement buys (``evaluate``, ``PlanReport``).
- :mod:`.cost`: the step-time model of one MoE layer on one worker and its calibration table.
- :mod:`.rule`: that model under the data plane's replica rule with break-even counts b, and b
  chosen per (layer, expert) by it (``plan_breakeven``).
- :mod:`.reads`: the cost-aware policy's search on the rule: which experts fill the redundant
  slots so that each step's one replica read splits evenly over the workers.
- :mod:`.packing`: fresh plans (replica counts, packing replicas onto workers).
- :mod:`.search`: the local search that moves slots off the heaviest workers, and the choice
  of how far along it each layer goes within a move budget.
- :mod:`.relabel`: matching a fresh plan's workers and slots to the placement in force.
- :mod:`.reference`: the DeepSeek EPLB drop-in (``rebalance_experts``, ``place_reference``).
"""

from moeserve.balancer.policy.cost import StepModel, StepModelError, load_table
from moeserve.balancer.policy.policy import NOISE_K, PolicyConfig, cross_node_share, make_policy, place
from moeserve.balancer.policy.reference import place_reference, rebalance_experts
from moeserve.balancer.policy.report import PlanReport, evaluate

__all__ = [
    "place",
    "make_policy",
    "PolicyConfig",
    "evaluate",
    "PlanReport",
    "cross_node_share",
    "NOISE_K",
    "rebalance_experts",
    "place_reference",
    "StepModel",
    "StepModelError",
    "load_table",
]
