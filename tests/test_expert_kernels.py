"""The grouped expert kernels of decode steps (moeserve.kernels.expert_mlp, Triton's interpreter
on CPU) against the slot loop they replace, and how a worker picks them per step."""

import numpy as np
import pytest
import torch
from triton_util import needs_triton

from moeserve import kernels
from moeserve.models.moe import ExpertSpec, grouped_expert_forward

pytestmark = [pytest.mark.timeout(300), needs_triton]


def setup(h, i, counts, dtype, seed=0, tail=3):
    """rows [sum(counts) + tail, H] (the tail NaN: past the device total, never read), the slot
    buffer's gate_up [S, H, 2I] / down [S, I, H] views, offs int32 [S]."""
    g = torch.Generator().manual_seed(seed)
    spec = ExpertSpec(hidden_size=h, intermediate_size=i, dtype=dtype)
    s = len(counts)
    buf = (torch.randn(s, spec.numel, generator=g) / h**0.5).to(dtype)
    w = spec.views(buf)
    m = sum(counts)
    rows = torch.cat([torch.randn(m, h, generator=g).to(dtype), torch.full((tail, h), float("nan"), dtype=dtype)])
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    return spec, rows, w, offs, m


def reference(spec, rows, w, counts):
    return grouped_expert_forward(spec, rows[: sum(counts)], None, w, counts=list(counts))


@pytest.mark.parametrize("h,i", [(64, 32), (48, 40)])  # even K, and K with a masked tail (BK 64)
@pytest.mark.parametrize(
    "counts,block_m", [([3, 0, 20, 1, 7], 16), ([0, 0, 5], 16), ([40, 2, 0, 17], 32), ([33], 16), ([100, 3], 16)]
)
def test_fp32_matches_the_slot_loop(h, i, counts, block_m):
    """Every slot's rows through its own expert, in several passes when a slot has more rows
    than block_m (20 and 33 rows at 16, 40 at 32; 100 rows at 16 are 7 passes, more than the
    EXPERT_PASS_GROUPS programs of a tile, so one program takes two), empty slots skipped, NaN
    rows past the total never read: fp32 with IEEE products matches the torch slot loop to
    rounding."""
    spec, rows, w, offs, m = setup(h, i, counts, torch.float32)
    y = kernels.expert_mlp(rows, w["gate_up"], w["down"], offs, block_m)
    assert y.shape == rows.shape
    ref = reference(spec, rows, w, counts)
    assert torch.isfinite(y[:m]).all()
    torch.testing.assert_close(y[:m], ref, rtol=1e-5, atol=1e-5)


def test_bf16_rounds_as_the_two_kernel_path():
    """bf16: gate_up rounded to bf16, silu in fp32 rounded, times up rounded, down accumulated in
    fp32 and rounded once. The interpreter truncates fp32 -> bf16 where the GPU rounds, so the
    kernels are held to the reference computed with those roundings within two bf16 steps."""
    counts = [5, 0, 12, 3]
    spec, rows, w, offs, m = setup(64, 48, counts, torch.bfloat16, seed=3)
    y = kernels.expert_mlp(rows, w["gate_up"], w["down"], offs, 16).float()
    ref = reference(spec, rows, w, counts).float()
    err = (y[:m] - ref).abs()
    assert err.max() <= 2 * 2**-7 * ref.abs().max(), float(err.max())
    # and it is not just close to anything: another slot's weights give a different answer
    shifted = reference(spec, rows, {k: v.roll(1, 0) for k, v in w.items()}, counts).float()
    assert (shifted - ref).abs().max() > 10 * err.max()


def test_block_m_is_a_speed_choice_only():
    counts = [9, 30, 1]
    _, rows, w, offs, m = setup(64, 32, counts, torch.float32, seed=5)
    ys = [kernels.expert_mlp(rows, w["gate_up"], w["down"], offs, bm)[:m] for bm in (16, 32, 64)]
    for y in ys[1:]:
        torch.testing.assert_close(y, ys[0], rtol=1e-6, atol=1e-6)
    assert [kernels.expert_block_m(n) for n in (0, 1, 16, 17, 40, 1000)] == [16, 16, 16, 32, 64, 64]


