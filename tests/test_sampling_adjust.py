"""The sampling parameters that change logits before sampling (min_tokens, logit_bias, presence /
frequency / repetition penalties) and min_p, each against a straightforward reference written
from vLLM's semantics; and a router's state for them over real steps (moeserve.router.penalties
in a RouterRunner on the CPU): greedy tokens equal a per-token reference loop, also with
asynchronous steps, a step run again and a sequence recomputed after a preemption; prompt
logprobs over chunked prefill equal the log-softmax of the model's logits."""

import math

import numpy as np
import pytest
import torch
from test_router_runner import LocalExperts

from moeserve.dataplane.protocol import RouterWork, SeqWork
from moeserve.models import init_model, load_model
from moeserve.models.cache import StepBatch
from moeserve.router.runner import RouterRunner
from moeserve.sampling import LogitsAdjust, SamplingParams, SamplingTensors, adjust_logits, sample, thresholds

pytestmark = pytest.mark.timeout(120)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def reference_adjust(x, sp: SamplingParams, prompt, outputs):
    """One row, element by element, in vLLM's order: min_tokens, logit_bias, repetition, frequency
    and presence."""
    x = [float(v) for v in x]
    if len(outputs) < sp.min_tokens:
        for t in sp.stop_ids:
            x[t] = -math.inf
    for t, b in sp.logit_bias:
        x[t] += b
    for t in range(len(x)):
        c = outputs.count(t)
        if t in prompt or c:
            x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty * (c > 0)
    return x


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
    ],
)
def test_adjust_logits_equals_the_reference_row_by_row(device):
    rng = np.random.default_rng(0)
    v = 40
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(presence_penalty=0.5, frequency_penalty=-0.3),
        SamplingParams(min_tokens=5, stop_ids=(3, 7)),
        SamplingParams(logit_bias=((2, 100.0), (9, -3.5))),
        SamplingParams(
            repetition_penalty=0.6, frequency_penalty=2.0, logit_bias=((1, 1.0),), min_tokens=1, stop_ids=(1,)
        ),
    ]
    logits = torch.from_numpy(rng.normal(0, 3, (len(params), v)).astype(np.float32))
    prompts = [rng.integers(0, v, 6).tolist() for _ in params]
    outputs = [rng.integers(0, v, 4).tolist() for _ in params]
    outputs[4] = []  # fewer than min_tokens: its stop id is masked
    pen = [i for i, p in enumerate(params) if p.penalized]
    counts = torch.zeros(len(pen), v, dtype=torch.int32)
    seen = torch.zeros(len(pen), v, dtype=torch.bool)
    for q, i in enumerate(pen):
        for t in outputs[i]:
            counts[q, t] += 1
        seen[q, prompts[i]] = True
    mask = [(i, t) for i, p in enumerate(params) if len(outputs[i]) < p.min_tokens for t in p.stop_ids]
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    adj = LogitsAdjust(
        mask_rows=torch.tensor([i for i, _ in mask]),
        mask_ids=torch.tensor([t for _, t in mask]),
        bias_rows=torch.tensor([i for i, _, _ in bias]),
        bias_ids=torch.tensor([t for _, t, _ in bias]),
        bias=torch.tensor([b for _, _, b in bias]),
        pen_rows=torch.tensor(pen),
        counts=counts,
        seen=seen,
        presence=torch.tensor([params[i].presence_penalty for i in pen]),
        frequency=torch.tensor([params[i].frequency_penalty for i in pen]),
        repetition=torch.tensor([params[i].repetition_penalty for i in pen]),
    )
    adj = LogitsAdjust(**{f: getattr(adj, f).to(device) for f in adj.__dataclass_fields__})
    got = adjust_logits(logits.to(device), adj).cpu()
    for i, sp in enumerate(params):
        want = reference_adjust(logits[i], sp, prompts[i], outputs[i])
        np.testing.assert_allclose(got[i].numpy(), np.array(want, dtype=np.float32), rtol=1e-6, atol=1e-6)
    assert torch.equal(logits, logits.clone()), "the raw logits are untouched"


