"""A router rank's share of a step: attention, gate and shared experts for its sequences.

Dimension letters: T new tokens of this router in the step, S its sequences in the step, B the
sequences that sample a token, H hidden, V vocabulary.

The router holds everything of the model but the routed experts (``load_model(...,
load_experts=False)``), one paged KV pool, and per sequence its block table and sampling
parameters. Sequences are pinned to one router for their whole life; the leader says which,
and which KV blocks each one gains (the runner never allocates). A step runs every sequence
through the model at once (batched attention over the block tables), then samples the rows
that need a token in one call on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from moeserve.dataplane.exchange import idle_walk
from moeserve.dataplane.protocol import RouterWork, SeqWork
from moeserve.dataplane.roles import LoadSnapshot
from moeserve.models.paged import PagedBatch, PagedKVCache
from moeserve.ops.profiling import span
from moeserve.router import penalties
from moeserve.router.dispatcher import DistributedExperts
from moeserve.router.grammars import GrammarBook, SeqGrammar
from moeserve.sampling import (
    SamplingParams,
    SamplingTensors,
    adjust_logits,
    apply_token_bitmask,
    prompt_logprobs,
    sample,
)


class _Outputs:
    """What one forward step sampled, on its way to the host: ``ids`` the sampled sequences,
    ``host`` int64 [B] (pinned on CUDA) filled by a copy behind ``event``; ``logits`` the fp32
    logits asked for (already on the host); ``plp`` the prompt logprobs of the step's chunks."""

    __slots__ = ("step", "ids", "host", "event", "logits", "plp")

    def __init__(self, step: int, ids: list[int], host, event, logits: dict, plp: dict | None = None):
        self.step, self.ids, self.host, self.event, self.logits = step, ids, host, event, logits
        self.plp = plp or {}

    def tokens(self) -> dict[int, int]:
        if self.event is not None:
            self.event.synchronize()
        return dict(zip(self.ids, self.host.tolist())) if self.ids else {}

    def token(self, j: int) -> int:
        """Row j's token, once its copy landed (a constrained sequence's matcher takes it)."""
        if self.event is not None:
            self.event.synchronize()
        return int(self.host[j])


class RouterSeq:
    """One sequence on its router: its KV block ids (``table``), sampling parameters and the
    seed the leader gave them, the tokens in its KV cache after the last step (``length``), the
    output index of the next token it samples (``out``), the request's ``return_logits``
    (``mode``), and its entry in the runner's ``tok_buf`` (``tok``: slots 2 tok and 2 tok + 1;
    ``cur``: the one holding its latest sampled token). A penalized sequence (``router.penalties``)
    also keeps the tokens the leader sent since its (re)start until its first sample (``known``),
    its slot of the penalty pool and how many of its outputs are counted there; a sequence whose
    prompt logprobs are asked keeps the last hidden row of its previous prefill chunk (``carry``
    [H]: its logits score the first token of the next chunk); a constrained one its matcher
    (``grammar``, ``router.grammars``)."""

    __slots__ = (
        "table",
        "sampling",
        "seed",
        "length",
        "out",
        "mode",
        "tok",
        "cur",
        "known",
        "pen_slot",
        "counted",
        "carry",
        "grammar",
    )

    def __init__(self, table: list[int], sampling: SamplingParams, mode: str):
        if sampling.seed is None:
            raise ValueError("a sequence's sampling parameters reach its router with their seed set (by the leader)")
        self.table = table
        self.sampling = sampling
        self.seed: int = sampling.seed
        self.mode = mode
        self.length = 0
        self.out = 0
        self.tok: int | None = None
        self.cur = 0
        self.known: list[int] | None = [] if sampling.penalized else None
        self.pen_slot: int | None = None
        self.counted: int | None = None
        self.carry: dict[int, torch.Tensor] | None = None
        self.grammar: SeqGrammar | None = None


