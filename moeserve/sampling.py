"""Token sampling for the whole batch on the device, deterministic per request.

Dimension letters: B rows (sequences sampled in a step), V vocabulary, F rows that filter
(top-k / top-p), Q = ceil(V / 4) Philox counters per row.

**What a row's token depends on.** Only its logits, its ``SamplingParams``, its seed and the
*position* of the token among the request's outputs (0 for the first). The randomness is a
counter-based generator: the uniform of vocabulary entry i is Philox-4x32-10 (Random123's;
``tl.philox`` in Triton) keyed by the 64-bit seed, counter (i // 4, position lo, position hi, 0),
word i % 4. So there is no generator state: which other requests share the step, the row's
index in the batch and a preemption (the sequence recomputed later samples the same position
again) change nothing, and the single-process model (``Sampler``) and the distributed routers
(``sample`` on a batch) share one implementation. The 32-bit words are integer arithmetic,
identical on every device; what follows them is fp32 (log, division, softmax, cumsum), whose
last bits may differ between CPU and GPU libraries, so two devices can disagree only where two
candidates tie to an ulp.

**How a row is sampled.** Greedy (temperature 0, and every temperature below 1e-5, as vLLM):
argmax of the logits, lowest index on ties (``torch.argmax``). Otherwise, with scores = logits /
T: top-k keeps the tokens whose logit reaches the k-th largest (ties at the k-th kept), then
top-p keeps the smallest set of most likely tokens whose probability, under the softmax of the
top-k-kept scores, reaches top_p (the most likely always stays). Both filters end as one
threshold per row on the logits (the logit of the last kept token, so that every token tied with
it stays too: the kept set never depends on how a sort orders ties). The token is then drawn
from softmax(scores) over the kept set by the exponential race (Gumbel-max):

    token = argmax over kept i of  x_i - T * log(E_i),   E_i = -log(1 - u_i) ~ Exp(1)

which is argmax of p_i / E_i multiplied through by T: exact sampling from p, with no
normalisation, sort, cumsum or host sync, and T = 0 gives the argmax (greedy rows of a mixed
batch take the same path). Nothing can be inf/NaN for finite (or -inf) logits: T is 0 or in
[1e-5, 1e30] (larger is uniform anyway), u in [2**-33, 1 - 2**-24] so log E is finite, and the
top-p softmax is taken of (x - max) / T <= 0.

**Cost per step at B = 256, V = 202,048 on an H200** (51.7 M logits, 207 MB in fp32; ~4.3 TB/s
reached by copies; estimates from bytes and instructions, not yet timed on the GPU):
- all greedy: one ``argmax``, one read of the logits: ~50 us.
- random rows, no filter: one launch of ``triton_sampling.race_kernel`` over (row, vocabulary
  chunk): reads the logits once and keeps the Philox words and the keys in registers (nothing
  [B, V] is written). Floor 207 MB / 4.3 TB/s = 48 us; per logit ~25 integer ops (a Philox-10
  call, 40 multiplies, serves 4 logits), 2 logs and a division: ~60 instructions, ~3 G lane
  instructions / 33 T per s = ~0.1 ms, so compute-bound at ~0.1 ms. Greedy rows skip the hash.
- rows with top-k only: ``torch.topk`` of the largest k among them, ~0.1 ms at k = 50.
- rows with top-p: gather, one ``torch.sort`` (radix passes over fp32 keys and int64 indices,
  ~5 GB moved at F = 256: ~1.2 ms) and ~8 elementwise / scan passes (~1.7 GB: ~0.4 ms):
  ~1.5-2 ms when all 256 rows use top-p, in proportion to F, skipped when F = 0. The sort is
  what a sort-free threshold search (a later kernel) would remove.
- ``logprobs`` (20 top): max, exp-sum, gather, topk: ~6 passes, ~0.3 ms, for the rows that ask.
- penalties (``adjust_logits``), for the Q rows that have one: a gather of their [Q, V] count
  (and prompt) rows from the router's pool, ~6 elementwise passes over [Q, V] and a scatter
  back (about what 6 reads of those rows' logits cost; nothing when no row has a penalty);
  min_tokens and logit_bias are one indexed write of their (row, token) pairs.
- the torch path (CPU, or CUDA without Triton) materialises the Philox state as int64 [B, Q]
  tensors, ~120 elementwise ops of 103 MB each at this size (~37 GB, ~9 ms on an H200): for
  tests and the CPU model (~0.6 ms a token at B = 1 on one CPU core, dominated by op overhead).
"""