def test_an_expert_shapes_tiles_replace_the_tables_at_that_shape_only(monkeypatch):
    """``EXPERT_TUNING_SHAPES`` entries apply to their (H, I) and table; the table's environment
    variable (a sweep's tiles, end to end) replaces them; the tiles change speed, not results."""
    mine = {"gate_up": (32, 64, 4, 3), "down_bm64": (64, 64, 4, 3)}
    monkeypatch.setitem(kernels.EXPERT_TUNING_SHAPES, "bf16", {(64, 32): mine})
    monkeypatch.setattr(kernels, "TUNING_FROM_ENV", frozenset())
    assert kernels.expert_tuning("gate_up", 16, shape=(64, 32)) == mine["gate_up"]
    assert kernels.expert_tuning("down", 64, shape=(64, 32)) == mine["down_bm64"]
    assert kernels.expert_tuning("down", 16, shape=(64, 32)) == kernels.EXPERT_TUNING["down"]  # not given
    assert kernels.expert_tuning("gate_up", 16, shape=(48, 40)) == kernels.EXPERT_TUNING["gate_up"]  # other shape
    assert kernels.expert_tuning("gate_up", 16, True, shape=(64, 32)) == kernels.EXPERT_TUNING_FP8["gate_up"]
    assert kernels.expert_tuning("gate_up", 16) == kernels.EXPERT_TUNING["gate_up"]  # no shape
    monkeypatch.setattr(kernels, "TUNING_FROM_ENV", frozenset({"bf16"}))  # MOESERVE_EXPERT_TUNING set at import
    assert kernels.expert_tuning("gate_up", 16, shape=(64, 32)) == kernels.EXPERT_TUNING["gate_up"]
    monkeypatch.setattr(kernels, "TUNING_FROM_ENV", frozenset())
    counts = [9, 30, 1]
    _, rows, w, offs, m = setup(64, 32, counts, torch.float32, seed=6)
    y = kernels.expert_mlp(rows, w["gate_up"], w["down"], offs, 16)[:m]
    monkeypatch.setitem(kernels.EXPERT_TUNING_SHAPES, "bf16", {})
    torch.testing.assert_close(kernels.expert_mlp(rows, w["gate_up"], w["down"], offs, 16)[:m], y, rtol=1e-6, atol=1e-6)


def test_a_tiling_variable_is_read_within_bounds_and_refused_by_name_otherwise():
    assert kernels.parse_tuning('{"down_bm64": [128, 64, 4, 4]}', "MOESERVE_EXPERT_TUNING", fp8=False) == {
        "down_bm64": (128, 64, 4, 4)
    }
    assert kernels.parse_tuning('{"gate_up": [64, 128, 4, 3, true]}', "MOESERVE_FP8_A8_TUNING", fp8=True) == {
        "gate_up": (64, 128, 4, 3, True)
    }
    for text, why in [
        ("{gate_up: 1}", "is not JSON"),
        ("[]", "allowed a JSON object of gate_up"),
        ('{"up": [128, 64, 4, 4]}', "'up'"),
        ('{"down": [96, 64, 4, 4]}', "powers of two 16-256"),
        ('{"down": [128, 64, 3, 4]}', "warps 1-16"),
        ('{"down": [128, 64, 4, 0]}', "stages 1-8"),
        ('{"down": [128, 64, 4]}', "[BN, BK, warps, stages]"),
        ('{"down": [128, 64, 4, 4, true]}', "[BN, BK, warps, stages]"),  # bf16 tiles have no flag
    ]:
        with pytest.raises(ValueError, match="MOESERVE_EXPERT_TUNING") as e:
            kernels.parse_tuning(text, "MOESERVE_EXPERT_TUNING", fp8=False)
        assert why in str(e.value), (text, str(e.value))
    with pytest.raises(ValueError, match=r"MOESERVE_FP8_TUNING: 'down': \[128, 64, 4, 4\]"):
        kernels.parse_tuning('{"down": [128, 64, 4, 4]}', "MOESERVE_FP8_TUNING", fp8=True)  # FP8: the flag too


def test_every_tiling_the_benchmark_sweeps_computes_the_slot_loop():
    """benchmarks/expert_kernel.py --tune with its widest choices (BN 128 and 256, BK 32 to
    128): every (BN, BK) it times gives the slot loop's answer in fp32 (warps and stages do
    not change what the interpreter computes), N and K masked at the edges, so the tiling a
    GPU sweep picks is one that is right; and a size outside the bounds is refused by name."""
    bench = _expert_benchmark()
    cands = bench.candidates("bf16", (128, 256), (32, 64, 128))
    assert len(cands) == 2 * 3 * 2 * 2 and len(bench.candidates("w8a8")) == 2 * 2 * 2 * 2 * 2
    counts = [5, 0, 19]
    spec, rows, w, offs, m = setup(48, 136, counts, torch.float32, seed=7)  # N 136 and 48: masked tiles
    ref = reference(spec, rows, w, counts)
    for bn, bk in sorted({c[:2] for c in cands}):
        h = kernels.expert_gate_up(rows, w["gate_up"], offs, 16, (bn, bk, 4, 3))
        y = kernels.expert_down(h, w["down"], offs, 16, (bn, bk, 4, 3))
        torch.testing.assert_close(y[:m], ref, rtol=1e-5, atol=1e-5, msg=f"tiling {(bn, bk)}")
    for bad in ("300", "96", "8", "x"):
        with pytest.raises(ValueError, match=f"--tune-bn: '{bad}' is not a power of two from 16 to 256"):
            bench._pow2(bad, "--tune-bn")
    assert {c[3] for c in bench.candidates("bf16", stages=(3, 6))} == {3, 6}
    for bad in ("0", "9", "-1", "x"):
        with pytest.raises(ValueError, match=f"--tune-stages: '{bad}' is not a stage count from 1 to 8"):
            bench._stages(bad)
    # --block-m: auto, the decode passes and W8A8's prefill passes, nothing else
    assert [bench._block_m(v) for v in ("auto", "16", "64", "128")] == [0, 16, 64, kernels.FP8_PREFILL_BM]
    for bad in ("256", "48", "x"):
        with pytest.raises(ValueError, match=f"--block-m: '{bad}' is not auto or one of 16, 32, 64, 128"):
            bench._block_m(bad)


