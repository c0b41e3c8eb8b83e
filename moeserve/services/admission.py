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
import math
from dataclasses import dataclass

from moeserve import grammar as grammars
from moeserve.grammar import GrammarSpec
from moeserve.router.engine.api import Failed, Finished, GenerateRequest, InvalidRequest, Token, Unavailable
from moeserve.sampling import SamplingParams
from moeserve.services.tokenizer import ModelTokenizer

DEFAULT_MAX_MODEL_LEN = 4096
MAX_CHARS_PER_TOKEN = 64  # a text prompt may have at most max_model_len * this many characters
MAX_STOP_IDS = 256
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024


class RequestFailed(Unavailable):
    """The cluster failed under a request that had been admitted (a ``Failed`` event)."""


@dataclass(frozen=True)
class AdmissionLimits:
    """What the front end refuses before converting anything (the leader checks the rest)."""

    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    max_chars_per_token: int = MAX_CHARS_PER_TOKEN
    max_stop_ids: int = MAX_STOP_IDS

    def __post_init__(self):
        for name in ("max_model_len", "max_chars_per_token", "max_stop_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

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


# -- admission --------------------------------------------------------------------------------


class RequestStream:
    """One admitted request's events (``Token`` then ``Finished``) as an async iterator.
    Raises the engine's exceptions (InvalidRequest, QueueFull, Unavailable, ...) and
    :class:`RequestFailed`. :meth:`aclose` ends it early, which cancels the request on the
    leader; ``close_reason`` names why for the metrics (default "cancelled")."""

    def __init__(self, admission: Admission, req: GenerateRequest):
        self.req = req
        self._gen = admission.engine.generate([req])
        self._record = admission.metrics.request(len(req.prompt_ids)) if admission.metrics is not None else None
        self._done = False
        self.close_reason = "cancelled"

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        try:
            _, ev = await self._gen.__anext__()
        except StopAsyncIteration:
            self._finish("error")  # the leader ended the stream without a finish event
            raise
        except BaseException:
            self._finish(self.close_reason if _cancelled() else "error")
            await self._close_gen()
            raise
        if isinstance(ev, Token):
            if self._record is not None:
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

    def _check_length(self, n: int, what: str = "the prompt") -> None:
        if n >= self.limits.max_model_len:
            raise InvalidRequest(
                f"{what} has {n} tokens; max_model_len is {self.limits.max_model_len} "
                f"(prompt + generated tokens), so it must have fewer"
            )

    async def encode(self, text: str, add_special_tokens: bool = True, allow_empty: bool = False) -> tuple[int, ...]:
        """Prompt text -> ids, off the event loop, after the size check."""
        tok = self._need_tokenizer("send token ids instead of text")
        self.check_text(text)
        ids = await asyncio.to_thread(tok.encode, text, add_special_tokens)
        if not ids and not allow_empty:
            raise InvalidRequest("the prompt text encodes to no tokens: give a non-empty prompt")
        self._check_length(len(ids))
        return tuple(ids)

    def token_ids(self, ids, what: str = "prompt token ids") -> tuple[int, ...]:
        """A list of ids from a client: its length is checked before it is converted."""
        self._check_length(len(ids))
        return self._ints(ids, what)

    @staticmethod
    def _ints(ids, what: str) -> tuple[int, ...]:
        out = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequest(f"{what} must be integers, found {t!r}")
            out.append(int(t))
        return tuple(out)

    async def chat_ids(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[int, ...]:
        """Messages (and ``tools``, the template's ``tools`` variable) -> the chat template's
        text -> ids (no special tokens added: the template writes them), off the event loop."""
        tok = self._need_tokenizer("chat needs the model's tokenizer and chat template")
        self.check_text("".join(str(m.get("content") or "") for m in messages), "the messages")

        def render_and_encode():
            return tok.encode(tok.render_chat(messages, add_generation_prompt, template_kwargs, tools), False)

        ids = await asyncio.to_thread(render_and_encode)
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
        """The engine request; InvalidRequest for what only this side checks. ``stop_token_ids``
        may be any sized sequence (a protobuf repeated field): its length is checked before it
        is converted. ``adjust``: the other ``SamplingParams`` fields (min_p, penalties,
        min_tokens, logit_bias)."""
        if len(stop_token_ids) > self.limits.max_stop_ids:
            raise InvalidRequest(f"{len(stop_token_ids)} stop token ids; at most {self.limits.max_stop_ids}")
        stop = self._ints(stop_token_ids, "stop token ids") if stop_token_ids else ()
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and math.isnan(temperature):
            raise InvalidRequest("temperature must be a finite number >= 0 (0 = greedy), found nan")
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