def reference_kept(x, sp: SamplingParams):
    """vLLM's kept set: softmax(x / T); min_p against the most likely; then top-k; then top-p
    over the renormalised rest (float64)."""
    z = np.asarray(x, dtype=np.float64) / sp.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p >= sp.min_p * p.max()
    if sp.top_k:
        kth = np.sort(z[keep])[::-1][min(sp.top_k, keep.sum()) - 1]
        keep &= z >= kth
    if sp.top_p < 1:
        q = np.where(keep, p, 0)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        before = np.cumsum(q[order]) - q[order]
        cut = q[order][before < sp.top_p].min()
        keep &= q >= cut
    return set(np.flatnonzero(keep).tolist())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kw",
    [
        dict(min_p=0.1),
        dict(min_p=0.5, temperature=2.0),
        dict(min_p=0.05, top_k=3),
        dict(min_p=0.02, top_p=0.6),
        dict(min_p=0.3, top_k=5, top_p=0.9, temperature=0.5),
        dict(min_p=1.0),
    ],
)
def test_min_p_keeps_what_vllm_keeps_before_top_k_and_top_p(kw, device):
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.normal(0, 2, (3, 64)).astype(np.float32))
    sp = SamplingParams(**{"temperature": 1.0, **kw})
    other = SamplingParams(temperature=1.0, top_k=4)  # a row that filters without min_p
    params = [sp, other, SamplingParams()]  # a greedy row too
    st = SamplingTensors.build(params, [0, 0, 0], [0, 0, 0], device)
    thr = thresholds(x.to(device), st).cpu()
    tok = sample(x.to(device), st).cpu()  # the race (Triton on CUDA) keeps to the kept set
    assert x[0, tok[0]] >= thr[0] and x[1, tok[1]] >= thr[1] and tok[2] == x[2].argmax()
    assert {i for i in range(64) if x[0, i] >= thr[0]} == reference_kept(x[0], sp)
    assert {i for i in range(64) if x[1, i] >= thr[1]} == reference_kept(x[1], other)
    assert thr[2] == float("-inf")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_p=1.5), r"min_p must be a number in \[0.0, 1.0\]"),
        (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2.0, 2.0\]"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty must be a number"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be a number in \(0.0, 10.0\]"),
        (dict(min_tokens=-1), "min_tokens must be an integer in 0.."),
        (dict(logit_bias=((3, 101.0),)), r"bias in \[-100, 100\]"),
    ],
)
def test_out_of_range_parameters_name_the_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# -- a router's state over steps ---------------------------------------------------------------

BS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("llama4"), "llama4", seed=5)


@pytest.fixture(scope="module", params=DEVICES)
def model(checkpoint, request):
    """The model on each device (a CUDA run checks the device paths: pinned copies, index_put_,
    the Triton race after the logits changed)."""
    return load_model(checkpoint, device=request.param)


@torch.inference_mode()
def reference_tokens(model, prompt, sp: SamplingParams, n):
    """Greedy tokens one at a time on the single-process model, each row changed by
    ``reference_adjust`` first."""
    cache = model.new_cache()
    ids, start, out = list(prompt), 0, []
    for _ in range(n):
        batch = StepBatch(seq_ids=(0,), lens=(len(ids),), starts=(start,))
        row = model.logits(model.step(torch.tensor(ids, device=model.device), batch, cache)[-1:])[0].float().cpu()
        x = reference_adjust(row, sp, list(prompt), out)
        out.append(int(np.argmax(np.array(x, dtype=np.float32))))
        start += len(ids)
        ids = [out[-1]]
    return out