def _expert_benchmark():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "expert_kernel.py"
    spec = importlib.util.spec_from_file_location("expert_kernel_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_moeserve_expert_block_m_fixes_the_rows_per_pass_of_triton_steps_only(monkeypatch):
    """MOESERVE_EXPERT_BLOCK_M (a measurement switch): auto keeps the step's choice (twice the
    mean rows per slot, 16-64); 16, 32 or 64 fixes the rows per pass wherever the Triton kernels
    run and changes nothing where torch._grouped_mm does; anything else is refused by name."""
    from expert_worker import store as store_mod

    monkeypatch.setattr(store_mod, "expert_block_m_setting", lambda: 32)
    assert [store_mod.expert_block_m_for(p, 8, "auto") for p in (8, 8 * 24, 8 * 65)] == [32, 32, 0]
    assert store_mod.expert_block_m_for(8 * 65, 8, "triton") == 32
    assert store_mod.expert_block_m_for(8, 8, "grouped_mm") == 0
    monkeypatch.undo()
    try:
        for value, want in (("auto", 0), ("", 0), ("16", 16), ("64", 64)):
            monkeypatch.setenv("MOESERVE_EXPERT_BLOCK_M", value)
            store_mod.expert_block_m_setting.cache_clear()
            assert store_mod.expert_block_m_setting() == want
        assert store_mod.expert_block_m_for(8 * 10, 8, "auto") == 64  # "64" is still set
        for bad in ("48", "128", "x"):
            monkeypatch.setenv("MOESERVE_EXPERT_BLOCK_M", bad)
            store_mod.expert_block_m_setting.cache_clear()
            with pytest.raises(ValueError, match=f"MOESERVE_EXPERT_BLOCK_M='{bad}': allowed auto or one of 16, 32, 64"):
                store_mod.expert_block_m_setting()
    finally:
        monkeypatch.delenv("MOESERVE_EXPERT_BLOCK_M", raising=False)
        store_mod.expert_block_m_setting.cache_clear()
    assert store_mod.expert_block_m_for(8 * 10, 8, "auto") == 32


def test_shape_errors_are_explained():
    _, rows, w, offs, _ = setup(64, 32, [2, 3], torch.float32)
    with pytest.raises(ValueError, match="do not agree"):
        kernels.expert_mlp(rows[:, :32], w["gate_up"], w["down"], offs)
    with pytest.raises(ValueError, match="do not agree"):
        kernels.expert_mlp(rows, w["gate_up"], w["down"], offs[:1])
    with pytest.raises(ValueError, match="contiguous"):
        kernels.expert_mlp(rows.t().contiguous().t(), w["gate_up"], w["down"], offs)


def test_a_worker_picks_the_kernels_by_rows_per_slot(monkeypatch):
    """ExpertStore.set_step_pairs: auto takes the Triton kernels while a step has at most
    EXPERT_MAX_BM rows per slot on average (decode), torch._grouped_mm above (prefill); the
    choice is part of what a captured graph bakes in (kernel_key); MOESERVE_EXPERT_KERNEL
    overrides it and a bad value is explained."""
    from expert_worker import store as store_mod

    spec = ExpertSpec(hidden_size=64, intermediate_size=32, dtype=torch.bfloat16)
    st = store_mod.ExpertStore(
        spec, 0, [torch.zeros(4, spec.numel, dtype=spec.dtype)], np.zeros((1, 4)), num_workers=2
    )  # 8 slots in all
    monkeypatch.setattr(store_mod, "grouped_mm_applies", lambda *a: True)  # as on CUDA with bf16
    monkeypatch.delenv("MOESERVE_EXPERT_KERNEL", raising=False)
    st.set_step_pairs(8 * 10)  # 10 rows per slot: passes of 32
    assert st.kernel_key == 32
    st.set_step_pairs(8 * 64)
    assert st.kernel_key == 64
    st.set_step_pairs(8 * 65)  # prefill-sized: torch._grouped_mm
    assert st.kernel_key == 0
    monkeypatch.setenv("MOESERVE_EXPERT_KERNEL", "triton")
    st.set_step_pairs(8 * 1000)
    assert st.kernel_key == 64
    monkeypatch.setenv("MOESERVE_EXPERT_KERNEL", "grouped_mm")
    st.set_step_pairs(8)
    assert st.kernel_key == 0
    monkeypatch.setenv("MOESERVE_EXPERT_KERNEL", "cutlass")
    with pytest.raises(ValueError, match="auto, triton, grouped_mm"):
        st.set_step_pairs(8)
    # the same choice, as benchmarks/calibrate.py measures the balancer's table through it
    assert [store_mod.expert_block_m_for(p, 8, "auto") for p in (8, 8 * 10, 8 * 65)] == [16, 32, 0]
    assert (
        store_mod.expert_block_m_for(8 * 65, 8, "triton") == 64
        and store_mod.expert_block_m_for(8, 8, "grouped_mm") == 0
    )
    monkeypatch.setattr(store_mod, "grouped_mm_applies", lambda *a: False)  # fp32, CPU: the slot loop
    monkeypatch.setenv("MOESERVE_EXPERT_KERNEL", "triton")
    st.set_step_pairs(8)
    assert st.kernel_key == 0


def test_fp8_steps_take_32_row_passes_where_a_slot_averages_17_to_32_rows(monkeypatch):
    """FP8 experts (half the bytes a pass re-reads) cap the rows per pass at 32 where the mean
    rows per slot is at most 32 (bf16 takes 64 there: twice the mean); below 17 and above 32 rows
    per slot both take the same passes; MOESERVE_EXPERT_BLOCK_M still fixes them."""
    from expert_worker import store as store_mod
    from moeserve.models.moe import ExpertQuant

    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.delenv("MOESERVE_EXPERT_KERNEL", raising=False)
    per_slot = (1, 8, 16, 17, 24, 32, 33, 64, 200)
    bf16 = [store_mod.expert_block_m_for(8 * n, 8, "triton") for n in per_slot]
    fp8 = [store_mod.expert_block_m_for(8 * n, 8, "triton", quantized=True) for n in per_slot]
    assert bf16 == [16, 16, 32, 64, 64, 64, 64, 64, 64]
    assert fp8 == [16, 16, 32, 32, 32, 32, 64, 64, 64]
    # a worker holding FP8 experts picks it per step (the store's kernel key, baked into graphs)
    spec = ExpertSpec(hidden_size=64, intermediate_size=32, dtype=torch.bfloat16, quant=ExpertQuant((64, 1), (32, 1)))
    buf = torch.zeros(4, spec.numel, dtype=spec.storage_dtype)
    st = store_mod.ExpertStore(spec, 0, [buf], np.zeros((1, 4)), num_workers=2)
    monkeypatch.setattr(store_mod, "fp8_kernel_applies", lambda *a: True)  # as on CUDA
    for n, want in ((20, 32), (10, 32), (40, 64), (1000, 64)):
        st.set_step_pairs(8 * n)
        assert st.kernel_key == want, (n, st.kernel_key)
    monkeypatch.setattr(store_mod, "expert_block_m_setting", lambda: 64)
    assert store_mod.expert_block_m_for(8 * 20, 8, "triton", quantized=True) == 64


def test_w8a8_prefill_steps_take_the_prefill_passes_where_the_switch_asks(monkeypatch):
    """MOESERVE_FP8_PREFILL_BLOCK_M (a measurement switch): 64 (the default) keeps W8A8 steps of
    more than EXPERT_MAX_BM rows a slot on 64-row passes; 128 gives them FP8_PREFILL_BM-row
    passes on their own tiles, and the worker's warm-up compiles those too; decode-sized steps,
    weight-only FP8 and MOESERVE_EXPERT_BLOCK_M are unchanged; anything else is refused by name
    when the worker starts."""
    from expert_worker import store as store_mod
    from moeserve.models.moe import ExpertQuant

    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.delenv("MOESERVE_EXPERT_KERNEL", raising=False)
    monkeypatch.delenv("MOESERVE_EXPERT_BLOCK_M", raising=False)
    store_mod.expert_block_m_setting.cache_clear()
    per_slot = (8, 20, 64, 65, 1000)
    try:
        for value, prefill in (("", 64), ("64", 64), ("128", kernels.FP8_PREFILL_BM)):
            monkeypatch.setenv("MOESERVE_FP8_PREFILL_BLOCK_M", value)
            store_mod.fp8_prefill_block_m.cache_clear()
            a8 = [store_mod.expert_block_m_for(8 * n, 8, "triton", quantized=True, a8=True) for n in per_slot]
            wo = [store_mod.expert_block_m_for(8 * n, 8, "triton", quantized=True) for n in per_slot]
            assert a8 == [16, 32, 64, prefill, prefill], value
            assert wo == [16, 32, 64, 64, 64], value
        # a worker of W8A8 experts picks them per step (the kernel key its graphs bake in) ...
        spec = ExpertSpec(64, 32, dtype=torch.bfloat16, quant=ExpertQuant((64, 1), (32, 1), act_quant=True))
        st = store_mod.ExpertStore(spec, 0, [torch.zeros(4, spec.numel, dtype=spec.storage_dtype)], np.zeros((1, 4)))
        monkeypatch.setattr(store_mod, "fp8_kernel_applies", lambda *a: True)  # as on CUDA
        st.set_step_pairs(4 * 500)
        assert st.kernel_key == kernels.FP8_PREFILL_BM
        st.set_step_pairs(4 * 20)
        assert st.kernel_key == 32
        # ... and compiles them before serving
        warmed = []
        monkeypatch.setattr(kernels, "warm_up_expert_mlp", lambda *a: warmed.append(a[-1]) or a[-1])
        assert st.warm_up_kernels() == [16, 32, 64, kernels.FP8_PREFILL_BM]
        monkeypatch.setenv("MOESERVE_FP8_PREFILL_BLOCK_M", "64")
        store_mod.fp8_prefill_block_m.cache_clear()
        assert st.warm_up_kernels() == [16, 32, 64]
        monkeypatch.setattr(store_mod, "expert_block_m_setting", lambda: 32)  # a fixed pass wins
        monkeypatch.setenv("MOESERVE_FP8_PREFILL_BLOCK_M", "128")
        store_mod.fp8_prefill_block_m.cache_clear()
        assert store_mod.expert_block_m_for(8 * 1000, 8, "triton", quantized=True, a8=True) == 32
        # the collective exchange's per-slot compute (grouped_forward) takes them by its fullest slot
        seen = []
        monkeypatch.setattr(kernels, "expert_mlp", lambda *a: seen.append(a[4]))
        w = spec.views(torch.zeros(2, spec.numel, dtype=spec.storage_dtype))
        for per_slot in ([100, 3], [64, 3]):
            store_mod.grouped_forward(spec, torch.zeros(sum(per_slot), 64, dtype=torch.bfloat16), w, per_slot)
        assert seen == [kernels.FP8_PREFILL_BM, 64]
        for bad in ("256", "32", "x"):
            monkeypatch.setenv("MOESERVE_FP8_PREFILL_BLOCK_M", bad)
            store_mod.fp8_prefill_block_m.cache_clear()
            with pytest.raises(ValueError, match=f"MOESERVE_FP8_PREFILL_BLOCK_M='{bad}': allowed 64 or 128"):
                store_mod.ExpertStore(spec, 0, [torch.zeros(4, spec.numel, dtype=spec.storage_dtype)], np.zeros((1, 4)))
    finally:
        monkeypatch.delenv("MOESERVE_FP8_PREFILL_BLOCK_M", raising=False)
        store_mod.fp8_prefill_block_m.cache_clear()


# -- FP8 weights -------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "blocks",
    [((96, 1), (40, 1)), ((16, 16), (16, 16)), ((32, 40), (40, 96))],
    ids=["per-channel", "block16", "per-tensor"],
)
def test_fp8_expert_kernels_equal_the_dequantizing_slot_loop(dtype, blocks):
    """Codes converted in registers and each tile (or the whole sum) scaled: fp32 equals the
    torch path that dequantizes first; bf16 within its rounding."""
    from moeserve.models.moe import ExpertQuant, ExpertSpec, grouped_expert_forward

    spec = ExpertSpec(96, 40, dtype=dtype, quant=ExpertQuant(*blocks))
    g = torch.Generator().manual_seed(3)
    buf = torch.stack(
        [
            spec.flat({"gate_up": torch.randn(96, 80, generator=g) / 9, "down": torch.randn(40, 96, generator=g) / 6})
            for _ in range(4)
        ]
    )
    w = spec.views(buf)
    counts = [5, 0, 17, 3]  # an empty slot, a slot of two passes of 16
    x = torch.randn(sum(counts), 96, generator=g).to(dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    ref = grouped_expert_forward(spec, x.float(), None, w, counts=counts)
    sc = kernels.ExpertScales(w["gate_up_scale"], blocks[0], w["down_scale"], blocks[1])
    got = kernels.expert_mlp(x, w["gate_up"], w["down"], offs, 16, sc).float()
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def _quant_rows_reference(x):
    """Per-row FP8 in torch: ``quant.quantize`` with one block per row."""
    from moeserve.models import quant as Q

    q, s = Q.quantize(x, (1, x.shape[1]))
    return q, s[:, 0]


def _w8a8_reference(spec, x, w, counts):
    """W8A8 in torch: each row quantized per row to e4m3 (``_quant_rows_reference``), times the
    dequantized weights in fp32, then the SwiGLU and the second quantization as the kernels do."""
    from moeserve.models.moe import activate

    d = spec.dense(w, torch.float32)
    out, start = [], 0
    for slot, c in enumerate(counts):
        r = x[start : start + c]
        start += c
        q, qs = _quant_rows_reference(r)
        gu = ((q.float() @ d["gate_up"][slot]) * qs[:, None]).to(x.dtype)
        h = activate(spec, gu)
        q2, qs2 = _quant_rows_reference(h)
        out.append(((q2.float() @ d["down"][slot]) * qs2[:, None]).to(x.dtype))
    return torch.cat(out)


@needs_triton
@pytest.mark.parametrize("blocks", [((96, 1), (40, 1)), ((16, 16), (16, 16))], ids=["per-channel", "block16"])
def test_w8a8_expert_kernels_equal_quantized_rows_times_the_dequantized_weights(blocks):
    """act_quant: rows (and the SwiGLU output) quantized per row to FP8 (max |x| / 448), both
    operands FP8 codes, the row's scale times the weights' on the sums: equals the same
    arithmetic in torch (products of e4m3 codes are exact in fp32), the tail past the device
    total (NaN) never read; and it is a different, coarser answer than weight-only."""
    from moeserve.models.moe import ExpertQuant, ExpertSpec, grouped_expert_forward

    spec = ExpertSpec(96, 40, dtype=torch.float32, quant=ExpertQuant(*blocks))  # fp32: no bf16 rounding flips
    g = torch.Generator().manual_seed(5)
    buf = torch.stack(
        [
            spec.flat({"gate_up": torch.randn(96, 80, generator=g) / 9, "down": torch.randn(40, 96, generator=g) / 6})
            for _ in range(4)
        ]
    )
    w = spec.views(buf)
    counts = [5, 0, 17, 3]
    m = sum(counts)
    x = torch.cat([torch.randn(m, 96, generator=g), torch.full((3, 96), float("nan"))])
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    sc = kernels.ExpertScales(w["gate_up_scale"], blocks[0], w["down_scale"], blocks[1], act_quant=True)
    got = kernels.expert_mlp(x, w["gate_up"], w["down"], offs, 16, sc)[:m].float()
    want = _w8a8_reference(spec, x[:m], w, counts).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weight_only = grouped_expert_forward(spec, x[:m], None, w, counts=counts)
    assert (got - weight_only).abs().max() > 1e-2  # the activations were quantized


@needs_triton
def test_quant_rows_equals_its_reference_and_skips_rows_past_the_total(monkeypatch):
    monkeypatch.setattr(kernels, "ROW_PROGRAMS", 4)  # fewer programs than rows: each takes several
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 300, generator=g).to(torch.bfloat16) * 7
    x[2] = 0  # a zero row: scale 1, codes 0
    q, s = kernels.quant_rows(x, torch.tensor([6], dtype=torch.int32))
    rq, rs = _quant_rows_reference(x[:6])
    torch.testing.assert_close(s[:6], rs)
    assert torch.equal(q[:6].float(), rq.float()) and s[2] == 1
    assert q[:6].float().abs().max() == 448  # each row's largest value maps to e4m3's largest
    assert torch.isfinite(q[:6].float()).all()


