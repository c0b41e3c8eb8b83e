"""A router's grammars (structured output): the grammars the leader announced, compiled in a
thread of their own, and the token masks of its constrained sequences, filled every step
(docs/engine.md, "Structured output").

Dimension letters: B rows sampled in the step, C constrained rows among them, V vocabulary,
W = ceil(V / 32) mask words.

**Compiles.** A header's ``grammars`` are compiled with the model's vocabulary by
``moeserve.grammar.Compiler`` in this book's thread, never on the step path: the step result
reports each one when it is done (``RankResult.grammars``: "" ready, else why not, a compile
past its deadline included), and the leader schedules a sequence only once every router has
its grammar.

**Masks.** A constrained sequence holds an xgrammar matcher. Before the sequence samples output
p, its matcher must have taken outputs 0 .. p-1: at its first sample after a (re)start they are
the header's tokens (a recomputed sequence's outputs are the tail of its prompt chunk); later,
output p-1 is the token this router sampled in the step before, whose copy to the host was
started then (``_Outputs``). So the mask of step N+1 waits for token N only, and only in a step
that has a constrained row: the router then waits for step N's copy (which the step's result
waits for anyway with asynchronous steps, one call later), feeds the token to the matcher and
fills the mask rows on the host (xgrammar's batch filler, threads of its own), while the device
runs step N+1's forward. The mask reaches the device with one copy and is applied to the
logits beside the penalties (``sampling.apply_token_bitmask``), after the decode graph, which
is unchanged. A matcher that has taken the grammar's end allows only the stop tokens (EOS).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from moeserve.grammar import COMPILE_TIMEOUT_S, Compiler, GrammarError, GrammarSpec

log = logging.getLogger(__name__)


def default_threads() -> int:
    """Threads for one compile and for a step's masks: most of a GPU host's cores, 1 on a small one."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class SeqGrammar:
    """One constrained sequence's matcher: ``taken`` outputs it has accepted (``history``),
    ``known`` the tokens its header sent since its (re)start until its first sample, ``last``
    (outputs, row) of its latest sampled token until the matcher takes it."""

    __slots__ = ("matcher", "compiled", "taken", "history", "known", "last", "broken")

    def __init__(self, compiled, matcher):
        self.compiled = compiled
        self.matcher = matcher
        self.taken = 0
        self.history: list[int] = []
        self.known: list[int] | None = []
        self.last: tuple | None = None
        self.broken = False


class GrammarBook:
    """The grammars of one router and its constrained sequences' masks."""

    def __init__(self, compiler: Compiler | None, vocab_size: int, device: torch.device, threads: int | None = None):
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.device = device
        self.threads = threads or default_threads()
        self._pool: ThreadPoolExecutor | None = None
        self._compiled: dict[int, object] = {}
        self._pending: dict[int, tuple[Future, float]] = {}
        self._reports: dict[int, str] = {}
        self._batch = None
        self._lock = threading.Lock()
        self.eos = sorted(set(compiler.eos_ids)) if compiler is not None else []
        self._eos_row: torch.Tensor | None = None  # int32 [W]: the stop tokens only

    # -- compiles ------------------------------------------------------------------------------

    def update(self, add: tuple[tuple[int, GrammarSpec], ...], drop: tuple[int, ...]) -> None:
        """A header's grammars: compile the new ones in the background, forget the dropped."""
        for gid in drop:
            self._compiled.pop(gid, None)
            pending = self._pending.pop(gid, None)
            if pending is not None:
                pending[0].cancel()
        for gid, spec in add:
            if gid in self._compiled or gid in self._pending:
                continue  # a header issued again after a lost peer
            if self.compiler is None:
                self._reports[gid] = "this router has no grammar compiler (no tokenizer)"
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
            self._pending[gid] = (self._pool.submit(self.compiler.compile, spec), time.monotonic())

    def reports(self) -> dict[int, str]:
        """The grammars compiled (or failed) since the last call: id -> "" or why not."""
        now = time.monotonic()
        for gid, (fut, t0) in list(self._pending.items()):
            if fut.done():
                del self._pending[gid]
                try:
                    self._compiled[gid] = fut.result()
                    self._reports[gid] = ""
                except GrammarError as e:
                    self._reports[gid] = str(e)
                except Exception as e:  # a bug of the library: the request is refused, the router goes on
                    log.exception("compiling grammar %d", gid)
                    self._reports[gid] = f"{type(e).__name__}: {e}"
            elif now - t0 > COMPILE_TIMEOUT_S:
                del self._pending[gid]  # the thread finishes it in vain
                self._reports[gid] = f"compiling it took longer than {COMPILE_TIMEOUT_S:.0f} s"
        out, self._reports = self._reports, {}
        return out

    def start(self, gid: int) -> SeqGrammar:
        """A fresh matcher for a sequence that (re)starts with grammar ``gid`` (compiled here: the
        leader schedules it only then)."""
        compiled = self._compiled.get(gid)
        if compiled is None or self.compiler is None:
            raise RuntimeError(f"grammar {gid} is not compiled on this router: a bug in the leader's schedule")
        return SeqGrammar(compiled, self.compiler.matcher(compiled))

    # -- masks ---------------------------------------------------------------------------------

    def fill(self, rows: list[tuple[SeqGrammar, int]]) -> torch.Tensor:
        """The masks of the step's constrained rows: int32 [C, W] on the host (pinned on CUDA),
        row c for ``rows[c]`` = (its grammar state, the output position it samples)."""
        mask = torch.zeros((len(rows), self.words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        fill, at = [], []
        for c, (g, pos) in enumerate(rows):
            self._catch_up(g, pos)
            if g.broken or g.matcher.is_terminated():
                self._only_eos(mask[c])
            else:
                fill.append(g.matcher)
                at.append(c)
        if fill:
            if self._batch is None and self.compiler is not None:
                self._batch = self.compiler.batch(self.threads)
            assert self._batch is not None
            self._batch.batch_fill_next_token_bitmask(fill, mask, at)
        return mask

    def _only_eos(self, row: torch.Tensor) -> None:
        if self._eos_row is None:
            words = np.zeros(self.words, dtype=np.uint32)
            for t in self.eos:
                words[t // 32] |= np.uint32(1 << (t % 32))
            self._eos_row = torch.from_numpy(words.view(np.int32))
        row.copy_(self._eos_row)

    def _catch_up(self, g: SeqGrammar, pos: int) -> None:
        """Feed ``g``'s matcher the outputs before position ``pos``."""
        if g.taken > pos:  # a step run again after a lost peer, one output further: start over
            g.matcher.reset()
            tokens, g.taken, g.history, g.broken = g.history[:pos], 0, [], False
            self._take(g, tokens)
            return
        if g.known is not None:  # the first sample after a (re)start: its outputs came in the header
            known, g.known = g.known, None
            self._take(g, known[len(known) - pos :][g.taken :] if pos else [])
        if g.taken == pos:
            return
        if g.last is not None and g.taken == pos - 1:
            outputs, j = g.last
            self._take(g, [outputs.token(j)])
        if g.taken != pos:
            raise RuntimeError(f"a constrained sequence samples output {pos} with {g.taken} outputs in its matcher")

    def _take(self, g: SeqGrammar, tokens: list[int]) -> None:
        for t in tokens:
            if not g.broken and not g.matcher.is_terminated() and not g.matcher.accept_token(int(t)):
                log.error("a sampled token %d does not follow its grammar: the sequence may only end now", t)
                g.broken = True
            g.history.append(int(t))
            g.taken += 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["GrammarBook", "SeqGrammar", "default_threads"]