def blocks(length):
    return tuple(range((length + BS - 1) // BS))


def run_router(model, prompt, sp, n, replay_at=None, preempt_at=None, chunk=None):
    """One sequence on a RouterRunner with asynchronous outputs: a prompt (in chunks of
    ``chunk``), then decodes by id; at ``preempt_at`` it is released and recomputed from prompt +
    outputs (start 0, out_pos = its outputs) in a fresh block table; ``replay_at``: that step runs
    twice (a lost peer)."""
    r = RouterRunner(model, LocalExperts(model), num_blocks=64, block_size=BS, async_outputs=True)
    out: list[int] = []
    step = 0

    def take(s):
        got = r.deliver(s)
        if got[0] >= 0:
            out.extend(got[1].values())

    def prefill(tokens, out_pos, base):
        nonlocal step
        size = chunk or len(tokens)
        for a in range(0, len(tokens), size):
            part = tuple(tokens[a : a + size])
            last = a + size >= len(tokens)
            sw = SeqWork(
                seq_id=1,
                token_ids=part,
                start=a,
                sampling=sp if a == 0 else None,
                new_blocks=tuple(b + base for b in blocks(a + len(part))[len(blocks(a)) if a else 0 :]),
                sample=last,
                out_pos=out_pos,
            )
            r.run(RouterWork((sw,)), step)
            take(step)
            step += 1

    prefill(list(prompt), 0, 0)
    length = len(prompt) + 1
    base = 0
    while len(out) + 1 < n:
        if step == preempt_at:
            r.release([1])  # a step without forward: delivers what was out
            take(step)
            step += 1
            base = 32
            prefill(list(prompt) + out, len(out), base)
            length = len(prompt) + len(out) + 1
            continue
        need = blocks(length)
        have = blocks(length - 1)
        new = [[1, b + base] for b in need[len(have) :]]
        work = RouterWork(decodes=np.array([1]), blocks=np.array(new, dtype=np.int64).reshape(-1, 2))
        r.run(work, step)
        if step == replay_at:
            first = r.deliver(step)
            r.run(work, step)
            assert r.deliver(step) == first
            if first[0] >= 0:
                out.extend(first[1].values())
        else:
            take(step)
        step += 1
        length += 1
    take(step)  # a step without forward: the last token
    return out[:n]


PROMPT = (5, 9, 13, 2, 7, 11, 3)
PENALIZED = [
    SamplingParams(seed=0, repetition_penalty=1.8),
    SamplingParams(seed=0, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(seed=0, frequency_penalty=2.0, logit_bias=((4, 3.0), (17, -50.0))),
]


@pytest.mark.parametrize("sp", PENALIZED, ids=["repetition", "presence+frequency", "frequency+bias"])
def test_a_router_samples_the_reference_tokens_with_each_parameter(model, sp):
    n = 10
    want = reference_tokens(model, PROMPT, sp, n)
    assert run_router(model, PROMPT, sp, n) == want
    assert run_router(model, PROMPT, sp, n, chunk=3) == want


def test_min_tokens_keeps_the_stop_ids_out_until_n_tokens(model):
    plain = reference_tokens(model, PROMPT, SamplingParams(seed=0), 10)
    sp = SamplingParams(seed=0, min_tokens=6, stop_ids=(plain[0], plain[3]))
    want = reference_tokens(model, PROMPT, sp, 10)
    assert want[0] != plain[0] and not set(want[:6]) & {plain[0], plain[3]}
    assert run_router(model, PROMPT, sp, 10) == want
    assert run_router(model, PROMPT, sp, 10, chunk=3) == want


def test_the_penalties_change_the_greedy_tokens(model):
    plain = reference_tokens(model, PROMPT, SamplingParams(seed=0), 10)
    for sp in PENALIZED[:3]:
        assert reference_tokens(model, PROMPT, sp, 10) != plain, sp


@pytest.mark.parametrize("sp", PENALIZED[:3], ids=["repetition", "presence+frequency", "frequency+bias"])
def test_a_step_run_again_and_a_recomputed_sequence_count_each_token_once(model, sp):
    n = 12
    want = reference_tokens(model, PROMPT, sp, n)
    assert run_router(model, PROMPT, sp, n, replay_at=4) == want
    assert run_router(model, PROMPT, sp, n, preempt_at=6) == want
    assert run_router(model, PROMPT, sp, n, preempt_at=6, chunk=4) == want


@torch.inference_mode()
def test_prompt_logprobs_over_chunks_are_the_log_softmax_of_the_models_logits(model):
    prompt = (5, 9, 13, 2, 7, 11, 3, 8, 1, 6)
    full = torch.log_softmax(model(torch.tensor([prompt], device=model.device))[0].float(), -1).cpu()  # [T, V]
    for chunk in (len(prompt), 4, 3):
        r = RouterRunner(model, LocalExperts(model), num_blocks=64, block_size=BS, async_outputs=False)
        parts = []
        for step, a in enumerate(range(0, len(prompt), chunk)):
            part = prompt[a : a + chunk]
            sw = SeqWork(
                seq_id=1,
                token_ids=part,
                start=a,
                sampling=SamplingParams(seed=0) if a == 0 else None,
                new_blocks=blocks(a + len(part))[len(blocks(a)) if a else 0 :],
                sample=a + chunk >= len(prompt),
                prompt_logprobs=3,
            )
            r.run(RouterWork((sw,)), step)
            parts.append(r.deliver(step)[3][1])
        lp = np.concatenate([p.logprob for p in parts])
        want = full[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy()
        np.testing.assert_allclose(lp, want, atol=1e-4)
        top = np.concatenate([p.top_ids for p in parts])
        assert (top == torch.topk(full[:-1], 3).indices.numpy()).all()
        rank = np.concatenate([p.rank for p in parts])
        want_rank = 1 + (full[:-1] > full[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])][:, None]).sum(-1)
        assert (rank == want_rank.numpy()).all()


# -- the leader's part ---------------------------------------------------------------------------


def _engine(seed=None):
    from moeserve.cluster.rank import initial_placement
    from moeserve.config import ClusterConfig, EplbConfig
    from moeserve.router.engine.leader import Engine, ModelShape

    cfg = ClusterConfig(model_dir="/nowhere", routers=1, workers=1, eplb=EplbConfig(), seed=seed)
    return Engine(cfg, ModelShape(1, 4, 1, 64, (2,), 100), initial_placement(cfg, 1, 4))


def test_the_leader_fills_min_tokens_stop_ids_and_draws_seeds_from_the_clusters_seed():
    from moeserve.router.engine.api import GenerateRequest, InvalidRequest

    def admitted(eng, **kw):
        return eng.submit(GenerateRequest((5, 6), 8, **kw)).req

    eng = _engine()
    req = admitted(eng, sampling=SamplingParams(min_tokens=3), stop_token_ids=(9,))
    assert req.sampling.stop_ids == (2, 9) and req.sampling.seed is not None  # EOS and the request's stop ids
    assert admitted(eng, sampling=SamplingParams(min_tokens=3), ignore_eos=True).sampling.stop_ids == ()
    seeds = [[admitted(e).sampling.seed for _ in range(3)] for e in (_engine(7), _engine(7), _engine(8))]
    assert seeds[0] == seeds[1] != seeds[2] and len(set(seeds[0])) == 3
    assert admitted(_engine(7), sampling=SamplingParams(seed=5)).sampling.seed == 5
    with pytest.raises(InvalidRequest, match="min_tokens .9. must be <= max_tokens .8."):
        admitted(eng, sampling=SamplingParams(min_tokens=9))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        admitted(eng, sampling=SamplingParams(logit_bias=((64, 1.0),)))
