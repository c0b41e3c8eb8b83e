"""The serving front end's admission path, shared by the gRPC servicer and the HTTP API.

One :class:`Admission` per front end process turns what a client sent into
:class:`~moeserve.router.engine.api.GenerateRequest` s and streams their events from the leader
(:class:`~moeserve.router.engine.channel.AsyncEngineClient`):

- **limits before conversion**: a prompt text longer than ``max_model_len *
  MAX_CHARS_PER_TOKEN`` characters, a list of more ids than ``max_model_len``, more stop ids
  than ``max_stop_ids`` are refused before anything is tokenized or copied;
- **tokenization off the event loop** (``asyncio.to_thread``): a long prompt or a chat
  template never stalls the other requests' streams;
- **the request**: ``SamplingParams`` checks its own values; everything else (vocabulary,
  ``max_model_len``, ``max_num_batched_tokens``, the queue) the leader's engine validates once,
  as it admits the request;
- **events**: :class:`RequestStream` iterates a request's ``Token`` and ``Finished`` events,
  records the front end's metrics, raises :class:`RequestFailed` when the cluster failed under
  the request; closing it (or cancelling the task that iterates it) closes the request's
  connection to the leader, which cancels the request there.

Text (the tokenizer, chat templates, detokenization, stop strings): ``moeserve.services.tokenizer``.
"""

from __future__ import annotations

import asyncio
import collections
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from moeserve import grammar as grammars
from moeserve.grammar import GrammarSpec
from moeserve.router.engine.api import Failed, Finished, FirstToken, GenerateRequest, InvalidRequest, Token, Unavailable
from moeserve.sampling import SamplingParams
from moeserve.services import limits as L
from moeserve.services.tokenizer import ModelTokenizer

DEFAULT_MAX_MODEL_LEN = 4096
MAX_CHARS_PER_TOKEN = 64  # a text prompt may have at most max_model_len * this many characters
MAX_STOP_IDS = 256
MAX_STOP_STRINGS = L.MAX_STOP_STRINGS
MAX_STOP_STRING_CHARS = L.MAX_STOP_STRING_CHARS
DEFAULT_CHOICES_IN_FLIGHT = 16  # choices of one HTTP request on the leader at a time
TOKENIZER_THREADS = 2  # texts tokenized at once; more wait their turn
INLINE_TEXT_CHARS = 1024  # shorter texts are tokenized on the event loop (cheaper than a hand-off)
TEXT_WORK_S = 10.0  # rendering a chat template or tokenizing a text that takes longer is refused


class RequestFailed(Unavailable):
    """The cluster failed under a request that had been admitted (a ``Failed`` event)."""


