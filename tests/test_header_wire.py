"""The step header's wire layout (moeserve.dataplane.header_wire): every field round-trips, the
fixed buffer overflows into a second broadcast, and bad words are refused (the cluster tests run
it on real gloo groups every step)."""

import numpy as np
import pytest

from moeserve.dataplane import header_wire as hw
from moeserve.dataplane.protocol import LayerCommit, MigrationOps, MoveOp, RouterWork, SeqWork, StepHeader
from moeserve.grammar import GrammarSpec
from moeserve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)


def adjust(rng) -> dict:
    """The sampling parameters that change logits before sampling (any subset, any values)."""
    return dict(
        min_p=float(rng.choice([0.0, 0.05, 1.0])),
        presence_penalty=float(rng.choice([0.0, -2.0, 0.3])),
        frequency_penalty=float(rng.choice([0.0, 2.0, -0.7])),
        repetition_penalty=float(rng.choice([1.0, 1.3, 1e-3])),
        min_tokens=int(rng.integers(0, 40)),
        stop_ids=tuple(int(x) for x in rng.integers(0, 202048, int(rng.integers(0, 4)))),
        logit_bias=tuple((int(t), float(b)) for t, b in zip(rng.integers(0, 202048, 3), [-100.0, 0.25, 100.0]))[
            : int(rng.integers(0, 4))
        ],
    )


def random_header(rng, routers=2, prompts=3, migration=True, long_prompt=0):
    work = []
    for _r in range(routers):
        seqs = []
        for _q in range(prompts):
            sampling = None
            if rng.random() < 0.7:
                sampling = SamplingParams(
                    temperature=float(rng.choice([0.0, 0.7, 1e-6, 1e30])),
                    top_p=float(rng.choice([1.0, 0.9])),
                    top_k=int(rng.integers(0, 50)),
                    seed=None if rng.random() < 0.3 else int(rng.integers(0, 2**63 - 1)),
                    **(adjust(rng) if rng.random() < 0.5 else {}),
                )
            n = long_prompt or int(rng.integers(1, 40))
            seqs.append(
                SeqWork(
                    seq_id=int(rng.integers(1, 10**9)),
                    token_ids=tuple(int(x) for x in rng.integers(0, 202048, n)),
                    start=int(rng.integers(0, 5000)),
                    sampling=sampling,
                    return_logits=str(rng.choice(["", "last", "all"])),
                    new_blocks=tuple(int(x) for x in rng.integers(0, 10**6, int(rng.integers(0, 4)))),
                    sample=bool(rng.random() < 0.5),
                    out_pos=int(rng.integers(0, 1000)),
                    prompt_logprobs=int(rng.choice([-1, 0, 5])),
                    grammar=int(rng.choice([-1, 0, 7, 2**40])) if sampling is not None else -1,
                    prefix_ids=tuple(int(x) for x in rng.integers(0, 202048, int(rng.integers(1, 70))))
                    if sampling is not None and rng.random() < 0.4
                    else (),
                )
            )
        d = int(rng.integers(0, 300))
        k = int(rng.integers(0, 20))
        work.append(
            RouterWork(
                seqs=tuple(seqs),
                release=tuple(int(x) for x in rng.integers(1, 10**6, int(rng.integers(0, 5)))),
                decodes=rng.integers(1, 10**9, d).astype(np.int64),
                blocks=rng.integers(0, 10**6, (k, 2)).astype(np.int64),
            )
        )
    mig = None
    if migration:
        commits = tuple(
            LayerCommit(
                moe_layer=int(rng.integers(0, 48)),
                phy2log=tuple(int(x) for x in rng.integers(0, 256, 18)),
                version=int(rng.integers(1, 100)),
                staged=((3, 0), (17, 1)),
                breakeven=tuple(int(x) for x in rng.integers(0, 64, 16)) if rng.random() < 0.5 else (),
            )
            for _ in range(2)
        )
        moves = tuple(MoveOp(*(int(x) for x in rng.integers(0, 300, 7))) for _ in range(5))
        mig = MigrationOps(
            migration_id="mig-ünïcode-7",
            begin_staging_slots=4,
            commits=commits,
            rollback=bool(rng.random() < 0.5),
            moves=moves,
            end=bool(rng.random() < 0.5),
        )
    return StepHeader(
        int(rng.integers(0, 2**40)),
        forward=True,
        work=tuple(work),
        migration=mig,
        report=bool(rng.random() < 0.5),
        read_load=bool(rng.random() < 0.5),
        warmup=(16, 300) if rng.random() < 0.3 else None,
        grammars=GRAMMARS[: int(rng.integers(0, len(GRAMMARS) + 1))],
        drop_grammars=tuple(int(x) for x in rng.integers(0, 10**6, int(rng.integers(0, 3)))),
    )


GRAMMARS = (
    (3, GrammarSpec("json_schema", '{"type": "object", "properties": {"naïve": {"enum": ["é", "x"]}}}')),
    (4, GrammarSpec("json_object", "", any_whitespace=False)),
    (9, GrammarSpec("regex", r"\d{3}-[a-z]+")),
    (2**33, GrammarSpec("ebnf", 'root ::= "yes" | "no"' + " " * 13)),
)


def same(a: StepHeader, b: StepHeader):
    assert (a.step, a.forward, a.report, a.read_load, a.warmup, a.stop, a.migration, a.grammars, a.drop_grammars) == (
        b.step,
        b.forward,
        b.report,
        b.read_load,
        b.warmup,
        b.stop,
        b.migration,
        b.grammars,
        b.drop_grammars,
    )
    assert len(a.work) == len(b.work)
    for x, y in zip(a.work, b.work):
        assert x.seqs == y.seqs and x.release == y.release
        assert np.array_equal(x.decodes, y.decodes) and x.decodes.dtype == y.decodes.dtype == np.int64
        assert np.array_equal(x.blocks.reshape(-1, 2), y.blocks) and y.blocks.shape[1] == 2