@needs_triton
def test_fp8_linear_equals_its_dequantized_weight():
    from moeserve.models import quant as Q

    g = torch.Generator().manual_seed(4)
    for block in [(1, 64), (16, 16), (48, 64)]:
        w = torch.randn(48, 64, generator=g)
        codes, scale = Q.quantize(w, block)
        x = torch.randn(7, 64, generator=g)
        want = x @ Q.dequantize(codes, scale, block, torch.float32).t()
        got = kernels.fp8_linear(x, codes.t().contiguous(), scale.t().contiguous(), (block[1], block[0]))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("block", [(1, 64), (48, 64)], ids=["per-channel", "per-tensor"])
def test_w8a8_linear_is_rows_quantized_per_row_through_an_fp8_gemm_with_row_wise_scales(block):
    """A QuantLinear with act_quant and one scale over K (per channel or per tensor) runs on CUDA
    as quant_rows + torch._scaled_mm: the row's codes times the weight's codes summed in fp32,
    times the row's scale and the channel's, rounded once to the rows' dtype."""
    from moeserve.models import quant as Q

    g = torch.Generator().manual_seed(8)
    w = torch.randn(48, 64, generator=g)
    codes, scale = Q.quantize(w, block)
    lin = Q.QuantLinear(codes, scale, block, act_quant=True)
    assert lin.scale_row().shape == (1, 48) and torch.equal(lin.scale_row()[0], scale.expand(48, 1)[:, 0])
    assert lin._scaled_mm_ok(torch.zeros(1, 64, dtype=torch.bfloat16))
    x = (torch.randn(7, 64, generator=g) * 3).to(torch.bfloat16)
    got = kernels.fp8_scaled_linear(x, lin.codes_kn(), lin.scale_row())
    xq, xs = Q.quantize(x.float(), (1, 64))
    want = ((xq.float() @ codes.float().t()) * xs * lin.scale_row()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-8, atol=1e-3)
    weight_only = x.float() @ lin.weight(torch.float32).t()
    assert (got.float() - weight_only).abs().max() > 1e-2  # the rows were quantized
    # block scales over K (and bf16 weights' shapes cuBLAS's FP8 GEMM cannot take) stay on the kernel
    bq, bs = Q.quantize(w, (16, 16))
    assert not Q.QuantLinear(bq, bs, (16, 16), act_quant=True)._scaled_mm_ok(x)
    oq, os_ = Q.quantize(torch.randn(40, 72, generator=g), (1, 72))
    assert not Q.QuantLinear(oq, os_, (1, 72), act_quant=True)._scaled_mm_ok(torch.zeros(1, 72, dtype=torch.bfloat16))


