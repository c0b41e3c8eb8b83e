"""Text in and out of the model: the model folder's tokenizer with its special tokens and chat
template, incremental detokenization, and stop strings.

:class:`ModelTokenizer` wraps the model folder's ``tokenizer.json`` with its special tokens and
chat template (``tokenizer_config.json``'s ``chat_template`` or ``chat_template.jinja``),
rendered with jinja2 as transformers' ``apply_chat_template`` does and tokenized without adding
special tokens. :class:`Detokenizer` turns ids into text incrementally (the text equals
``decode(all ids)``) and :class:`StopStrings` finds stop strings in that text across token
boundaries.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from moeserve.router.engine.api import InvalidRequest

if TYPE_CHECKING:
    import jinja2

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
        self._compiled: jinja2.Template | None = None
        try:
            from tokenizers import decoders

            self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        except Exception:  # a stand-in tokenizer in tests
            self.byte_level = False

    @classmethod
    def load(cls, folder: str | Path | None) -> ModelTokenizer | None:
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
            if isinstance(raw, list):  # named templates: take "default"
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
                raw = named.get("default")
            if isinstance(raw, str):
                template = raw
            else:
                raw = _read_json(folder / "chat_template.json").get("chat_template")
                template = raw if isinstance(raw, str) else None
        return cls(tok, specials, template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids. Through ``encode_batch``, which releases the GIL while it tokenizes (a
        plain ``encode`` holds it: 0.14 s for 270,000 characters, during which no other thread
        of the front end, its event loop included, runs)."""
        batch = getattr(self.tokenizer, "encode_batch", None)
        if batch is None:  # a stand-in tokenizer
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)

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
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The chat template rendered as transformers' ``apply_chat_template(..., tokenize=False)``
        renders it: the special tokens, ``tools`` and ``template_kwargs`` are template variables."""
        if self.chat_template is None:
            raise InvalidRequest(
                "this model has no chat template (no chat_template in tokenizer_config.json and "
                "no chat_template.jinja): use /v1/completions with a prompt"
            )
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        import jinja2

        variables = {**self.special_tokens, **(template_kwargs or {})}
        try:
            return self._compiled.render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"the chat template refused the messages: {e}") from None


# generation_config.json's keys vLLM reads as sampling defaults -> the request's parameter
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(folder: str | Path | None, overrides: dict | None = None) -> dict:
    """The sampling defaults of a model folder's ``generation_config.json`` (the keys of
    :data:`GENERATION_KEYS`, as vLLM reads them; ``do_sample`` is not read, as vLLM does not),
    then ``overrides`` (the same keys, vLLM's ``--override-generation-config``). ValueError
    naming the key when a value is out of its range; {} without the file."""
    raw = _read_json(Path(folder) / "generation_config.json") if folder else {}
    merged = {k: v for k, v in raw.items() if k in GENERATION_KEYS and v is not None}
    unknown = sorted(set(overrides or {}) - set(GENERATION_KEYS))
    if unknown:
        raise ValueError(f"unknown generation config keys {unknown}; allowed: {sorted(GENERATION_KEYS)}")
    merged.update(overrides or {})
    out = {}
    for key, value in merged.items():
        name = GENERATION_KEYS[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in ("top_k", "max_new_tokens"):
            ok = ok and isinstance(value, int) and value >= (1 if key == "max_new_tokens" else -1)
        elif key == "temperature":
            ok = ok and value >= 0
        elif key in ("top_p",):
            ok = ok and 0 < value <= 1
        elif key == "min_p":
            ok = ok and 0 <= value <= 1
        elif key == "repetition_penalty":
            ok = ok and 0 < value <= 10
        if not ok:
            raise ValueError(f"generation config {key} = {value!r} is out of its range")
        out[name] = float(value) if name not in ("top_k", "max_tokens") else int(value)
    if out.get("top_k") == -1:
        out["top_k"] = 0
    return out


def chat_template_arg(value: str) -> str:
    """``--chat-template``: a file's text, or the template itself (it has jinja2 tags);
    ValueError otherwise."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value}: no such file, and not a template (no {{{{ or {{% in it)")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def compile_chat_template(source: str) -> jinja2.Template:
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

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
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

    @staticmethod
    def of(tokenizer: ModelTokenizer | None, ids, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` as a Detokenizer fed them one by one writes it."""
        d = Detokenizer(tokenizer, skip_special_tokens)
        for t in ids:
            d.add(t)
        d.flush()
        return d.text

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        if self.tok is None:
            return ""
        ids = self.ids
        before = self.tok.decode(ids[self._prefix : self._read], self.skip) if self._read > self._prefix else ""
        after = self.tok.decode(ids[self._prefix :], self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before) :]
            self._prefix, self._read = self._read, len(ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete character at the very end)."""
        if self.tok is None or self._read == len(self.ids):
            return ""
        ids = self.ids
        before = self.tok.decode(ids[self._prefix : self._read], self.skip) if self._read > self._prefix else ""
        after = self.tok.decode(ids[self._prefix :], self.skip)
        delta = after[len(before) :]
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
        self.sent = 0  # characters of the text already released
        self.matched: str | None = None

    def feed(self, text: str, final: bool = False, match: bool = True) -> tuple[str, bool]:
        """``match`` False (fewer tokens than min_tokens): the text is released unmatched."""
        if self.matched is not None:
            return "", True
        if not match:
            out = text[self.sent :]
            self.sent = len(text)
            return out, False
        if self.stops:
            start = max(0, self.sent - self.hold)
            best = -1
            for s in self.stops:
                i = text.find(s, start)
                if i >= 0 and (best < 0 or i < best):
                    best, self.matched = i, s
            if best >= 0:
                out = text[self.sent : best]
                self.sent = best
                return out, True
        end = len(text)
        if not final and self.hold:
            end = max(self.sent, len(text) - self._partial(text))
        out = text[self.sent : end]
        self.sent = end
        return out, False

    def _partial(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins a stop string."""
        for n in range(min(self.hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