class RouterRunner:
    """Runs ``RouterWork`` on the router-side model with the distributed experts backend.
    ``num_blocks`` x ``block_size``: the rank's KV pool as the leader allocates it.

    With ``graphs`` (``max_num_seqs``, ``max_model_len``[, ``max_num_batched_tokens``]; see
    ``moeserve.router.graphs``) decode steps, and mixed steps of up to 2,048 tokens, replay CUDA
    graphs; the pool then has one more block, the padded rows' scratch block.
    ``async_outputs``: a step's sampled tokens are delivered with the next step's result."""

    def __init__(
        self,
        model,
        experts: DistributedExperts,
        num_blocks: int,
        block_size: int,
        graphs: tuple[int, ...] | None = None,
        async_outputs: bool = False,
        grammars: GrammarBook | None = None,
    ):
        self.model = model
        self.experts = experts
        self.device = experts.exchange.device
        self.cuda = self.device.type == "cuda"
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.async_outputs = async_outputs
        self.cache: PagedKVCache = model.new_paged_cache(num_blocks + (1 if graphs else 0), block_size)
        self.graphs = None
        if graphs:
            from moeserve.router.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.cache, experts, block_size, *graphs)
        self.seqs: dict[int, RouterSeq] = {}  # the live sequences of this router, by id
        # (step, its rows, tok_buf slot each decode reads, slot each sampling row writes): a step
        # run again after a lost peer reuses them
        self._rows: tuple[int, list, dict, dict] | None = None
        # each live sequence's last sampled token, on the device: entry e of a sequence owns slots
        # 2e and 2e + 1, and a step writes the one its input is not read from (RouterSeq.cur: the
        # slot with the latest token), so a step run again still reads the token of the step before
        self.tok_buf = torch.zeros(128, dtype=torch.long, device=self.device)
        self._free_tok = list(range(63, -1, -1))
        self._outputs: list[_Outputs] = []  # sampled, not delivered yet (oldest first)
        self._delivered: tuple[int, tuple] | None = None  # (step, what deliver(step) returned): a replay
        self._load: tuple | None = None  # a load snapshot on its way to the host
        self.penalty_pool = penalties.PenaltyPool(model.config.vocab_size, self.device)
        self.grammars = grammars or GrammarBook(None, model.config.vocab_size, self.device)

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            seq = self.seqs.pop(sid, None)
            if seq is not None and seq.tok is not None:
                self._free_tok.append(seq.tok)
            if seq is not None and seq.pen_slot is not None:
                self.penalty_pool.give(seq.pen_slot)

    def update_grammars(self, add, drop) -> None:
        """A header's grammars to compile (off the step path) and to forget."""
        self.grammars.update(add, drop)

    def grammar_reports(self) -> dict[int, str]:
        """The grammars compiled since the last step result: id -> "" or why not."""
        return self.grammars.reports()

    def _tok_entry(self, seq: RouterSeq) -> int:
        if seq.tok is None:
            if not self._free_tok:  # grow (stream-ordered: pending scatters land first)
                n = self.tok_buf.numel() // 2
                self.tok_buf = torch.cat([self.tok_buf, torch.zeros_like(self.tok_buf)])
                self._free_tok = list(range(2 * n - 1, n - 1, -1))
            seq.tok = self._free_tok.pop()
        return seq.tok

    def _device_ids(self, host_ids: list[int], src: list[int]) -> torch.Tensor:
        """Token ids [T] on the device: ``host_ids[t]``, or where ``src[t] >= 0`` the token held
        in ``tok_buf[src[t]]`` (a pending sampled token)."""
        both = torch.tensor([host_ids, src], dtype=torch.long)
        if self.cuda:
            both = both.pin_memory()
        both = both.to(self.device, non_blocking=True)
        return self.select_ids(both[0], both[1])

    def select_ids(self, ids: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """ids [T] with the entries where src [T] >= 0 replaced by tok_buf[src] (on the device)."""
        return torch.where(src >= 0, self.tok_buf.index_select(0, src.clamp(min=0)), ids)

    @torch.inference_mode()
    def run(self, work: RouterWork, step: int) -> None:
        """Enqueue one step: its outputs (sampled tokens, asked-for logits) are handed out by
        ``deliver``. A step run again after a lost peer (same step number) replaces its outputs."""
        self.release(work.release)
        self.experts.step = step
        self._outputs = [o for o in self._outputs if o.step != step]
        info = self.model.moe_info
        if not work.runs:
            idle_walk(
                self.experts.exchange,
                info.num_moe_layers,
                self.model.config.hidden_size,
                info.expert_spec.dtype,
                self.experts.store,
                maps=self.experts.maps,
            )
            self.experts.end_step()
            self._outputs.append(_Outputs(step, [], None, None, {}))
            return
        if self._rows is None or self._rows[0] != step:  # a step run again after a lost peer: planned already
            self._rows = (step, *self._plan(work))
        _, seqs, src_of, dst_of = self._rows
        ids, src = [], []
        for sw in seqs:
            if sw.pending:
                ids.append(0)
                src.append(src_of[sw.seq_id])
            else:
                ids.extend(sw.token_ids)
                src.extend([-1] * len(sw.token_ids))
        self._check_ids([t for t, j in zip(ids, src) if j < 0])
        tables = [self.seqs[sw.seq_id].table for sw in seqs]
        num_new = [sw.num_new for sw in seqs]
        starts_of = [sw.start for sw in seqs]
        dev_src = src if any(j >= 0 for j in src) else None  # ids to take from tok_buf on the device
        whole = all(sw.return_logits != "all" and sw.prompt_logprobs < 0 for sw in seqs)  # no prompt logits
        if (
            self.graphs is not None
            and whole
            and all(sw.num_new == 1 and sw.sample for sw in seqs)
            and self.graphs.fits(len(seqs), tables)
        ):
            logits = self.graphs.run(ids, starts_of, tables, step, src=dev_src, runner=self)  # [S, V]
            self.experts.end_step()
            self._sample(seqs, logits.float(), step, dst_of, src_of)
            return
        rows = [i for i, sw in enumerate(seqs) if sw.sample]
        key = self.graphs.mixed_key(num_new, tables) if self.graphs is not None and whole else None
        if (
            key is not None and self.graphs is not None
        ):  # a mixed step (prefill chunks beside decodes) replays its buckets' graph
            logits = self.graphs.run_mixed(key, ids, dev_src, num_new, starts_of, tables, step, runner=self)  # [S, V]
            self.experts.end_step()
            if not rows:
                self._outputs.append(_Outputs(step, [], None, None, {}, {}))
                return
            if len(rows) < len(seqs):
                logits = logits.index_select(0, self._device_index(np.asarray(rows)))
            self._sample([seqs[i] for i in rows], logits.float(), step, dst_of, src_of)
            return
        with span("batch_build"):
            ids_dev = self._device_ids(ids, src)  # [T]
            batch = PagedBatch.build(num_new, starts_of, tables, self.block_size, self.device)
        hidden = self.model.step(ids_dev, batch, self.cache, experts=self.experts, check_ids=False)  # [T, H]
        self.experts.end_step()
        out_logits = {}
        starts = np.cumsum([0] + num_new)
        out_plp = {}
        for i, sw in enumerate(seqs):
            if sw.return_logits == "all":
                out_logits[sw.seq_id] = self.model.logits(hidden[starts[i] : starts[i + 1]]).float().cpu().numpy()
            if sw.prompt_logprobs >= 0:
                with span("prompt_logprobs"):
                    out_plp[sw.seq_id] = self._prompt_logprobs(sw, hidden[starts[i] : starts[i + 1]])
        if rows:
            with span("lm_head"):
                last = self._device_index(starts[1:][rows] - 1)  # [B]
                logits = self.model.logits(hidden.index_select(0, last)).float()  # [B, V]
            self._sample([seqs[i] for i in rows], logits, step, dst_of, src_of, out_logits, out_plp)
        else:
            self._outputs.append(_Outputs(step, [], None, None, out_logits, out_plp))

    def _device_index(self, values: np.ndarray) -> torch.Tensor:
        """int64 row indices on the device, copied from pinned memory without a host sync."""
        idx = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self.cuda:
            idx = idx.pin_memory()
        return idx.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def warmup(self, b: int, max_seq_len: int, step: int) -> None:
        """A warm-up step at start (``--capture-graphs-at-start``): one padded decode step of
        bucket ``b`` in the scratch block (``DecodeGraphs.warmup``), or without graphs an idle
        walk that meets the other ranks' exchange; its load is discarded."""
        self.experts.step = step
        if self.graphs is not None and not self.graphs.disabled:
            self.graphs.warmup(b, max_seq_len, step)
        else:
            info = self.model.moe_info
            idle_walk(
                self.experts.exchange,
                info.num_moe_layers,
                self.model.config.hidden_size,
                info.expert_spec.dtype,
                self.experts.store,
                maps=self.experts.maps,
            )
        self.experts.discard_load()

    def _plan(self, work: RouterWork) -> tuple[list[SeqWork], dict[int, int], dict[int, int]]:
        """Apply the header's block updates to the tables and list the step's rows: one row per
        decode (its position and output index from this runner's count, its token from
        ``tok_buf``), then the sent sequences that continue (a later chunk, or a prompt after
        its cached prefix), then the fresh prompts (from position 0), last: the prefill
        backends other than the paged kernel take a step's trailing run of fresh prompts
        (``PagedBatch.build``'s ``FreshSuffix``). Also the ``tok_buf`` slot each decode reads
        and the slot each sampling row writes."""
        rows: list[SeqWork] = []
        src_of, dst_of = {}, {}
        live = self.seqs
        for sw in work.seqs:
            sid = sw.seq_id
            if sw.fresh:  # new, or recomputed after a preemption: a record whose table may begin with cached blocks
                assert sw.sampling is not None
                old = live.get(sid)
                seq = live[sid] = RouterSeq(list(sw.new_blocks), sw.sampling, sw.return_logits)
                if old is not None:  # keeps its tok_buf entry (a token of a step run again may sit there)
                    seq.tok, seq.cur, seq.pen_slot = old.tok, old.cur, old.pen_slot
                if sw.grammar >= 0:
                    seq.grammar = self.grammars.start(sw.grammar)
            else:
                seq = live[sid]
                seq.table.extend(sw.new_blocks)
            if seq.known is not None:
                seq.known.extend(sw.prefix_ids)  # a fresh record's cached prefix (penalized only)
                seq.known.extend(sw.token_ids)
            if seq.grammar is not None and seq.grammar.known is not None:
                seq.grammar.known.extend(sw.token_ids)
            seq.length = sw.start + len(sw.token_ids)
            if sw.sample:
                seq.out = sw.out_pos + 1
                e, cur = self._tok_entry(seq), seq.cur
                dst_of[sid] = 2 * e + 1 - cur
                seq.cur = 1 - cur
        for sid, block in work.blocks.tolist():
            live[sid].table.append(block)
        for sid in work.decodes.tolist():
            seq = live[sid]
            start, out, mode = seq.length, seq.out, seq.mode
            seq.length, seq.out = start + 1, out + 1
            entry, cur = seq.tok, seq.cur
            assert entry is not None  # a decoding sequence sampled its first token in an earlier step
            src_of[sid], dst_of[sid] = 2 * entry + cur, 2 * entry + 1 - cur
            seq.cur = 1 - cur
            rows.append(
                SeqWork(
                    seq_id=sid,
                    token_ids=(),
                    start=start,
                    return_logits="all" if mode == "all" else "last" if mode else "",
                    out_pos=out,
                    pending=True,
                )
            )
        rows.extend(sw for sw in work.seqs if sw.start > 0)
        rows.extend(sw for sw in work.seqs if sw.start == 0)
        return rows, src_of, dst_of

    def _sample(
        self,
        sampled,
        logits: torch.Tensor,
        step: int,
        dst_of: dict[int, int],
        src_of: dict[int, int],
        out_logits: dict | None = None,
        out_plp: dict | None = None,
    ) -> None:
        """Sample one token per sequence of ``sampled`` from fp32 ``logits`` [B, V] (row j is
        sampled[j]'s), in one call on the device, after min_tokens, logit_bias and the
        penalties changed them (``router.penalties``) and the constrained rows' grammars masked
        them (``router.grammars``); keep each in ``tok_buf`` and start its copy to the host;
        also the raw logits asked for with "last"."""
        out_logits = {} if out_logits is None else out_logits
        with span("sampling"):
            rows = [self.seqs[sw.seq_id] for sw in sampled]
            st = SamplingTensors.build(
                [seq.sampling for seq in rows],
                [seq.seed for seq in rows],
                [sw.out_pos for sw in sampled],
                self.device,
            )
            adj = penalties.build(
                [(j, seq, sw.out_pos, src_of.get(sw.seq_id, -1)) for j, (seq, sw) in enumerate(zip(rows, sampled))],
                self.tok_buf,
                self.penalty_pool,
            )
            x = logits if adj is None else adjust_logits(logits, adj)
            constrained = [
                (j, seq.grammar, sw.out_pos) for j, (seq, sw) in enumerate(zip(rows, sampled)) if seq.grammar
            ]
            if constrained:
                with span("grammar_mask"):
                    mask = self.grammars.fill([(g, pos) for _, g, pos in constrained])  # [C, W] on the host
                    at = torch.tensor([j for j, _, _ in constrained], dtype=torch.long)
                    if self.cuda:
                        at = at.pin_memory()
                    if x is logits:  # the raw logits stay for "last" (logprobs)
                        x = logits.clone()
                    dev = self.device
                    apply_token_bitmask(x, at.to(dev, non_blocking=True), mask.to(dev, non_blocking=True))
            toks = sample(x, st)  # [B] on the device
            entries = [dst_of[sw.seq_id] for sw in sampled]
            index = torch.tensor(entries, dtype=torch.long)
            if self.cuda:
                index = index.pin_memory()
            self.tok_buf.index_copy_(0, index.to(self.device, non_blocking=True), toks)
            host = torch.empty(len(sampled), dtype=torch.long, pin_memory=self.cuda)
            host.copy_(toks, non_blocking=self.cuda)
            event = None
            if self.cuda:
                event = torch.cuda.Event()
                event.record()
        for j, sw in enumerate(sampled):
            if sw.return_logits == "last":
                out_logits[sw.seq_id] = logits[j : j + 1].cpu().numpy()
        outputs = _Outputs(step, [sw.seq_id for sw in sampled], host, event, out_logits, out_plp or {})
        for j, g, _ in constrained:
            g.last = (outputs, j)
        self._outputs.append(outputs)

    PROMPT_LOGPROB_ROWS = 64  # prompt positions scored at once: [64, V] fp32 logits at a time

    def _prompt_logprobs(self, sw: SeqWork, hidden: torch.Tensor):
        """The logprobs of this chunk's prompt tokens, each scored by the position before it
        (the first by the previous chunk's last hidden row, kept in ``carry``), computed on the
        device in blocks of ``PROMPT_LOGPROB_ROWS`` positions: only [n] and [n, K] arrays reach
        the host. The chunk's last row scores the next chunk's first token (kept), or is the
        row the first output is sampled from (the prompt's last chunk)."""
        from moeserve.dataplane.protocol import PromptLogprobs

        seq = self.seqs[sw.seq_id]
        k = sw.prompt_logprobs
        ids = list(sw.token_ids)
        h = hidden[:-1]  # [T - 1, H]: position t scores token t + 1
        targets = ids[1:]
        # keyed by the position of the token it scores; the entry of this chunk stays until a
        # later chunk, so a step run again after a lost peer finds it
        carry = {p: t for p, t in (seq.carry or {}).items() if p >= sw.start}
        if sw.start in carry:
            h = torch.cat([carry[sw.start][None], h])
            targets = ids
        if not sw.sample:
            carry[sw.start + len(ids)] = hidden[-1].clone()
        seq.carry = carry or None
        parts = []
        tgt = torch.tensor(targets, dtype=torch.long, device=self.device)
        for a in range(0, len(targets), self.PROMPT_LOGPROB_ROWS):
            b = min(len(targets), a + self.PROMPT_LOGPROB_ROWS)
            lg = self.model.logits(h[a:b]).float()  # [n, V]
            parts.append(prompt_logprobs(lg, tgt[a:b], min(k, lg.shape[1])))
        if not parts:
            z = np.zeros(0, np.float32)
            return PromptLogprobs(z, np.zeros(0, np.int64), np.zeros((0, k), np.int64), np.zeros((0, k), np.float32))
        cat = [torch.cat([p[i] for p in parts]).cpu().numpy() for i in range(4)]
        return PromptLogprobs(cat[0], cat[1], cat[2], cat[3])

    def deliver(self, step: int) -> tuple[int, dict[int, int], dict[int, np.ndarray], dict]:
        """The outputs of the oldest step not delivered yet that step ``step``'s result carries
        (with async outputs a step before ``step``, else up to ``step``): (its step or -1,
        tokens per sequence, logits per sequence, prompt logprobs per sequence). Waits for that
        step's copies only. Asked again for the same step (the step was run again after a lost
        peer), the same answer."""
        if self._delivered is not None and self._delivered[0] == step:
            return self._delivered[1]
        out: tuple[int, dict[int, int], dict[int, np.ndarray], dict] = (-1, {}, {}, {})
        if self._outputs and (
            self._outputs[0].step < step or (not self.async_outputs and self._outputs[0].step <= step)
        ):
            o = self._outputs.pop(0)
            with span("tokens_read"):
                out = (o.step, o.tokens(), o.logits, o.plp)
        self._delivered = (step, out)
        return out

    @property
    def outputs_pending(self) -> bool:
        return bool(self._outputs)

    def snapshot_load(self) -> None:
        """Start reading the load the device accumulated (the forward steps since the last
        snapshot), with the maps they were routed with; ``take_load_snapshot`` returns it."""
        self._load = self.experts.snapshot_load()

    def take_load_snapshot(self) -> LoadSnapshot | None:
        """(logical [L, E], worker [L, W], steps, histogram [L, E, K], busy [L, P]) of the last
        ``snapshot_load`` (``DistributedExperts.finish_load``), or None."""
        snap, self._load = self._load, None
        return None if snap is None else self.experts.finish_load(snap)

    def _check_ids(self, ids: list[int]) -> None:
        """Token ids in range, checked on the host (the leader validated prompts; sampled ids
        come from the vocabulary: a failure here is a bug, never a user's error)."""
        v = self.model.config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= v):
            raise ValueError(
                f"token id out of range 0..{v - 1} in a decode step: {[i for i in ids if not 0 <= i < v][:4]}"
            )