def test_fp8_scale_blocks_the_kernel_cannot_tile_are_said():
    assert kernels.fp8_blocks_supported(96, (96, 1)) and kernels.fp8_blocks_supported(512, (128, 128))
    assert not kernels.fp8_blocks_supported(96, (8, 8)) and not kernels.fp8_blocks_supported(96, (24, 24))


@needs_triton
def test_an_fp8_tile_without_its_transposed_flag_is_refused():
    """Every FP8 tile says whether its product runs transposed (no global default stands in):
    a bf16-shaped tile given to FP8 weights is refused by what it lacks."""
    from moeserve.models.moe import ExpertQuant

    spec = ExpertSpec(64, 32, dtype=torch.float32, quant=ExpertQuant((64, 1), (32, 1)))
    w = spec.views(torch.zeros(1, spec.numel, dtype=spec.storage_dtype))
    offs = torch.tensor([2], dtype=torch.int32)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match=r"FP8 tile \(64, 64, 4, 3\): want \(BN, BK, warps, stages, transposed\)"):
        kernels._expert_matmul(x, w["down"], offs, 16, (64, 64, 4, 3), False, w["down_scale"], (32, 1))
    for flag in (False, True):  # with the flag the same call runs
        out = kernels._expert_matmul(x, w["down"], offs, 16, (64, 64, 4, 3, flag), False, w["down_scale"], (32, 1))
        assert out.shape == (2, 64) and torch.equal(out, torch.zeros(2, 64))  # zero codes