from __future__ import annotations

import functools
import math
import secrets
from dataclasses import dataclass

import numpy as np
import torch

from moeserve import kernels

MAX_SEED = 2**63 - 1
MAX_MIN_TOKENS = 1 << 20
MAX_STOP_IDS = 1024  # ids masked while fewer than min_tokens were generated
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_BIAS = 100.0  # OpenAI's range of a logit bias
MAX_REPETITION_PENALTY = 10.0
# (field, lowest, highest, lowest excluded) of the float parameters beside temperature and top_p
RANGES = (
    ("min_p", 0.0, 1.0, False),
    ("presence_penalty", -2.0, 2.0, False),
    ("frequency_penalty", -2.0, 2.0, False),
    ("repetition_penalty", 0.0, MAX_REPETITION_PENALTY, True),
)
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_TEMPERATURE = 1e30  # larger temperatures are clamped here: T * log E stays finite in fp32

_M32 = 0xFFFFFFFF
# Philox-4x32 constants (Random123; triton.language.random)
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of a request.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it (> 0). Values
                 below 1e-5 are greedy too, and values above 1e30 count as 1e30.
    top_p:       nucleus sampling: keep the smallest set of most likely tokens whose probability
                 reaches top_p, in (0, 1]; 1 keeps all.
    top_k:       keep the k most likely tokens; 0 keeps all.
    seed:        seeds the request's random stream, 0 .. 2**63-1; None draws a random seed.
    min_p:       keep the tokens whose probability (after temperature) is at least min_p times the
                 most likely one's, in [0, 1]; 0 keeps all. Applied before top-k and top-p.
    presence_penalty, frequency_penalty: in [-2, 2], subtracted from the logit of every token the
                 request generated so far, once (presence) or once per occurrence (frequency).
    repetition_penalty: in (0, 10]; the logits of tokens in the prompt or generated so far are
                 divided by it when positive, multiplied when not; 1 changes nothing.
    min_tokens:  while fewer tokens were generated, ``stop_ids`` cannot be sampled (their logits
                 are -inf); the leader sets ``stop_ids`` to the request's EOS and stop token ids.
    logit_bias:  (token id, bias in [-100, 100]) pairs added to the logits.
    These five change the logits before temperature, greedy rows included, in vLLM's order:
    min_tokens, logit_bias, then the penalties (``adjust_logits``); logprobs stay those of the
    raw logits.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), found {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus filtering), found {p!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k filtering), found {k!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED):
            raise ValueError(f"seed must be None or an integer in 0..{MAX_SEED}, found {s!r}")
        for name, lo, hi, open_lo in RANGES:
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < lo
                or v > hi
                or (open_lo and v == lo)
            ):
                raise ValueError(f"{name} must be a number in {'(' if open_lo else '['}{lo}, {hi}], found {v!r}")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= MAX_MIN_TOKENS:
            raise ValueError(f"min_tokens must be an integer in 0..{MAX_MIN_TOKENS}, found {m!r}")
        if len(self.stop_ids) > MAX_STOP_IDS or any(
            isinstance(t, bool) or not isinstance(t, int) for t in self.stop_ids
        ):
            raise ValueError(f"stop_ids must be at most {MAX_STOP_IDS} integers")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, found {len(self.logit_bias)}")
        for pair in self.logit_bias:
            if (
                len(pair) != 2
                or isinstance(pair[0], bool)
                or not isinstance(pair[0], int)
                or isinstance(pair[1], bool)
                or not isinstance(pair[1], (int, float))
                or not -MAX_BIAS <= pair[1] <= MAX_BIAS
            ):
                raise ValueError(
                    f"logit_bias entries must be (token id, bias) with a bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                    f"found {pair!r}"
                )

    @property
    def penalized(self) -> bool:
        """True when a penalty needs the request's token counts."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts(self) -> bool:
        """True when logits change before sampling (penalties, min_tokens, logit_bias)."""
        return self.penalized or self.min_tokens > 0 or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax: temperature 0 or below 1e-5."""
        return self.temperature < GREEDY_BELOW


