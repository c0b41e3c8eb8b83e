"""The direct exchange's protocol and kernels (moeserve.dataplane.nvlink, moeserve.kernels), run by
Triton's interpreter on CPU tensors: several ranks simulated in one process, each rank's
symmetric buffers a plain tensor whose address the kernels store through. Everything but the
barriers (GPU only; benchmarks/dispatch.py and benchmarks/gpu_correctness.py check those
on 2 H200s)."""

import os

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:  # the test extra installs it; CI=true requires it
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("triton is not installed (pip install -e '.[test]')", allow_module_level=True)

from moeserve import kernels  # noqa: E402
from moeserve.dataplane import nvlink  # noqa: E402
from moeserve.dataplane.exchange import Topology  # noqa: E402

pytestmark = pytest.mark.timeout(300)


if not torch.cuda.is_available():
    # conftest.py sets it before Triton is imported; without a GPU the interpreter is the only way.
    assert os.environ.get("TRITON_INTERPRET") == "1"


def table(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.long)


LAYOUTS = [(1, 1, True, 4), (2, 2, True, 6), (3, 3, True, 9), (1, 2, False, 6), (2, 2, False, 8), (1, 3, False, 6)]


def maps_for(p, e, g):
    """A placement of P slots over E logical experts (every expert at least once), as RouterMaps."""
    from moeserve.router.dispatcher import RouterMaps

    phy2log = torch.cat([torch.randperm(e, generator=g), torch.randint(0, e, (p - e,), generator=g)])
    return RouterMaps(phy2log.numpy()[None], e, p - e + 1)