def biased(h, i, counts, dtype, activation, seed=0, limit=0.5):
    """As ``setup``, for experts with biases and an activation (limit 0.5: the clamp acts on
    many of the unit-scale products)."""
    g = torch.Generator().manual_seed(seed)
    spec = ExpertSpec(h, i, activation, True, dtype, swiglu_alpha=1.702, swiglu_limit=limit)
    s = len(counts)
    buf = (torch.randn(s, spec.numel, generator=g) / h**0.5).to(dtype)
    w = spec.views(buf)
    w["gate_up_bias"].copy_(torch.randn(s, 2 * i, generator=g))
    w["down_bias"].copy_(torch.randn(s, h, generator=g))
    m = sum(counts)
    rows = torch.cat([torch.randn(m, h, generator=g).to(dtype), torch.full((3, h), float("nan"), dtype=dtype)])
    return spec, rows, w, torch.tensor(np.cumsum(counts), dtype=torch.int32), m


@pytest.mark.parametrize("activation", ["silu", "clamped_swiglu"])
@pytest.mark.parametrize("counts,block_m", [([3, 0, 20, 1, 7], 16), ([40, 2, 0, 17], 32)])
def test_biases_and_the_clamped_activation_in_fp32_match_the_slot_loop(activation, counts, block_m):
    from moeserve.expert_worker.store import expert_act

    spec, rows, w, offs, m = biased(64, 48, counts, torch.float32, activation)
    y = kernels.expert_mlp(rows, w["gate_up"], w["down"], offs, block_m, act=expert_act(spec, w))
    ref = reference(spec, rows, w, counts)
    torch.testing.assert_close(y[:m], ref, rtol=1e-5, atol=1e-5)
    plain = kernels.expert_mlp(rows, w["gate_up"], w["down"], offs, block_m)
    assert (plain[:m] - ref).abs().max() > 0.1, "the biases and the activation act"


