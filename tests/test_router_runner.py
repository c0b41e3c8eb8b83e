"""A router's share of steps (moeserve.router.runner.RouterRunner) on the CPU, without ranks:
the model's own experts stand in for the exchange. Asynchronous steps: decodes are sent by id
and read the token the sequence sampled before from the device; a step's tokens are handed
out with the next step; a step run again (after a lost peer) reads the same inputs and gives
the same tokens."""

from types import SimpleNamespace

import numpy as np
import pytest

from moeserve.dataplane.protocol import RouterWork, SeqWork
from moeserve.models import init_model, load_model
from moeserve.router.runner import RouterRunner
from moeserve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)
BS = 4


class LocalExperts:
    """The runner's experts backend over the model's local experts (no exchange)."""

    def __init__(self, model):
        self.local = model.experts
        self.exchange = SimpleNamespace(device=model.device)
        self.step = 0
        self.ended = 0

    def dispatch(self, moe_layer, hidden, routing):
        return self.local.dispatch(moe_layer, hidden, routing)

    def combine(self, handle):
        return self.local.combine(handle)

    def end_step(self):
        self.ended += 1


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(init_model(tmp_path_factory.mktemp("llama4"), "llama4", seed=5))


def runner(model, async_outputs=True):
    return RouterRunner(model, LocalExperts(model), num_blocks=32, block_size=BS, async_outputs=async_outputs)


PROMPTS = {1: (5, 9, 13, 2, 7), 2: (11, 3, 8)}
GREEDY = SamplingParams(temperature=0.0, seed=0)
NEW_BLOCKS = {(2, 1): 3, (1, 4): 4}  # (sequence, step) -> the block it gains


def first_step():
    """Both prompts, each sampling its first token (blocks 0-1 and 2)."""
    return RouterWork(
        (
            SeqWork(seq_id=1, token_ids=PROMPTS[1], start=0, sampling=GREEDY, new_blocks=(0, 1)),
            SeqWork(seq_id=2, token_ids=PROMPTS[2], start=0, sampling=GREEDY, new_blocks=(2,)),
        )
    )


def decode_steps(r, n, replay_at=None):
    """Step 0: the prompts; steps 1..n: both sequences decode by id (sequence 2 gains block 3 at
    step 1, sequence 1 block 4 at step 4). Returns every token each sequence sampled, in order."""
    got = {1: [], 2: []}

    def take(step):
        s, toks, _, _ = r.deliver(step)
        if s >= 0:
            for sid, t in toks.items():
                got[sid].append(t)

    r.run(first_step(), 0)
    take(0)
    for step in range(1, n + 1):
        blocks = np.array([[sid, b] for (sid, at), b in NEW_BLOCKS.items() if at == step], dtype=np.int64).reshape(
            -1, 2
        )
        work = RouterWork(decodes=np.array([1, 2], dtype=np.int64), blocks=blocks)
        r.run(work, step)
        if step == replay_at:  # the step's gather failed: the same step again
            first = r.deliver(step)
            r.run(work, step)
            assert r.deliver(step) == first  # the same answer as the lost one
        take(step)
    take(n + 1)  # a flush step: the last tokens
    return got


def test_decodes_sent_by_id_give_the_tokens_of_decodes_sent_with_their_ids(model):
    """The reference feeds each sampled token back explicitly as a prompt chunk (the leader's
    old way); the runner's decodes by id read the same tokens from its device buffer."""
    got = decode_steps(runner(model), 4)
    ref = runner(model, async_outputs=False)
    want = {1: [], 2: []}
    s, toks, _, _ = (ref.run(first_step(), 0), ref.deliver(0))[1]
    for sid, t in toks.items():
        want[sid].append(t)
    for step in range(1, 5):
        seqs = tuple(
            SeqWork(
                seq_id=sid,
                token_ids=(want[sid][-1],),
                start=len(PROMPTS[sid]) + step - 1,
                new_blocks=(NEW_BLOCKS[sid, step],) if (sid, step) in NEW_BLOCKS else (),
                out_pos=step,
            )
            for sid in (1, 2)
        )
        ref.run(RouterWork(seqs), step)
        s, toks, _, _ = ref.deliver(step)
        assert s == step  # synchronous outputs: this step's tokens
        for sid, t in toks.items():
            want[sid].append(t)
    assert got == want and len(got[1]) == 5


def test_a_step_run_again_reads_the_token_of_the_step_before_not_its_own(model):
    want = decode_steps(runner(model), 4)
    for at in (1, 2, 4):
        assert decode_steps(runner(model), 4, replay_at=at) == want, at


def test_outputs_come_one_step_late_and_a_step_without_forward_flushes_them(model):
    r = runner(model)
    r.run(first_step(), 0)
    assert r.deliver(0) == (-1, {}, {}, {})  # nothing before step 0
    s, toks, _, _ = r.deliver(1)  # step 1 is a flush (no forward): step 0's tokens
    assert s == 0 and set(toks) == {1, 2}
    assert r.deliver(2) == (-1, {}, {}, {})
    assert r.experts.ended == 1


