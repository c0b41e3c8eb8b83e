"""The step header on the wire: int64 words in a preallocated buffer, not a pickled object.

Every step the leader broadcasts one ``StepHeader`` on the gloo control group (docs/
dataplane.md, "The header on the wire"). ``encode`` lays it out as int64 words; ``HeaderWire``
keeps one preallocated buffer of ``capacity`` words per rank and broadcasts it whole, once per
step; a header longer than the buffer (a step of long prompts, a migration step with many
moves) sends its remaining words in a second broadcast whose length every rank reads from the
first. A decode step of 256 sequences takes ~270 words (their ids, 8 bytes each, and the KV
blocks they gain), well inside the default 4,096 (32 KiB).

Layout (every field one int64 word; floats as their IEEE-754 bits; strings as UTF-8 bytes
packed 8 to a word, little-endian, after their byte count):

    MAGIC, total words, step, flags (forward, report, read_load, stop, warmup, migration, regroup,
    grammars), warmup bucket, warmup longest sequence, R routers, then per router:
        D decodes, K new blocks, N releases, Q sequences, decodes [D], blocks [K, 2],
        releases [N], then per sequence:
            seq_id, start, T tokens, B new blocks, out_pos, flags (sample, sampling, seed,
            logits "" / "last" / "all", adjust, prompt logprobs, grammar, prefix ids),
            [temperature, top_p, top_k, seed when sampling], [min_p, presence, frequency,
            repetition, min_tokens, S stop ids, N biased tokens, stop ids [S], (token, bias)
            [N, 2] when adjust], [top tokens per prompt position when prompt logprobs], [grammar
            id when grammar], [C, the cached prefix's ids [C] when prefix ids], tokens [T], new
            blocks [B]
    then, when the grammars flag is set: G grammars, D dropped ids, per grammar (id, kind,
    any_whitespace, its text as a string), dropped ids [D] (a grammar's text travels once,
    in the header that announces it; a sequence's header carries its id)
    then, when the migration flag is set: the id, staging slots, rollback, end, C commits,
    M moves, per commit (layer, version, P, S staged, E break-even counts, phy2log [P], staged
    [S, 2], break-even [E]), per move its 7 fields (``MoveOp`` order).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moeserve.dataplane.protocol import (
    _NO_BLOCKS,
    _NO_IDS,
    LayerCommit,
    MigrationOps,
    MoveOp,
    RouterWork,
    SeqWork,
    StepHeader,
)
from moeserve.grammar import KINDS, GrammarSpec
from moeserve.sampling import SamplingParams

MAGIC = 0x4D53_4844_0004  # "MSHD", layout 4
LAYOUT = 4
DEFAULT_CAPACITY = 4096  # words broadcast every step (32 KiB)
_FORWARD, _REPORT, _READ_LOAD, _STOP, _WARMUP, _MIGRATION, _REGROUP, _GRAMMARS = (1 << i for i in range(8))
_SAMPLE, _SAMPLING, _SEED = 1, 2, 4
_ADJUST, _PROMPT_LP, _GRAMMAR, _PREFIX_IDS = 1 << 5, 1 << 6, 1 << 7, 1 << 8  # bits 3-4: the logits mode
_LOGITS = {"": 0, "last": 1, "all": 2}
_LOGITS_NAME = {v: k for k, v in _LOGITS.items()}


class HeaderError(ValueError):
    """Words that are not a header of this layout (a bug or a foreign peer: never silent)."""


def _f2w(x: float) -> int:
    return int(np.array(float(x), dtype=np.float64).view(np.int64))


def _w2f(w) -> float:
    return float(np.array(int(w), dtype=np.int64).view(np.float64))


def _take_str(take) -> str:
    nbytes = int(take(1)[0])
    return take(-(-nbytes // 8)).astype("<i8").tobytes()[:nbytes].decode()


def _str_words(s: str) -> list[int]:
    b = s.encode()
    padded = b + b"\0" * (-len(b) % 8)
    return [len(b)] + np.frombuffer(padded, dtype="<i8").tolist()


def encode(h: StepHeader) -> np.ndarray:
    """The header as int64 words [W] (see the module docstring)."""
    flags = (
        _FORWARD * h.forward
        | _REPORT * h.report
        | _READ_LOAD * h.read_load
        | _STOP * h.stop
        | _WARMUP * (h.warmup is not None)
        | _MIGRATION * (h.migration is not None)
        | _REGROUP * h.regroup
        | _GRAMMARS * bool(h.grammars or h.drop_grammars)
    )
    wb, wl = h.warmup if h.warmup is not None else (0, 0)
    parts: list = []
    head = [MAGIC, 0, h.step, flags, wb, wl, len(h.work)]
    parts.append(head)
    for w in h.work:
        decodes = np.asarray(w.decodes, dtype=np.int64).reshape(-1)
        blocks = np.asarray(w.blocks, dtype=np.int64).reshape(-1, 2)
        parts.append([len(decodes), len(blocks), len(w.release), len(w.seqs)])
        parts.append(decodes)
        parts.append(blocks.reshape(-1))
        parts.append(list(w.release))
        for sw in w.seqs:
            sp = sw.sampling
            f = (
                _SAMPLE * bool(sw.sample)
                | _SAMPLING * (sp is not None)
                | _SEED * (sp is not None and sp.seed is not None)
                | _LOGITS[sw.return_logits or ""] << 3
                | _ADJUST * (sp is not None and (sp.adjusts or sp.min_p > 0))
                | _PROMPT_LP * (sw.prompt_logprobs >= 0)
                | _GRAMMAR * (sw.grammar >= 0)
                | _PREFIX_IDS * bool(sw.prefix_ids)
            )
            words = [sw.seq_id, sw.start, len(sw.token_ids), len(sw.new_blocks), sw.out_pos, f]
            if sp is not None:
                words += [_f2w(sp.temperature), _f2w(sp.top_p), sp.top_k, sp.seed if sp.seed is not None else 0]
                if f & _ADJUST:
                    words += [_f2w(sp.min_p), _f2w(sp.presence_penalty), _f2w(sp.frequency_penalty)]
                    words += [_f2w(sp.repetition_penalty), sp.min_tokens, len(sp.stop_ids), len(sp.logit_bias)]
                    words += list(sp.stop_ids)
                    for tok, bias in sp.logit_bias:
                        words += [tok, _f2w(bias)]
            if f & _PROMPT_LP:
                words.append(sw.prompt_logprobs)
            if f & _GRAMMAR:
                words.append(sw.grammar)
            if f & _PREFIX_IDS:
                words.append(len(sw.prefix_ids))
            parts.append(words)
            parts.append(sw.prefix_ids)
            parts.append(sw.token_ids)
            parts.append(sw.new_blocks)
    if flags & _GRAMMARS:
        words = [len(h.grammars), len(h.drop_grammars)]
        for gid, spec in h.grammars:
            words += [gid, KINDS.index(spec.kind), int(spec.any_whitespace)] + _str_words(spec.text)
        parts.append(words + list(h.drop_grammars))
    if h.migration is not None:
        m = h.migration
        words = _str_words(m.migration_id) + [
            m.begin_staging_slots,
            int(m.rollback),
            int(m.end),
            len(m.commits),
            len(m.moves),
        ]
        for c in m.commits:
            words += [c.moe_layer, c.version, len(c.phy2log), len(c.staged), len(c.breakeven)]
            words += list(c.phy2log) + [x for pair in c.staged for x in pair] + list(c.breakeven)
        for mv in m.moves:
            words += [mv.moe_layer, mv.slot, mv.logical, mv.src_worker, mv.src_slot, mv.dst_worker, mv.stage]
        parts.append(words)
    out = np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts])
    out[1] = len(out)
    return out


def decode(words: np.ndarray) -> StepHeader:
    """The header of ``encode``'s words (a copy: nothing refers to ``words`` afterwards)."""
    words = np.asarray(words, dtype=np.int64)
    if len(words) < 7 or int(words[0]) != MAGIC or int(words[1]) > len(words):
        raise HeaderError(
            f"not a step header of layout {LAYOUT}: magic {int(words[0]) if len(words) else None:#x}, "
            f"{int(words[1]) if len(words) > 1 else 0} words announced, {len(words)} received"
        )
    n = int(words[1])
    i = 7
    step, flags, wb, wl, routers = (int(x) for x in words[2:7])

    def take(k: int) -> np.ndarray:
        nonlocal i
        if k < 0 or i + k > n:
            raise HeaderError(f"step header of {n} words ends inside a field (word {i}, {k} more)")
        v = words[i : i + k]
        i += k
        return v

    work = []
    for _ in range(routers):
        d, k, nr, q = (int(x) for x in take(4))
        decodes = take(d).copy() if d else _NO_IDS
        blocks = take(2 * k).reshape(k, 2).copy() if k else _NO_BLOCKS
        release = tuple(take(nr).tolist())
        seqs = []
        for _ in range(q):
            seq_id, start, t, b, out_pos, f = (int(x) for x in take(6))
            sampling = None
            if f & _SAMPLING:
                temp, top_p, top_k, seed = take(4)
                extra: dict = {}
                if f & _ADJUST:
                    min_p, pres, freq, rep, min_tokens, ns, nb = take(7)
                    stop_ids = tuple(take(int(ns)).tolist())
                    pairs = take(2 * int(nb)).reshape(-1, 2).tolist()
                    extra = dict(
                        min_p=_w2f(min_p),
                        presence_penalty=_w2f(pres),
                        frequency_penalty=_w2f(freq),
                        repetition_penalty=_w2f(rep),
                        min_tokens=int(min_tokens),
                        stop_ids=stop_ids,
                        logit_bias=tuple((int(t), _w2f(b)) for t, b in pairs),
                    )
                sampling = SamplingParams(
                    temperature=_w2f(temp),
                    top_p=_w2f(top_p),
                    top_k=int(top_k),
                    seed=int(seed) if f & _SEED else None,
                    **extra,
                )
            plp = int(take(1)[0]) if f & _PROMPT_LP else -1
            grammar = int(take(1)[0]) if f & _GRAMMAR else -1
            prefix_ids = tuple(take(int(take(1)[0])).tolist()) if f & _PREFIX_IDS else ()
            token_ids = tuple(take(t).tolist())
            new_blocks = tuple(take(b).tolist())
            seqs.append(
                SeqWork(
                    seq_id=seq_id,
                    token_ids=token_ids,
                    start=start,
                    sampling=sampling,
                    return_logits=_LOGITS_NAME[(f >> 3) & 3],
                    new_blocks=new_blocks,
                    sample=bool(f & _SAMPLE),
                    out_pos=out_pos,
                    prompt_logprobs=plp,
                    grammar=grammar,
                    prefix_ids=prefix_ids,
                )
            )
        work.append(RouterWork(seqs=tuple(seqs), release=release, decodes=decodes, blocks=blocks))
    grammars: list[tuple[int, GrammarSpec]] = []
    drops: tuple[int, ...] = ()
    if flags & _GRAMMARS:
        ng, nd = (int(x) for x in take(2))
        for _ in range(ng):
            gid, kind, ws = (int(x) for x in take(3))
            if not 0 <= kind < len(KINDS):
                raise HeaderError(f"step header names grammar kind {kind}; kinds are 0..{len(KINDS) - 1}")
            grammars.append((gid, GrammarSpec(KINDS[kind], _take_str(take), bool(ws))))
        drops = tuple(take(nd).tolist())
    migration = None
    if flags & _MIGRATION:
        migration_id = _take_str(take)
        staging, rollback, end, nc, nm = (int(x) for x in take(5))
        commits = []
        for _ in range(nc):
            layer, version, p, s, e = (int(x) for x in take(5))
            phy2log = tuple(take(p).tolist())
            staged = tuple(tuple(pair) for pair in take(2 * s).reshape(s, 2).tolist())
            commits.append(
                LayerCommit(
                    moe_layer=layer, phy2log=phy2log, version=version, staged=staged, breakeven=tuple(take(e).tolist())
                )
            )
        moves = tuple(MoveOp(*(int(x) for x in take(7))) for _ in range(nm))
        migration = MigrationOps(
            migration_id=migration_id,
            begin_staging_slots=staging,
            commits=tuple(commits),
            rollback=bool(rollback),
            moves=moves,
            end=bool(end),
        )
    if i != n:
        raise HeaderError(f"step header announced {n} words but its fields end at word {i}")
    return StepHeader(
        step,
        forward=bool(flags & _FORWARD),
        work=tuple(work),
        migration=migration,
        report=bool(flags & _REPORT),
        read_load=bool(flags & _READ_LOAD),
        warmup=(wb, wl) if flags & _WARMUP else None,
        stop=bool(flags & _STOP),
        regroup=bool(flags & _REGROUP),
        grammars=tuple(grammars),
        drop_grammars=drops,
    )