@pytest.mark.slow  # long-running (several seconds on 2 cores): out of the fast loop
@pytest.mark.parametrize("routers,workers,colocated,slots", LAYOUTS)
@pytest.mark.parametrize("k,scaled,replicas", [(1, True, True), (3, False, True), (2, False, False)])
def test_rows_land_slot_major_and_come_back_to_their_pairs(routers, workers, colocated, slots, k, scaled, replicas):
    from moeserve.dataplane.exchange import choose_slots

    topo = Topology.build(routers, workers, colocated, slots)
    R, P, S, H, cap = topo.world_size, topo.num_slots, topo.slots_per_worker, 40, 600
    g = torch.Generator().manual_seed(routers * 100 + workers * 10 + k)
    E = (P - 2 if P - 2 >= k else P - 1) if replicas else P
    maps = maps_for(P, E, g)
    assert maps.single[0] == (E == P)
    counts = [torch.zeros(R, P, dtype=torch.long) for _ in range(R)]
    rows = [torch.full((routers * cap, H), float("nan")) for _ in range(R)]
    meta = [torch.full((routers * cap,), -1, dtype=torch.long) for _ in range(R)]
    outs = [torch.full((cap, H), float("nan")) for _ in range(R)]
    sent = {r: torch.zeros(P, dtype=torch.long) for r in topo.router_ranks}
    slots_of, prefix_of, x_of, w_of, ids_of, args_of, raw_slots = {}, {}, {}, {}, {}, {}, {}
    # 1. routers choose slots and publish their counts (an idle router publishes zeros)
    for rank in topo.router_ranks:
        t = [cap // k, 0, 333 // k][rank % 3]  # at capacity (several blocks), idle, a partial block
        ids = (
            torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
            if t
            else torch.zeros(0, k, dtype=torch.long)
        )
        offset = 5 + rank
        x_of[rank] = torch.randn(t, H, generator=g)
        w_of[rank] = torch.rand(t * k, generator=g)
        ids_of[rank] = ids
        args_of[rank] = kernels.pair_args(x_of[rank], ids, w_of[rank] if scaled else None, t * k, offset)
        sl, hist = kernels.route(args_of[rank], maps.log2phy[0], maps.logcnt[0], P, maps.single[0], k, cap)
        assert sl.numel() >= cap and hist.shape[0] == kernels.num_blocks(cap)  # capacity-sized
        sl = sl[: t * k]
        assert torch.equal(sl.long(), choose_slots(ids, maps.log2phy[0], maps.logcnt[0], offset))  # the replica rule
        prefix = torch.empty_like(hist)
        kernels.publish(args_of[rank], hist, prefix, table(counts), rank, sent[rank], P)
        assert torch.equal(sent[rank], torch.bincount(sl.long(), minlength=P))
        slots_of[rank], prefix_of[rank], raw_slots[rank] = sl.long(), prefix, sl
    for c in counts:  # everyone sees the same [R, P]
        assert torch.equal(c, counts[0])
    # 2. every rank derives its layout; equal to the torch reference
    shift_of, offs_of = {}, {}
    for rank in range(R):
        shift = torch.zeros(P, dtype=torch.long)
        offs = torch.zeros(S, dtype=torch.int32)
        worker = topo.worker_index(rank)
        kernels.prep(counts[rank], rank, -1 if worker is None else worker, workers, shift, offs)
        if worker is not None:
            assert torch.equal(offs, nvlink.worker_offsets(counts[rank], worker, topo))
        shift_of[rank], offs_of[rank] = shift, offs
    # 3. routers scatter their rows
    for rank in topo.router_ranks:
        full = torch.zeros(prefix_of[rank].shape[0] * kernels.BLOCK_PAIRS, dtype=torch.int32)
        full[: slots_of[rank].numel()] = raw_slots[rank]
        kernels.scatter_pairs(
            args_of[rank],
            torch.float32,
            H,
            k,
            scaled,
            full,
            prefix_of[rank],
            shift_of[rank],
            S,
            topo.worker_ranks[0],
            table(rows),
            table(meta),
            rank * cap,
        )
        # where each pair landed = the reference layout of a stable sort by slot
        sorted_slots, order = torch.sort(slots_of[rank], stable=True)
        dest, row = nvlink.positions(counts[rank], rank, sorted_slots, topo)
        for d, r_, pair in zip(dest.tolist(), row.tolist(), order.tolist()):
            assert int(meta[d][r_]) == rank * cap + pair
    # Each worker holds, slot-major and by sending rank inside a slot, exactly the rows sent to it.
    for w, rank in enumerate(topo.worker_ranks):
        total = int(offs_of[rank][-1])
        expect = []
        for s in range(w * S, (w + 1) * S):
            for src in topo.router_ranks:
                for pair in torch.nonzero(slots_of[src] == s).flatten().tolist():
                    v = x_of[src][pair // k] * (w_of[src][pair] if scaled else 1.0)
                    expect.append((src * cap + pair, v))
        assert total == len(expect)
        assert meta[rank][:total].tolist() == [m for m, _ in expect]  # slot-major, stable
        for j, (_m, v) in enumerate(expect):
            assert torch.equal(rows[rank][j], v)
        assert meta[rank][total:].eq(-1).all()  # nothing past the total
    # 4. workers return rows (identity experts) to their pairs' rows on the routers
    for rank in topo.worker_ranks:
        kernels.return_rows(rows[rank], meta[rank], offs_of[rank][-1:], table(outs), cap)
    for rank in topo.router_ranks:
        n = slots_of[rank].numel()
        want = x_of[rank].repeat_interleave(k, 0) * (w_of[rank].view(-1, 1) if scaled else 1.0)
        assert torch.equal(outs[rank][:n], want)
        assert torch.isnan(outs[rank][n:]).all()


def test_silu_mul_stops_at_the_device_total_and_matches_torch():
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(9, 2 * 48, generator=g) * 4
    out = kernels.silu_mul(gu, torch.tensor([6], dtype=torch.int32))
    ref = torch.nn.functional.silu(gu[:, :48]) * gu[:, 48:]
    torch.testing.assert_close(out[:6], ref[:6], rtol=1e-6, atol=1e-6)
    assert kernels.silu_mul(gu[:0], torch.tensor([0], dtype=torch.int32)).shape == (0, 48)


def test_weighted_sum_is_the_weighted_sum_over_k():
    g = torch.Generator().manual_seed(1)
    t, k, h = 5, 6, 70
    x = torch.randn(t * k, h, generator=g)
    w = torch.rand(t, k, generator=g)
    ref = torch.bmm(w.view(t, 1, k), x.view(t, k, h)).view(t, h)
    torch.testing.assert_close(kernels.weighted_sum(x, w), ref, rtol=1e-6, atol=1e-6)
    # fp32 accumulation in k order, one rounding: bf16 inputs give the fp32 sum rounded once
    xb, wb = x.bfloat16(), w.bfloat16()
    acc = torch.zeros(t, h)
    for j in range(k):
        acc += wb[:, j : j + 1].float() * xb.view(t, k, h)[:, j].float()
    got = kernels.weighted_sum(xb, wb).float()
    assert (got - acc).abs().max() <= acc.abs().max() * 2**-7  # within a bf16 step (truncation here)


def test_capacity_and_layout_errors_are_explained():
    topo = Topology.build(2, 3, False, 6)
    assert nvlink.usable(torch.device("cpu")) == (False, "needs CUDA devices")
    with pytest.raises(ValueError, match="must be one of"):
        from moeserve.config import ClusterConfig

        ClusterConfig(model_dir="x", exchange="shm")
    with pytest.raises(ValueError, match="needs backend='nccl'"):
        from moeserve.config import ClusterConfig

        ClusterConfig(model_dir="x", exchange="nvlink")
    assert topo.worker_ranks == (2, 3, 4)


def test_auto_takes_the_collective_exchange_without_cuda():
    from moeserve.cluster.recovery import make_exchange
    from moeserve.config import ClusterConfig

    topo = Topology.build(1, 2, False, 4)
    for choice in ("auto", "collective"):
        ex = make_exchange(
            ClusterConfig(model_dir="x", exchange=choice), topo, 0, torch.device("cpu"), None, 8, torch.float32, 2
        )
        assert ex.kind == "collective"