def request_seed(params: SamplingParams) -> int:
    """The request's seed: ``params.seed``, or a fresh random one. Drawn once per request (the
    leader calls it at admission and keeps it for the request's life, preemptions included)."""
    return params.seed if params.seed is not None else secrets.randbelow(MAX_SEED + 1)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row parameters on the device. B rows.

    temperature float32 [B]: 0 = greedy (values < 1e-5 are stored as 0; > 1e30 as 1e30).
    top_p       float32 [B]: 1 for greedy rows (they never filter).
    top_k       int64 [B]: 0 = all (also stored for greedy rows).
    seed        int64 [B].
    position    int64 [B]: index of the token being sampled among the request's outputs (0 for
                the first).
    min_p       float32 [B]: 0 for greedy rows and rows without min_p.
    all_greedy  host flag: skip the random path entirely.
    The remaining fields are host-side hints that ``build`` fills: ``filter_rows`` int64 [F] on
    the device, the random rows with top-k or top-p (None: unknown, every row goes through the
    filter, which is correct and slower); ``needs_sort``: some filtered row has top_p < 1 (else
    ``torch.topk`` of ``max_top_k`` replaces the sort); ``max_top_k``: the largest top_k among the
    filtered rows.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor
    all_greedy: bool
    filter_rows: torch.Tensor | None = None
    needs_sort: bool = True
    max_top_k: int = 0
    min_p: torch.Tensor | None = None

    @classmethod
    def build(
        cls, params: list[SamplingParams], seeds: list[int], positions: list[int], device: torch.device | str
    ) -> SamplingTensors:
        """One row per request: its params, its seed (``request_seed``) and the position of the
        token it samples now. Two host-to-device copies (pinned when the device is CUDA)."""
        b = len(params)
        if len(seeds) != b or len(positions) != b:
            raise ValueError(
                f"need one seed and one position per row, found {len(seeds)} and {len(positions)} for {b} rows"
            )
        if any(not 0 <= s <= MAX_SEED for s in seeds) or any(p < 0 for p in positions):
            raise ValueError(f"seeds must be in 0..{MAX_SEED} and positions >= 0")
        greedy = [p.greedy for p in params]
        temp = np.array(
            [0.0 if g else min(float(p.temperature), MAX_TEMPERATURE) for p, g in zip(params, greedy)], dtype=np.float32
        )
        top_p = np.array([1.0 if g else float(p.top_p) for p, g in zip(params, greedy)], dtype=np.float32)
        top_k = [0 if g else p.top_k for p, g in zip(params, greedy)]
        min_p = np.array([0.0 if g else float(p.min_p) for p, g in zip(params, greedy)], dtype=np.float32)
        # Decided on the fp32 values the device sees (a top_p that rounds to 1 filters nothing).
        rows = [i for i in range(b) if not greedy[i] and (top_k[i] > 0 or top_p[i] < 1 or min_p[i] > 0)]
        device = torch.device(device)
        floats = torch.from_numpy(np.stack([temp, top_p, min_p]) if b else np.zeros((3, 0), np.float32))
        ints = torch.tensor(top_k + list(seeds) + list(positions) + rows, dtype=torch.long)
        if device.type == "cuda":
            floats, ints = floats.pin_memory(), ints.pin_memory()
        floats = floats.to(device, non_blocking=True)
        ints = ints.to(device, non_blocking=True)
        return cls(
            temperature=floats[0],
            top_p=floats[1],
            top_k=ints[:b],
            seed=ints[b : 2 * b],
            position=ints[2 * b : 3 * b],
            all_greedy=all(greedy),
            filter_rows=ints[3 * b :],
            needs_sort=any(top_p[i] < 1 for i in rows),
            max_top_k=max((top_k[i] for i in rows), default=0),
            min_p=floats[2] if any(min_p[i] > 0 for i in rows) else None,
        )