@pytest.mark.parametrize("seed", range(6))
def test_every_field_round_trips(seed):
    rng = np.random.default_rng(seed)
    h = random_header(rng, migration=seed % 2 == 0)
    words = hw.encode(h)
    assert words.dtype == np.int64 and words[1] == len(words)
    same(h, hw.decode(words))


def test_heartbeats_stops_and_empty_routers_round_trip():
    for h in (
        StepHeader(0),
        StepHeader(5, stop=True),
        StepHeader(9, forward=True, work=(RouterWork(), RouterWork())),
        StepHeader(3, warmup=(256, 1)),
        StepHeader(4, report=True, read_load=True),
        StepHeader(6, drop_grammars=(1, 2)),
        StepHeader(8, grammars=GRAMMARS[:1]),
    ):
        same(h, hw.decode(hw.encode(h)))


def test_a_decode_step_costs_one_word_per_sequence():
    decodes = np.arange(1, 257, dtype=np.int64)
    h = StepHeader(7, forward=True, work=(RouterWork(decodes=decodes, blocks=np.array([[5, 9]], dtype=np.int64)),))
    assert len(hw.encode(h)) == 7 + 4 + 256 + 2


def test_bad_words_are_refused_with_what_was_wrong():
    h = random_header(np.random.default_rng(1), migration=False)
    words = hw.encode(h)
    bad = words.copy()
    bad[0] = 123
    with pytest.raises(hw.HeaderError, match="not a step header"):
        hw.decode(bad)
    with pytest.raises(hw.HeaderError, match="not a step header"):
        hw.decode(words[: len(words) // 2])  # fewer words than announced
    short = words.copy()
    short[7] = 10**6  # router 0's decode count runs past the end
    with pytest.raises(hw.HeaderError, match="ends inside a field"):
        hw.decode(short)


class FakeBroadcast:
    """dist.broadcast between one leader and followers in one process: the leader's calls are
    recorded, and each follower's calls are answered with them in order."""

    def __init__(self):
        self.sent = []
        self.recv_at = 0

    def __call__(self, tensor, src=0, group=None):
        if group == "leader":
            self.sent.append(tensor.clone())
        else:
            t = self.sent[self.recv_at]
            self.recv_at += 1
            assert t.numel() == tensor.numel(), "a follower's broadcast must have the leader's size"
            tensor.copy_(t)


@pytest.mark.parametrize("long_prompt,broadcasts", [(0, 1), (3000, 2)])
def test_the_buffer_is_broadcast_whole_and_a_long_header_overflows_once(monkeypatch, long_prompt, broadcasts):
    fake = FakeBroadcast()
    monkeypatch.setattr(hw.dist, "broadcast", fake)
    leader, follower = hw.HeaderWire("leader", capacity=1024), hw.HeaderWire("follower", capacity=1024)
    buf = leader.buf
    for step in range(3):
        h = random_header(np.random.default_rng(step), prompts=2, long_prompt=long_prompt)
        assert leader.exchange(h) is h
        same(h, follower.exchange(None))
        assert leader.buf is buf  # preallocated: the same buffer every step
    assert len(fake.sent) == 3 * broadcasts and all(t.numel() == 1024 for t in fake.sent[::broadcasts])
    assert leader.overflows == follower.overflows == 3 * (broadcasts - 1)


def test_a_buffer_too_small_is_refused():
    with pytest.raises(ValueError, match="at least 8 words"):
        hw.HeaderWire(None, capacity=4)


def test_a_sequence_started_on_cached_blocks_keeps_its_table_start_and_freshness():
    """Prefix caching sends a new sequence's whole block table (the cached blocks first) and its
    cached length as its start: both round-trip, and it stays fresh (its sampling parameters)."""
    fresh = SeqWork(seq_id=7, token_ids=(4, 5), start=32, sampling=SamplingParams(seed=3), new_blocks=(9, 2, 11))
    chunk = SeqWork(seq_id=8, token_ids=(6,), start=40, new_blocks=(12,))
    back = hw.decode(hw.encode(StepHeader(5, forward=True, work=(RouterWork(seqs=(fresh, chunk)),))))
    got = back.work[0].seqs
    assert got == (fresh, chunk) and got[0].fresh and not got[1].fresh
    # a penalized one also carries the ids of its cached prefix, which its router's penalty counts
    pen = fresh._replace(sampling=SamplingParams(seed=3, repetition_penalty=1.2), prefix_ids=tuple(range(100, 132)))
    (got,) = hw.decode(hw.encode(StepHeader(6, forward=True, work=(RouterWork(seqs=(pen,)),)))).work[0].seqs
    assert got == pen and got.prefix_ids == tuple(range(100, 132)) and got.token_ids == (4, 5)


def test_a_leader_alone_sends_nothing(monkeypatch):
    """One rank serves the whole model (its control group is itself): the header is neither
    encoded nor broadcast, and the leader gets its own header back."""
    fake = FakeBroadcast()
    monkeypatch.setattr(hw.dist, "broadcast", fake)
    monkeypatch.setattr(hw, "encode", lambda h: pytest.fail("encoded with nobody to send it to"))
    alone = hw.HeaderWire("leader", capacity=1024, alone=True)
    h = random_header(np.random.default_rng(0), prompts=2)
    assert alone.exchange(h) is h
    assert fake.sent == []