def test_the_clamped_activation_in_bf16_rounds_as_the_torch_ops():
    """bf16, GPT-OSS's experts: the Triton kernels and the grouped_mm path (torch's ops of
    moe.activate around torch._grouped_mm, biases added by slot) against the slot loop. The
    interpreter truncates where the GPU rounds: within two bf16 steps of the largest output."""
    from moeserve.expert_worker.store import expert_act, grouped_mm_forward

    counts = [5, 0, 12, 3]
    spec, rows, w, offs, m = biased(64, 48, counts, torch.bfloat16, "clamped_swiglu", seed=3)
    ref = reference(spec, rows, w, counts).float()
    tri = kernels.expert_mlp(rows, w["gate_up"], w["down"], offs, 16, act=expert_act(spec, w)).float()
    grouped = grouped_mm_forward(spec, rows, w, offs).float()
    for y in (tri, grouped):
        err = (y[:m] - ref).abs()
        assert err.max() <= 2 * 2**-7 * ref.abs().max(), float(err.max())
    shifted = reference(spec, rows, {k: v.roll(1, 0) for k, v in w.items()}, counts).float()
    assert (shifted - ref).abs().max() > 0.1 * ref.abs().max()


def test_fp8_kernels_take_no_bias():
    spec, rows, w, offs, _ = biased(64, 32, [2, 3], torch.float32, "clamped_swiglu")
    sc = kernels.ExpertScales(torch.ones(2, 1, 2), (64, 32), torch.ones(2, 1, 1), (32, 64))
    with pytest.raises(ValueError, match="FP8 experts are SwiGLU without biases"):
        kernels.expert_mlp(rows, w["gate_up"], w["down"], offs, 16, sc, kernels.ExpertAct("clamped_swiglu"))


@pytest.mark.parametrize("a8", [False, True], ids=["weight-only", "w8a8"])
def test_fp8_block_scaled_rows_come_out_the_same_at_every_rows_per_pass(a8):
    """A step's rows per pass follows its slot count (EPLB on or off, redundant slots), so an FP8
    row must come out bitwise the same at 16, 32 and 64 rows per pass. With 128-wide K blocks of
    scales each K tile must cover one whole block at every BM: a 64-row pass of the weight-only
    down projection took K tiles of 64 (its table's), scaling each half-block's product apart,
    and an H100 found its rows not bitwise those of a 32-row pass."""
    from moeserve.models.moe import ExpertQuant

    h, i, blocks = 256, 256, ((128, 128), (128, 128))
    spec = ExpertSpec(h, i, dtype=torch.float32, quant=ExpertQuant(*blocks))
    g = torch.Generator().manual_seed(11)
    buf = torch.stack(
        [
            spec.flat({"gate_up": torch.randn(h, 2 * i, generator=g) / 16, "down": torch.randn(i, h, generator=g) / 16})
            for _ in range(2)
        ]
    )
    w = spec.views(buf)
    counts = [70, 9]  # a slot of two 64-row passes and one of a partial pass
    x = torch.randn(sum(counts), h, generator=g)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    sc = kernels.ExpertScales(w["gate_up_scale"], blocks[0], w["down_scale"], blocks[1], a8)
    bms = (16, 32, 64) + ((kernels.FP8_PREFILL_BM,) if a8 else ())  # W8A8 also at prefill's passes
    outs = {bm: kernels.expert_mlp(x, w["gate_up"], w["down"], offs, bm, sc) for bm in bms}
    for bm in bms[1:]:
        assert torch.equal(outs[bm], outs[16]), (bm, float((outs[bm] - outs[16]).abs().max()))