# ----------------------------------------------------------------------------------------------
# The random words: Philox-4x32-10 on int64 tensors


def philox4x32(
    c0: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    c3: torch.Tensor,
    k0: torch.Tensor,
    k1: torch.Tensor,
    rounds: int = PHILOX_ROUNDS,
) -> tuple[torch.Tensor, ...]:
    """Philox-4x32 (Random123, and ``tl.philox`` bit for bit): counters c0..c3 and key k0, k1 are
    int64 tensors (broadcastable) holding unsigned 32-bit values; returns the 4 output words,
    the same way. torch has no uint32 arithmetic: a 32 x 32-bit product can pass 2**63 and wraps
    in int64 two's complement, which keeps all 64 bits of it, and the arithmetic right shift is
    masked back to 32 bits, so hi and lo words are exact."""
    for _ in range(rounds):
        p0 = c0 * _ROUND_A
        p2 = c2 * _ROUND_B
        c0, c1, c2, c3 = ((p2 >> 32) & _M32) ^ c1 ^ k0, p2 & _M32, ((p0 >> 32) & _M32) ^ c3 ^ k1, p0 & _M32
        k0 = (k0 + _KEY_A) & _M32
        k1 = (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def random_bits(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """The 32-bit random word of every (row, vocabulary entry): int64 [B, V] in 0 .. 2**32-1, from
    seed and position int64 [B]. Entry i is word i % 4 of Philox counter (i // 4, position lo,
    position hi, 0) under key (seed lo, seed hi)."""
    q = (vocab + 3) // 4
    n = torch.arange(q, dtype=torch.long, device=seed.device)[None, :]  # [1, Q]
    pos, sd = position[:, None], seed[:, None]  # [B, 1]
    zero = torch.zeros_like(pos)
    words = philox4x32(n, pos & _M32, (pos >> 32) & _M32, zero, sd & _M32, (sd >> 32) & _M32)
    return torch.stack(torch.broadcast_tensors(*words), dim=-1).reshape(seed.shape[0], 4 * q)[:, :vocab]


def exponentials(bits: torch.Tensor) -> torch.Tensor:
    """E = -log(1 - w) ~ Exp(1) in fp32 from 32-bit words, w = (m + 0.5) / 2**32 kept below 1.
    -log1p(-w) by Goldberg's trick (log(y) * w / (y - 1), y = 1 - w), the formula the Triton kernel
    uses: precise for tiny w, where E is tiny and its token the likely winner of the race."""
    w = ((bits.to(torch.float32) + 0.5) * 2.0**-32).clamp_(max=1.0 - 2.0**-24)
    y = 1.0 - w
    return torch.where(y == 1.0, w, w * (torch.log(y) / (y - 1.0)))


# ----------------------------------------------------------------------------------------------
# Filters: one logit threshold per row


def thresholds(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor | None:
    """The top-k / top-p threshold of each row: float32 [B], a token is kept iff its logit >= it
    (-inf keeps all). None when no row filters. At most one sort (of the F filtering rows only)."""
    b, v = logits.shape
    rows = st.filter_rows
    if st.all_greedy or (rows is not None and rows.numel() == 0):
        return None
    x = logits.float() if rows is None else logits.index_select(0, rows).float()  # [F, V]
    sel = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
    temp, top_p, top_k = sel(st.temperature), sel(st.top_p), sel(st.top_k)
    k = torch.where((top_k <= 0) | (top_k >= v), v, top_k)  # [F] 1..V
    if st.needs_sort or rows is None:
        vals = torch.sort(x, dim=-1, descending=True).values  # [F, V]
    else:
        kmax = max(1, min(st.max_top_k, v))
        vals = torch.topk(x, kmax, dim=-1).values  # [F, kmax] sorted
        k = k.clamp(max=kmax)
    kth = vals.gather(1, (k - 1)[:, None])  # [F, 1]
    if not (st.needs_sort or rows is None):
        kth = torch.where((top_k > 0)[:, None], kth, float("-inf"))  # min_p-only rows: no top-k
    if st.min_p is not None:
        # min_p, before top-k and top-p (vLLM's order): p_i >= min_p * p_max under softmax(x / T)
        # is x_i >= x_max + T log(min_p), a threshold on the logits like the others.
        mp = sel(st.min_p)
        t_mp = torch.where(temp > 0, temp, 1.0)
        floor = vals[:, 0] + t_mp * torch.log(mp.clamp(min=1e-30))
        kth = torch.maximum(kth, torch.where(mp > 0, floor, float("-inf"))[:, None])
    thr = kth
    if st.needs_sort or rows is None:
        # Softmax of the top-k-kept scores, shifted by the row max so that nothing overflows.
        t = torch.where(temp > 0, temp, 1.0)[:, None]
        probs = torch.softmax(((vals - vals[:, :1]) / t).masked_fill_(vals < kth, float("-inf")), dim=-1)
        mass = probs.cumsum_(dim=-1)  # mass[j]: of the j + 1 most likely
        # Token j stays while the tokens before it hold less than top_p (token 0 always stays).
        n_keep = 1 + (mass[:, :-1] < top_p[:, None]).sum(-1, keepdim=True)  # [F, 1]
        thr = torch.where(top_p[:, None] < 1, torch.maximum(vals.gather(1, n_keep - 1), kth), kth)
    thr = torch.where(temp[:, None] > 0, thr, float("-inf")).squeeze(1)  # greedy rows keep all
    if rows is None:
        return thr
    return torch.full((b,), float("-inf"), device=logits.device).index_copy_(0, rows, thr)


# ----------------------------------------------------------------------------------------------
# Logits changed before sampling: min_tokens, logit_bias, penalties


@dataclass(frozen=True)
class LogitsAdjust:
    """What changes a batch's logits before sampling (``adjust_logits``), on the device. M
    masked (row, token) pairs, N biased pairs, Q penalized rows.

    mask_rows, mask_ids int64 [M]: set to -inf (min_tokens: the stop ids of the rows that have
                generated fewer tokens).
    bias_rows, bias_ids int64 [N], bias float32 [N]: added (logit_bias).
    pen_rows    int64 [Q]: the rows with a penalty; ``counts`` [Q, V] (any number dtype) how often
                each token was generated by the row's request so far, ``seen`` bool [Q, V] the
                tokens of its prompt or output (None: no row has a repetition penalty);
                ``presence``, ``frequency``, ``repetition`` float32 [Q].
    """

    mask_rows: torch.Tensor | None = None
    mask_ids: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    pen_rows: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None


def adjust_logits(logits: torch.Tensor, adj: LogitsAdjust) -> torch.Tensor:
    """fp32 logits [B, V] as vLLM's sampler changes them before temperature, in its order: the
    min_tokens mask, the logit bias, then the penalties (repetition: positive logits of seen
    tokens divided by it, others multiplied; frequency times the count and presence once per
    generated token, subtracted). A new tensor: the logprobs stay those of the raw logits."""
    x = logits.float().clone()
    if adj.mask_rows is not None and adj.mask_ids is not None and adj.mask_rows.numel():
        x.index_put_((adj.mask_rows, adj.mask_ids), torch.tensor(float("-inf"), device=x.device))
    if adj.bias_rows is not None and adj.bias_ids is not None and adj.bias is not None and adj.bias_rows.numel():
        x.index_put_((adj.bias_rows, adj.bias_ids), adj.bias, accumulate=True)
    if adj.pen_rows is not None and adj.counts is not None and adj.pen_rows.numel():
        assert adj.presence is not None and adj.frequency is not None and adj.repetition is not None
        y = x.index_select(0, adj.pen_rows)  # [Q, V]
        counts = adj.counts.to(torch.float32)
        generated = counts > 0
        if adj.seen is not None:
            r = adj.repetition[:, None]
            y = torch.where(adj.seen | generated, torch.where(y > 0, y / r, y * r), y)
        y = y - adj.frequency[:, None] * counts - adj.presence[:, None] * generated
        x.index_copy_(0, adj.pen_rows, y)
    return x


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Structured output's masks, in place: logits [B, V] fp32, rows int64 [C] (the constrained
    rows), bitmask int32 [C, W] on the device, W = ceil(V / 32): token i of row ``rows[c]``
    keeps its logit when bit i % 32 of word i // 32 of mask row c is set, else it becomes -inf
    (xgrammar's layout). After the other changes of ``adjust_logits``: -inf stays -inf under the
    penalties and biases."""
    c, v = rows.numel(), logits.shape[1]
    if not c:
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    keep = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(c, -1)[:, :v].bool()  # [C, V]
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~keep, float("-inf")))


# ----------------------------------------------------------------------------------------------
# The race


def _race_torch(logits: torch.Tensor, st: SamplingTensors, thr: torch.Tensor | None) -> torch.Tensor:
    """The exponential race with torch ops (CPU, or CUDA without Triton): [B, V] -> int64 [B]."""
    x = logits.float()
    e = exponentials(random_bits(st.seed, st.position, x.shape[1]))  # [B, V]
    key = x - st.temperature[:, None] * torch.log(e)  # T = 0: the logits themselves
    if thr is not None:
        key = key.masked_fill(x < thr[:, None], float("-inf"))
    return key.argmax(-1)


@functools.cache
def _kernel():
    import importlib

    return importlib.import_module("moeserve.kernels.triton_sampling").race_kernel


RACE_TILE = 1024  # logits per iteration of the race kernel (256 Philox counters)
RACE_PROGRAMS = 4096  # programs aimed at: B rows x S chunks (132 SMs, several waves)


def _race_triton(logits: torch.Tensor, st: SamplingTensors, thr: torch.Tensor | None) -> torch.Tensor:
    """The race in one Triton launch over (row, chunk of the vocabulary), then the first best
    chunk per row: [B, V] -> int64 [B]. Same keys as ``_race_torch`` (its fp32 ops in its order)."""
    b, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tile = min(RACE_TILE, max(16, 1 << (v - 1).bit_length()))
    chunks = max(1, min((v + tile - 1) // tile, (RACE_PROGRAMS + b - 1) // max(b, 1)))
    chunk = ((v + chunks - 1) // chunks + tile - 1) // tile * tile
    s = (v + chunk - 1) // chunk
    best_val = torch.empty(b, s, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(b, s, dtype=torch.long, device=logits.device)
    _kernel()[(b, s)](
        logits,
        logits.stride(0),
        st.temperature,
        thr if thr is not None else st.temperature,
        st.seed,
        st.position,
        best_val,
        best_idx,
        v,
        chunk,
        s,
        HAS_THR=thr is not None,
        N=tile // 4,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return best_idx.gather(1, best_val.argmax(-1, keepdim=True)).squeeze(1)


def warm_up(vocab_size: int, device: torch.device | str) -> int:
    """Compile the race kernel's launch configurations (without and with a top-k / top-p
    threshold) before serving, so that the first request that samples does not wait ~1 s for
    each. Nothing happens unless ``sample`` would take Triton on ``device``. Returns the
    launches run."""
    device = torch.device(device)
    if device.type != "cuda" or not kernels.available():
        return 0
    return _warm_up_race(vocab_size, device)


def _warm_up_race(vocab_size: int, device: torch.device) -> int:
    logits = torch.zeros(1, vocab_size, device=device)  # [1, V] fp32, as steps sample
    for params in (SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=1.0, top_k=2, seed=0)):
        sample(logits, SamplingTensors.build([params], [0], [0], device), backend="triton")
    return 2


def sample(logits: torch.Tensor, st: SamplingTensors, backend: str | None = None) -> torch.Tensor:
    """logits [B, V] (float32, or any float dtype, read as fp32) on any device -> token ids int64
    [B] on that device, with no host sync.

    backend: "torch" or "triton" (the fused race kernel; on CPU tensors only under
    ``TRITON_INTERPRET=1``); None picks Triton for CUDA tensors when it is installed.
    """
    if logits.dim() != 2 or logits.shape[0] != st.temperature.shape[0]:
        raise ValueError(f"logits must be [B, V] with B = {st.temperature.shape[0]} rows, found {list(logits.shape)}")
    if st.all_greedy:
        return logits.argmax(-1)
    thr = thresholds(logits, st)
    if backend is None:
        backend = "triton" if logits.is_cuda and kernels.available() else "torch"
    if backend == "triton":
        return _race_triton(logits, st, thr)
    if backend != "torch":
        raise ValueError(f"backend must be 'torch', 'triton' or None, found {backend!r}")
    return _race_torch(logits, st, thr)


def logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From log_softmax(logits) in fp32, the raw logits before temperature and filters (vLLM's
    default): (logprob of each chosen token float32 [B], top ids int64 [B, num_top], their
    logprobs float32 [B, num_top], most likely first). Computed as log_softmax does it, (x - max)
    - log(sum(exp(x - max))), without writing the [B, V] log-probabilities."""
    b, v = logits.shape
    if not 0 <= num_top <= v:
        raise ValueError(f"num_top must be in 0..{v}, found {num_top}")
    x = logits.float()
    m = x.amax(-1, keepdim=True)  # [B, 1]
    lse = torch.exp(x - m).sum(-1, keepdim=True).log_()  # [B, 1]
    chosen = ((x.gather(1, tokens.view(b, 1)) - m) - lse).squeeze(1)
    top_vals, top_ids = torch.topk(x, num_top, dim=-1)
    return chosen, top_ids, (top_vals - m) - lse


def prompt_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits [n, V], of log_softmax in fp32 (as :func:`logprobs`): the logprob of
    the row's ``targets`` [n] token float32 [n], its rank int64 [n] (1 + the tokens more likely),
    and the ``num_top`` most likely ids int64 [n, num_top] with their logprobs float32 [n,
    num_top]. What echo and prompt_logprobs return for each prompt position, on the device."""
    chosen, top_ids, top_lp = logprobs(logits, targets, num_top)
    x = logits.float()
    rank = 1 + (x > x.gather(1, targets.view(-1, 1))).sum(-1)
    return chosen, rank, top_ids, top_lp


class Sampler:
    """One request's tokens, one row at a time: ``sample`` on a batch of one, at position = the
    number of tokens this sampler drew so far. The single-process model's way to sample; the
    distributed routers call ``sample`` on whole batches and get the same tokens."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = request_seed(params)
        self.position = 0

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] (any float dtype, any device; processed in fp32 on the CPU, so that the
        same logits give the same token whatever device computed them) -> the next token id."""
        row = logits.detach().float().cpu().reshape(1, -1)
        st = SamplingTensors.build([self.params], [self.seed], [self.position], "cpu")
        self.position += 1
        return int(sample(row, st)[0])
