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

Text: :class:`ModelTokenizer` wraps the model folder's ``tokenizer.json`` with its special
tokens and chat template (``tokenizer_config.json``'s ``chat_template`` or
``chat_template.jinja``), rendered with jinja2 as transformers' ``apply_chat_template`` does and
tokenized without adding special tokens. :class:`Detokenizer` turns ids into text incrementally
(the text equals ``decode(all ids)``) and :class:`StopStrings` finds stop strings in that text
across token boundaries.
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path

from moeserve.router.engine.api import (Failed, Finished, GenerateRequest, InvalidRequest, Token, Unavailable)
from moeserve.sampling import SamplingParams

DEFAULT_MAX_MODEL_LEN = 4096
MAX_CHARS_PER_TOKEN = 64           # a text prompt may have at most max_model_len * this many characters
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


# -- the tokenizer, its special tokens and its chat template ----------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies spell)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ModelTokenizer:
    """A model folder's tokenizer: ``tokenizer.json`` (the ``tokenizers`` library), its special
    tokens and its chat template."""

    def __init__(self, tokenizer, special_tokens: dict[str, str] | None = None, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self._compiled = None
        try:
            from tokenizers import decoders
            self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        except Exception:                                 # a stand-in tokenizer in tests
            self.byte_level = False

    @classmethod
    def load(cls, folder: str | Path | None) -> "ModelTokenizer | None":
        """The folder's tokenizer, or None when it has no ``tokenizer.json``."""
        if not folder:
            return None
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            return None
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(path))
        config = _read_json(folder / "tokenizer_config.json")
        specials = {}
        for source in (_read_json(folder / "special_tokens_map.json"), config):
            for key in SPECIAL_TOKEN_KEYS:
                content = _token_content(source.get(key))
                if content is not None:
                    specials[key] = content
        template = None
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text()
        else:
            raw = config.get("chat_template")
            if isinstance(raw, list):                     # named templates: take "default"
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
                raw = named.get("default")
            if isinstance(raw, str):
                template = raw
            else:
                raw = _read_json(folder / "chat_template.json").get("chat_template")
                template = raw if isinstance(raw, str) else None
        return cls(tok, specials, template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (a partial UTF-8 character shows as U+FFFD)."""
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (byte-level vocabularies exactly; others by its text)."""
        piece = self.tokenizer.id_to_token(int(token_id))
        if piece is None:
            return b""
        if self.byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):     # byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None) -> str:
        """The chat template rendered as transformers' ``apply_chat_template(..., tokenize=False)``
        renders it: the special tokens and ``template_kwargs`` are template variables."""
        if self.chat_template is None:
            raise InvalidRequest("this model has no chat template (no chat_template in tokenizer_config.json and "
                                 "no chat_template.jinja): use /v1/completions with a prompt")
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        import jinja2
        variables = {**self.special_tokens, **(template_kwargs or {})}
        try:
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"the chat template refused the messages: {e}") from None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def compile_chat_template(source: str):
    """A jinja2 template in the environment transformers renders chat templates in: sandboxed,
    trim_blocks and lstrip_blocks, loop controls, ``{% generation %}`` blocks, the ``tojson``
    filter without ASCII escaping, ``raise_exception`` and ``strftime_now``."""
    from datetime import datetime

    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """transformers' ``{% generation %}...{% endgeneration %}`` (marks assistant text): rendered as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# -- text out ---------------------------------------------------------------------------------

class Detokenizer:
    """Generated ids -> text, incrementally: :meth:`add` returns the text one more token adds
    (held back while it ends in an incomplete character); the concatenation equals
    ``decode(all ids)``. Decodes a short window of ids per token (a prefix keeps what a
    tokenizer strips at the start of a text, such as SentencePiece's leading space)."""

    def __init__(self, tokenizer: ModelTokenizer | None, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        if self.tok is None:
            return ""
        ids = self.ids
        before = self.tok.decode(ids[self._prefix:self._read], self.skip) if self._read > self._prefix else ""
        after = self.tok.decode(ids[self._prefix:], self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self._prefix, self._read = self._read, len(ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete character at the very end)."""
        if self.tok is None or self._read == len(self.ids):
            return ""
        ids = self.ids
        before = self.tok.decode(ids[self._prefix:self._read], self.skip) if self._read > self._prefix else ""
        after = self.tok.decode(ids[self._prefix:], self.skip)
        delta = after[len(before):]
        self._prefix = self._read = len(ids)
        self.text += delta
        return delta


class StopStrings:
    """Stop strings matched on the generated text across token boundaries. :meth:`feed` takes
    the whole text so far and answers (text that is safe to send now, whether a stop string
    ended it); the stop string itself is never part of the text sent."""

    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.sent = 0                          # characters of the text already released
        self.matched: str | None = None

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        if self.stops:
            start = max(0, self.sent - self.hold)
            best = -1
            for s in self.stops:
                i = text.find(s, start)
                if i >= 0 and (best < 0 or i < best):
                    best, self.matched = i, s
            if best >= 0:
                out = text[self.sent:best]
                self.sent = best
                return out, True
        end = len(text)
        if not final and self.hold:
            end = max(self.sent, len(text) - self._partial(text))
        out = text[self.sent:end]
        self.sent = end
        return out, False

    def _partial(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins a stop string."""
        for n in range(min(self.hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


# -- admission --------------------------------------------------------------------------------

class RequestStream:
    """One admitted request's events (``Token`` then ``Finished``) as an async iterator.
    Raises the engine's exceptions (InvalidRequest, QueueFull, Unavailable, ...) and
    :class:`RequestFailed`. :meth:`aclose` ends it early, which cancels the request on the
    leader; ``close_reason`` names why for the metrics (default "cancelled")."""

    def __init__(self, admission: "Admission", req: GenerateRequest):
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
            self._finish("error")              # the leader ended the stream without a finish event
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
        except RuntimeError:                   # closed while another task iterates it: it closes itself
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
    None; ``metrics``: a moeserve.metrics.FrontendMetrics or None."""

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
            raise InvalidRequest(f"{what} has {len(text)} characters, more than this server tokenizes "
                                 f"({limit} = max_model_len {self.limits.max_model_len} x {self.limits.max_chars_per_token})")

    def _check_length(self, n: int, what: str = "the prompt") -> None:
        if n >= self.limits.max_model_len:
            raise InvalidRequest(f"{what} has {n} tokens; max_model_len is {self.limits.max_model_len} "
                                 f"(prompt + generated tokens), so it must have fewer")

    async def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """Prompt text -> ids, off the event loop, after the size check."""
        tok = self._need_tokenizer("send token ids instead of text")
        self.check_text(text)
        ids = await asyncio.to_thread(tok.encode, text, add_special_tokens)
        if not ids:
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

    async def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                       template_kwargs: dict | None = None) -> tuple[int, ...]:
        """Messages -> the chat template's text -> ids (no special tokens added: the template
        writes them), off the event loop."""
        tok = self._need_tokenizer("chat needs the model's tokenizer and chat template")
        self.check_text("".join(str(m.get("content") or "") for m in messages), "the messages")

        def render_and_encode():
            return tok.encode(tok.render_chat(messages, add_generation_prompt, template_kwargs), False)

        ids = await asyncio.to_thread(render_and_encode)
        if not ids:
            raise InvalidRequest("the messages render to an empty prompt")
        self._check_length(len(ids), "the rendered chat prompt")
        return tuple(ids)

    # -- requests -----------------------------------------------------------------------------

    def request(self, prompt_ids: tuple[int, ...], max_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                top_k: int = 0, seed: int | None = None, stop_token_ids=(), ignore_eos: bool = False,
                return_logits: str = "") -> GenerateRequest:
        """The engine request; InvalidRequest for what only this side checks. ``stop_token_ids``
        may be any sized sequence (a protobuf repeated field): its length is checked before it
        is converted."""
        if len(stop_token_ids) > self.limits.max_stop_ids:
            raise InvalidRequest(f"{len(stop_token_ids)} stop token ids; at most {self.limits.max_stop_ids}")
        stop = self._ints(stop_token_ids, "stop token ids") if stop_token_ids else ()
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and math.isnan(temperature):
            raise InvalidRequest("temperature must be a finite number >= 0 (0 = greedy), found nan")
        try:
            sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        return GenerateRequest(tuple(prompt_ids), int(max_tokens), sp, stop, bool(ignore_eos), return_logits)

    def open(self, req: GenerateRequest) -> RequestStream:
        """Start streaming ``req`` from the leader (it connects on the first iteration)."""
        return RequestStream(self, req)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""


__all__ = ["Admission", "AdmissionLimits", "ModelTokenizer", "RequestStream", "RequestFailed", "Detokenizer",
           "StopStrings", "compile_chat_template"]