class HeaderWire:
    """One rank's end of the header broadcast: a preallocated int64 buffer of ``capacity``
    words, broadcast whole from rank 0 (``src``) every step on the gloo ``group``; words past
    it follow in a second broadcast. The leader passes its header and gets it back; the other
    ranks pass None and get the decoded copy. ``alone``: the group is the leader alone (one
    rank serves the whole model), so there is nobody to send to: the header is not encoded."""

    def __init__(self, group, capacity: int = DEFAULT_CAPACITY, src: int = 0, alone: bool = False):
        if capacity < 8:
            raise ValueError(f"the header buffer needs at least 8 words, got {capacity}")
        self.group = group
        self.src = src
        self.alone = alone
        self.buf = torch.zeros(capacity, dtype=torch.int64)
        self.overflows = 0  # headers that needed the second broadcast

    def exchange(self, header: StepHeader | None) -> StepHeader:
        cap = self.buf.numel()
        view = self.buf.numpy()
        if header is not None and self.alone:  # the leader with no other rank
            return header
        if header is not None:  # the leader
            words = encode(header)
            view[: min(cap, len(words))] = words[:cap]
            dist.broadcast(self.buf, src=self.src, group=self.group)
            if len(words) > cap:
                self.overflows += 1
                dist.broadcast(torch.from_numpy(words[cap:].copy()), src=self.src, group=self.group)
            return header
        dist.broadcast(self.buf, src=self.src, group=self.group)
        n = int(view[1]) if int(view[0]) == MAGIC else 0
        if n > cap:
            self.overflows += 1
            rest = torch.empty(n - cap, dtype=torch.int64)
            dist.broadcast(rest, src=self.src, group=self.group)
            return decode(np.concatenate([view, rest.numpy()]))
        return decode(view[:n] if n else view)  # n == 0: not a header, decode says why