class GraphExperts(LocalExperts):
    """LocalExperts with the calls ``DecodeGraphs`` makes of the direct exchange (no-ops here)."""

    def __init__(self, model):
        super().__init__(model)
        self.exchange = SimpleNamespace(
            device=model.device,
            prepare_step_graphs=lambda layers: None,
            set_step_args=lambda pairs, key: None,
            valid_pairs=None,
        )
        self.router = 0


def test_mixed_and_decode_steps_through_the_graph_buffers_give_the_eager_tokens(model):
    """With graphs (on the CPU: the padded buffers, run eagerly) the prompts' step and a step
    that decodes beside a new prompt's first chunk (which samples nothing) take the mixed-step
    path, the decodes the decode path: every token equals the runner's without graphs."""

    def steps(r):
        got = {1: [], 2: [], 3: []}

        def take(step):
            s, toks, _, _ = r.deliver(step)
            for sid, t in toks.items():
                got[sid].append(t)

        r.run(first_step(), 0)
        take(0)
        chunk = SeqWork(
            seq_id=3, token_ids=(4, 6, 8, 10, 12), start=0, sampling=GREEDY, new_blocks=(5, 6), sample=False
        )
        r.run(RouterWork((chunk,), decodes=np.array([1, 2], dtype=np.int64), blocks=np.array([[2, 3]])), 1)
        take(1)
        rest = SeqWork(seq_id=3, token_ids=(14, 16), start=5)
        r.run(RouterWork((rest,), decodes=np.array([1, 2], dtype=np.int64)), 2)
        take(2)
        for step in range(3, 6):
            blocks = np.array([[1, 4], [3, 7]] if step == 4 else [], dtype=np.int64).reshape(-1, 2)
            r.run(RouterWork(decodes=np.array([1, 2, 3], dtype=np.int64), blocks=blocks), step)
            take(step)
        take(6)
        return got

    g = RouterRunner(model, GraphExperts(model), num_blocks=32, block_size=BS, async_outputs=True, graphs=(4, 64, 64))
    got = steps(g)
    assert got == steps(runner(model)) and len(got[3]) == 4
    assert {("mixed", 64, 4)} <= g.graphs.seen and any(k[0] != "mixed" for k in g.graphs.seen)


def test_a_mixed_steps_fresh_prompts_are_its_last_rows_so_a_prefill_backend_takes_them(model, monkeypatch):
    """A step's rows: the decodes, then the sequences that continue (a later chunk), then the
    fresh prompts (from position 0), whatever order the header sent them in: the prefill
    backends (``MOESERVE_ATTENTION_PREFILL=flash|sdpa``) take only the trailing run of fresh
    prompts (``PagedBatch.build``'s ``FreshSuffix``), which decodes listed after the prompts
    left empty in every mixed step. The tokens are those of the same steps with the split off."""
    import moeserve.router.runner as runner_mod
    from moeserve.models import paged

    built = []
    real = runner_mod.PagedBatch.build

    def spy(num_new, starts, tables, *a, **kw):
        batch = real(num_new, starts, tables, *a, **kw)
        built.append((list(starts), list(num_new), batch.fresh))
        return batch

    monkeypatch.setattr(runner_mod.PagedBatch, "build", staticmethod(spy))
    chunked, fresh = (21, 4, 17, 6, 9, 30), (8, 12, 5)

    def steps(split: bool) -> dict:
        monkeypatch.setitem(paged.SPLIT_FRESH, "on", split)
        r, got = runner(model), {}
        r.run(
            RouterWork(
                (
                    SeqWork(seq_id=1, token_ids=PROMPTS[1], start=0, sampling=GREEDY, new_blocks=(0, 1)),
                    SeqWork(seq_id=2, token_ids=chunked[:4], start=0, sampling=GREEDY, new_blocks=(2,), sample=False),
                )
            ),
            0,
        )
        step1 = RouterWork(
            (  # the fresh prompt first, the continuing chunk after it; the decode by id
                SeqWork(seq_id=3, token_ids=fresh, start=0, sampling=GREEDY, new_blocks=(4,)),
                SeqWork(seq_id=2, token_ids=chunked[4:], start=4, new_blocks=(3,), out_pos=0),
            ),
            decodes=np.array([1], dtype=np.int64),
        )
        for step in (0, 1, 2):  # async outputs: a step's tokens come with the next (2: the flush)
            if step == 1:
                r.run(step1, 1)
            s, toks, _, _ = r.deliver(step)
            got.update({(sid, s): t for sid, t in toks.items()} if s >= 0 else {})
        return got

    want = steps(False)
    assert built[-1][:2] == ([5, 4, 0], [1, 2, 3]) and built[-1][2] is None  # the split off: no suffix
    built.clear()
    assert steps(True) == want
    starts, num_new, suffix = built[-1]
    assert starts == [5, 4, 0] and num_new == [1, 2, 3]
    assert suffix is not None and suffix.first_seq == 2 and suffix.lens == (3,)
    assert {sid for sid, _ in want} == {1, 2, 3}