@dataclass(frozen=True)
class AdmissionLimits:
    """What the front end refuses before converting anything (the leader checks the rest).

    max_model_len: prompt + generated tokens; max_chars_per_token: a prompt text may have
    max_model_len x this many characters; max_stop_ids: stop token ids of a request;
    vocab_size: the model's vocabulary when the front end knows it (its model folder), else
    None (ids are bounded by the wire, and the leader checks the vocabulary);
    max_request_tokens: the tokens one HTTP request may make the cluster hold, n x (prompt +
    max_tokens) summed over its prompts (0: 16 x max_model_len); choices_in_flight: the choices
    of one HTTP request on the leader at a time (its share of the batch; with logprobs a
    quarter of it, at least 1), the next starting as one ends; max_logprobs: the most top
    logprobs a request may ask for, per token and per prompt position (``--max-logprobs``).
    """

    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    max_chars_per_token: int = MAX_CHARS_PER_TOKEN
    max_stop_ids: int = MAX_STOP_IDS
    vocab_size: int | None = None
    max_request_tokens: int = 0
    choices_in_flight: int = DEFAULT_CHOICES_IN_FLIGHT
    max_logprobs: int = L.MAX_LOGPROBS

    def __post_init__(self):
        for name in ("max_model_len", "max_chars_per_token", "max_stop_ids", "choices_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.max_request_tokens < 0:
            raise ValueError(f"max_request_tokens must be >= 0 (0: 16 x max_model_len), got {self.max_request_tokens}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")

    @property
    def request_tokens(self) -> int:
        """The tokens one HTTP request may make the cluster hold (n x (prompt + max_tokens), summed)."""
        return self.max_request_tokens or 16 * self.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.max_chars_per_token

    @property
    def max_request_bytes(self) -> int:
        """The largest serialized gRPC GenerateRequest that can be valid: a prompt text of
        ``max_prompt_chars`` characters (4 bytes each at most in UTF-8) or ``max_model_len`` ids,
        and ``max_stop_ids`` stop ids (11 bytes each at most on the wire), and the scalar
        fields. The serving server receives nothing larger (gRPC answers RESOURCE_EXHAUSTED
        before parsing it)."""
        return 4 * self.max_prompt_chars + 11 * (self.max_model_len + self.max_stop_ids) + (64 << 10)


def vocab_size_of(model_dir: str | None) -> int | None:
    """The vocabulary size in a model folder's config.json (Llama 4: its text_config), or None
    without one (read here, without the models package: the front end holds no torch)."""
    import json
    from pathlib import Path

    if not model_dir:
        return None
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    text = raw.get("text_config")
    v = (text if isinstance(text, dict) and "vocab_size" in text else raw).get("vocab_size")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


COALESCE_ENV = "MOESERVE_STREAM_COALESCE"


def stream_coalescing() -> bool:
    """``$MOESERVE_STREAM_COALESCE``: 1 (the default) sends the tokens a stream fell behind on
    in one message (gRPC) or SSE chunk (HTTP); 0 one per token (the measurement's other side)."""
    v = os.environ.get(COALESCE_ENV, "1")
    if v not in ("0", "1"):
        raise ValueError(
            f"${COALESCE_ENV} must be 1 (the tokens a stream fell behind on leave in one message; "
            f"the default) or 0 (one message per token), got {v!r}"
        )
    return v == "1"


# -- admission --------------------------------------------------------------------------------


class RequestStream:
    """One admitted request's events (``Token`` then ``Finished``) as an async iterator, or a
    list at a time (:meth:`batch`). Raises the engine's exceptions (InvalidRequest, QueueFull,
    Unavailable, ...) and :class:`RequestFailed`. :meth:`aclose` ends it early, which cancels
    the request on the leader; ``close_reason`` names why for the metrics (default
    "cancelled")."""

    def __init__(self, admission: Admission, req: GenerateRequest):
        self.req = req
        engine = admission.engine
        batches = getattr(engine, "generate_batches", None)  # a stand-in may have only generate
        self._gen = batches([req]) if batches is not None else _one_at_a_time(engine.generate([req]))
        self._ready: collections.deque = collections.deque()  # events received, not yet taken
        self._record = admission.metrics.request(len(req.prompt_ids)) if admission.metrics is not None else None
        self._done = False
        self.close_reason = "cancelled"

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        if not self._ready:
            try:
                self._ready.extend(ev for _, ev in await self._gen.__anext__())
            except StopAsyncIteration:
                self._finish("error")  # the leader ended the stream without a finish event
                raise
            except BaseException:
                self._finish(self.close_reason if _cancelled() else "error")
                await self._close_gen()
                raise
        return await self._take(self._ready.popleft())

    async def batch(self) -> list:
        """Every event that has arrived, at least one (waits for it): the tokens a front end
        fell behind on, to send in one message. A failure comes after the tokens before it,
        raised by the next call; StopAsyncIteration once the stream ended."""
        out = [await self.__anext__()]
        while self._ready and not self._done and not isinstance(self._ready[0], Failed):
            out.append(await self._take(self._ready.popleft()))
        return out

    async def _take(self, ev):
        if isinstance(ev, Token):
            if self._record is not None:
                if isinstance(ev, FirstToken):
                    self._record.engine_times(ev.queued_s, ev.prefill_s)
                    self._record.token()
                    self._record.ttft_parts(ev.hops, ev.queued_s, ev.prefill_s)
                else:
                    self._record.token()
        elif isinstance(ev, Finished):
            self._finish(str(ev.reason))
            await self._close_gen()
        elif isinstance(ev, Failed):
            self._finish("error")
            await self._close_gen()
            if ev.invalid:  # the request's own fault (a grammar a router could not compile)
                raise InvalidRequest(ev.message)
            raise RequestFailed(ev.message)
        return ev

    def _finish(self, reason: str) -> None:
        if not self._done:
            self._done = True
            if self._record is not None:
                self._record.finish(reason)

    async def _close_gen(self) -> None:
        try:
            await self._gen.aclose()
        except RuntimeError:  # closed while another task iterates it: it closes itself
            pass

    async def aclose(self, reason: str | None = None) -> None:
        self._finish(reason or self.close_reason)
        await self._close_gen()


async def _one_at_a_time(gen):
    """An engine's ``generate`` as ``generate_batches``: each item a list of its own."""
    try:
        async for item in gen:
            yield [item]
    finally:
        await gen.aclose()


def _cancelled() -> bool:
    task = asyncio.current_task()
    return bool(task is not None and task.cancelling())


class Admission:
    """The shared admission path of one front end. ``engine``: an AsyncEngineClient (or a
    stand-in with ``generate``); ``tokenizer``: a ModelTokenizer, a ``tokenizers.Tokenizer`` or
    None; ``metrics``: a moeserve.ops.metrics.FrontendMetrics or None."""

    def __init__(self, engine, tokenizer=None, metrics=None, limits: AdmissionLimits = AdmissionLimits()):
        self.engine = engine
        if tokenizer is not None and not isinstance(tokenizer, ModelTokenizer):
            tokenizer = ModelTokenizer(tokenizer)
        self.tokenizer: ModelTokenizer | None = tokenizer
        self.metrics = metrics
        self.limits = limits
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    async def _off_loop(self, fn, *args):
        """``fn(*args)`` on the tokenizer threads (at most TOKENIZER_THREADS texts at once), in
        at most TEXT_WORK_S: the budget bounds the work, this bounds what a request waits."""
        try:
            return await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._pool, fn, *args), TEXT_WORK_S
            )
        except TimeoutError:
            raise InvalidRequest(
                f"this request's text took more than {TEXT_WORK_S:g} s to render or tokenize; send less of it"
            ) from None

    # -- prompts ------------------------------------------------------------------------------

    def _need_tokenizer(self, what: str) -> ModelTokenizer:
        if self.tokenizer is None:
            raise InvalidRequest(f"this server has no tokenizer (no tokenizer.json in the model folder): {what}")
        return self.tokenizer

    def check_text(self, text: str, what: str = "the prompt") -> None:
        limit = self.limits.max_prompt_chars
        if len(text) > limit:
            raise InvalidRequest(
                f"{what} has {len(text)} characters, more than this server tokenizes "
                f"({limit} = max_model_len {self.limits.max_model_len} x {self.limits.max_chars_per_token})"
            )
        L.check_text(text, what)

    def _check_length(self, n: int, what: str = "the prompt") -> None:
        if n >= self.limits.max_model_len:
            raise InvalidRequest(
                f"{what} has {n} tokens; max_model_len is {self.limits.max_model_len} "
                f"(prompt + generated tokens), so it must have fewer"
            )

    async def encode(self, text: str, add_special_tokens: bool = True, allow_empty: bool = False) -> tuple[int, ...]:
        """Prompt text -> ids, off the event loop (a short text on it), after the size check."""
        tok = self._need_tokenizer("send token ids instead of text")
        self.check_text(text)
        if len(text) <= INLINE_TEXT_CHARS:
            ids = tok.encode(text, add_special_tokens)
        else:
            ids = await self._off_loop(tok.encode, text, add_special_tokens)
        if not ids and not allow_empty:
            raise InvalidRequest("the prompt text encodes to no tokens: give a non-empty prompt")
        self._check_length(len(ids))
        return tuple(ids)

    def token_ids(self, ids, what: str = "prompt token ids") -> tuple[int, ...]:
        """A list of ids from a client: its length is checked before it is converted, then each
        id against the vocabulary the front end knows (``limits.token_ids``)."""
        self._check_length(len(ids))
        return L.token_ids(ids, self.limits, what)

    async def chat_ids(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[int, ...]:
        """Messages (and ``tools``, the template's ``tools`` variable) -> the chat template's
        text -> ids (no special tokens added: the template writes them), off the event loop.
        Every field of the messages, the tools and the template variables count against the
        request's budget before the template sees them, and the rendered text against the
        prompt's characters before the tokenizer does."""
        tok = self._need_tokenizer("chat needs the model's tokenizer and chat template")
        L.request_cost([messages, template_kwargs, tools], L.request_budget(self.limits))

        def render():
            text = tok.render_chat(messages, add_generation_prompt, template_kwargs, tools)
            self.check_text(text, "the rendered chat prompt")
            return text

        text = await self._off_loop(render)
        ids = await self._off_loop(tok.encode, text, False)
        if not ids:
            raise InvalidRequest("the messages render to an empty prompt")
        self._check_length(len(ids), "the rendered chat prompt")
        return tuple(ids)

    # -- requests -----------------------------------------------------------------------------

    def request(
        self,
        prompt_ids: tuple[int, ...],
        max_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids=(),
        ignore_eos: bool = False,
        return_logits: str = "",
        prompt_logprobs: int = -1,
        cache_salt: str = "",
        grammar: GrammarSpec | None = None,
        **adjust,
    ) -> GenerateRequest:
        """The engine request; InvalidRequest for what only this side checks: every value
        against its row of ``limits.BOUNDS``. ``stop_token_ids`` may be any sized sequence (a
        protobuf repeated field): its length is checked before it is converted. ``adjust``: the
        other ``SamplingParams`` fields (min_p, penalties, min_tokens, logit_bias)."""
        lim = self.limits
        if len(stop_token_ids) > lim.max_stop_ids:
            raise L.BoundError(f"{len(stop_token_ids)} stop token ids; at most {lim.max_stop_ids}", "stop_token_ids")
        stop = L.token_ids(stop_token_ids, lim, "stop token ids", "stop_token_ids") if stop_token_ids else ()
        max_tokens = L.bounded("max_tokens", max_tokens, lim)
        temperature = L.bounded("temperature", temperature, lim)
        top_p = L.bounded("top_p", top_p, lim)
        top_k = L.bounded("top_k", top_k, lim)
        top_k = 0 if top_k == -1 else top_k  # -1 is "no top-k" too (vLLM's, and the HTTP API's)
        seed = L.bounded("seed", seed, lim)
        if prompt_logprobs != -1:
            prompt_logprobs = L.bounded("prompt_logprobs", prompt_logprobs, lim)
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
            if name in adjust:
                adjust[name] = L.bounded(name, adjust[name], lim)
        if adjust.get("logit_bias"):
            bias = adjust["logit_bias"]
            ids = L.token_ids([t for t, _ in bias], lim, "logit_bias keys", "logit_bias")
            adjust["logit_bias"] = tuple((t, L.bounded("logit_bias", b, lim)) for t, (_, b) in zip(ids, bias))
        try:
            sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, **adjust)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        return GenerateRequest(
            tuple(prompt_ids),
            int(max_tokens),
            sp,
            stop,
            bool(ignore_eos),
            return_logits,
            int(prompt_logprobs),
            cache_salt=cache_salt,
            grammar=grammar,
        )

    async def check_grammar(self, spec: GrammarSpec) -> None:
        """Structured output's checks (``moeserve.grammar.check``: size, keywords, bounds and the
        conversion to a grammar), off the event loop and within ``CHECK_TIMEOUT_S``;
        InvalidRequest naming the problem (the missing package included)."""
        await asyncio.to_thread(grammars.missing)  # imports the library once (seconds), outside the deadline
        try:
            await asyncio.wait_for(asyncio.to_thread(grammars.check, spec), grammars.CHECK_TIMEOUT_S)
        except TimeoutError:
            raise InvalidRequest(
                f"the {spec.kind.replace('_', ' ')} took longer than {grammars.CHECK_TIMEOUT_S:.0f} s to convert "
                f"to a grammar: simplify it"
            ) from None
        except grammars.GrammarError as e:
            raise InvalidRequest(str(e)) from None

    def open(self, req: GenerateRequest) -> RequestStream:
        """Start streaming ``req`` from the leader (it connects on the first iteration)."""
        return RequestStream(self, req)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""


__all__ = ["Admission", "AdmissionLimits", "RequestStream", "RequestFailed"]