def test_w8a8_tiles_keep_k_tiles_of_128_and_the_transposed_product_at_every_rows_per_pass():
    """A W8A8 row's sums must not depend on its rows per pass (EPLB on = off): the products run
    transposed (the rows the MMA's N side) over K tiles of 128 codes at 16, 32 and 64 rows, in the
    table and in every expert shape's entries; a tile that broke this would pass the CPU's
    interpreter (which does not model the MMA shapes) and fail only on a GPU."""
    shapes = [None, *kernels.EXPERT_TUNING_SHAPES["w8a8"], *kernels.EXPERT_TUNING_SHAPES["bf16"]]
    for shape in shapes:
        for kind in ("gate_up", "down"):
            bms = (16, 32, 64, kernels.FP8_PREFILL_BM)
            tiles = {bm: kernels.expert_tuning(kind, bm, fp8=True, a8=True, shape=shape) for bm in bms}
            assert all(t[1] == 128 and t[4] is True for t in tiles.values()), (shape, kind, tiles)


@needs_triton
def test_silu_mul_quant_is_quant_rows_of_silu_mul_bitwise(monkeypatch):
    """The W8A8 down projection's input in one launch: the codes and scales of
    ``quant_rows(silu_mul(gu))`` bit for bit (a zero row's scale 1), every row written whatever
    the programs, and a gu that is not [C, 2I] contiguous refused by name."""
    monkeypatch.setattr(kernels, "ROW_PROGRAMS", 3)  # fewer programs than rows: each takes several
    g = torch.Generator().manual_seed(12)
    for dtype, i in [(torch.bfloat16, 300), (torch.float16, 64), (torch.bfloat16, 1536)]:
        gu = (torch.randn(7, 2 * i, generator=g) * 4).to(dtype)
        gu[3] = 0  # a zero row: h = 0, scale 1
        gu[5, i:] = 0  # up all zero: h = 0 too
        q, s = kernels.silu_mul_quant(gu)
        wq, ws = kernels.quant_rows(kernels.silu_mul(gu))
        assert q.dtype == torch.float8_e4m3fn and q.shape == (7, i) and s.shape == (7,)
        assert torch.equal(s, ws) and s[3] == 1 and s[5] == 1, dtype
        assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)), dtype
        assert q.float().abs().amax(1)[[0, 1, 2, 4, 6]].eq(448).all()
    assert kernels.silu_mul_quant(torch.empty(0, 8, dtype=torch.bfloat16))[0].shape == (0, 4)
    with pytest.raises(ValueError, match=r"silu_mul_quant: gu must be contiguous \[C, 2I\]"):
        kernels.silu_mul_quant(torch.zeros(4, 16, dtype=torch.bfloat16)[:, :8])


@needs_triton
def test_a_w8a8_swiglu_hands_its_down_projection_the_fused_codes_and_answers_the_same(monkeypatch):
    """A merged W8A8 SwiGLU (shared experts, dense MLPs) whose down projection runs cuBLAS's FP8
    GEMM quantizes silu * up in the same launch (``silu_mul_quant``) and gives the output of
    down(silu_mul(gate_up(x))) bit for bit; weight-only, a block-scaled down or the torch
    sequences (``MOESERVE_FUSED_NORMS=0``: NORM_DEVICES empty) keep the two-step path."""
    from moeserve.models import quant as Q
    from moeserve.models.layers import SwiGLU, silu_mul

    monkeypatch.setattr(kernels, "NORM_DEVICES", ("cuda", "cpu"))  # the interpreter stands for the GPU
    # takes_codes on CPU tensors (the CUDA check dropped), the rest of its conditions kept
    monkeypatch.setattr(
        Q.QuantLinear,
        "takes_codes",
        lambda self, x: x.dim() == 2 and x.shape[0] > 0 and self.act_quant and self._scaled_mm_ok(x),
    )
    calls = []
    real = kernels.silu_mul_quant
    monkeypatch.setattr(kernels, "silu_mul_quant", lambda gu: calls.append(gu.shape) or real(gu))
    g = torch.Generator().manual_seed(13)
    hdim, f = 64, 96
    gate_up = Q.QuantLinear(
        *Q.quantize(torch.randn(2 * f, hdim, generator=g) / 8, (1, hdim)), (1, hdim), act_quant=True
    )
    for block, a8, fused in [((1, f), True, True), ((1, f), False, False), ((16, 16), True, False)]:
        down = Q.QuantLinear(*Q.quantize(torch.randn(hdim, f, generator=g) / 8, block), block, act_quant=a8)
        mlp = SwiGLU(None, None, down, gate_up)
        x = (torch.randn(5, hdim, generator=g) * 2).to(torch.bfloat16)
        calls.clear()
        got = mlp(x)
        assert calls == ([(5, 2 * f)] if fused else []), (block, a8)
        want = down(silu_mul(gate_up(x)))
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), (block, a8)
    monkeypatch.setattr(kernels, "NORM_DEVICES", ())
    calls.clear()
    down = Q.QuantLinear(*Q.quantize(torch.randn(hdim, f, generator=g) / 8, (1, f)), (1, f), act_quant=True)
    SwiGLU(None, None, down, gate_up)(x)
    assert calls == []
