"""Tool calls on /v1/chat/completions (docs/http-api.md, "Tool calls"): ``tools`` and
``tool_choice`` checked, the grammar that ``required`` and a named function constrain the
output to, and the parsers that find tool calls in a model's text under vLLM's
``--tool-call-parser`` names:

- ``hermes`` (Qwen, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
  number, text before the first one is content;
- ``llama3_json``, ``llama4_json``: ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, several separated by ``;``;
- ``pythonic``, ``llama4_pythonic``: ``[f(a=1, b="x"), g()]``, optionally between
  ``<|python_start|>`` and ``<|python_end|>``: Python calls with literal keyword arguments.

``required`` asks for ``[{"name": ..., "parameters": {...}}, ...]`` (at least one; one when
``parallel_tool_calls`` is false) and a named function for its arguments alone, both as a JSON
schema grammar (vLLM's forms, no whitespace between tokens), so the answer is always a call of a given function with
arguments that follow its ``parameters`` schema.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass

from moeserve.grammar import GrammarSpec
from moeserve.services.http.encode import bad

PARSERS = ("hermes", "llama3_json", "llama4_json", "pythonic", "llama4_pythonic")
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str

    def part(self, index: int) -> dict:
        """OpenAI's ``tool_calls`` entry (a stream's delta has the same shape)."""
        return {
            "index": index,
            "id": "chatcmpl-tool-" + secrets.token_hex(12),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Tools:
    """A chat request's tools (as given, for the chat template), ``choice``: "none", "auto",
    "required" or a function's name; ``parser``: the server's ``--tool-call-parser``."""

    tools: tuple[dict, ...]
    choice: str
    parallel: bool
    parser: str | None

    @property
    def constrained(self) -> bool:
        return self.choice not in ("none", "auto")

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls."""
        return self.constrained or (self.choice == "auto" and self.parser is not None)

    def _schema_of(self, name: str) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    def grammar(self) -> GrammarSpec | None:
        """The constraint of ``required`` or a named function (None for "none" and "auto")."""
        if not self.constrained:
            return None
        if self.choice != "required":
            return GrammarSpec("json_schema", json.dumps(self._schema_of(self.choice)), any_whitespace=False)
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "parameters": self._schema_of(t["function"]["name"]),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return GrammarSpec("json_schema", json.dumps(schema), any_whitespace=False)

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer."""
        if self.choice == "required":
            try:
                value = json.loads(text)
                return None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
            except (ValueError, KeyError, TypeError):  # cut by max_tokens: no call
                return text, []
        if self.constrained:
            return None, [ToolCall(self.choice, text)]
        if self.choice == "auto" and self.parser is not None:
            return parse_calls(self.parser, text)
        return text, []


class ToolStream:
    """One streamed choice's text, held back while it may be a tool call: ``feed`` returns
    the content to send now, ``finish`` the rest of the content and the calls."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.text = ""  # everything the choice wrote
        self.held = ""  # not sent yet
        self.content_only = not tools.parses  # decided: no call can follow

    def feed(self, text: str) -> str:
        self.text += text
        self.held += text
        if self.content_only:
            out, self.held = self.held, ""
            return out
        if self.tools.constrained:
            return ""
        if self.tools.parser == "hermes":  # content may precede a call: send up to a possible "<tool_call>"
            tag = "<tool_call>"
            i = self.held.find(tag)
            if i < 0:
                k = next(
                    (k for k in range(min(len(self.held), len(tag) - 1), 0, -1) if tag.startswith(self.held[-k:])), 0
                )
                i = len(self.held) - k
            out, self.held = self.held[:i], self.held[i:]
            return out
        head = self.text.lstrip()
        starts = (
            ("{", "<|python_tag|>")
            if self.tools.parser in ("llama3_json", "llama4_json")
            else ("[", "<|python_start|>")
        )
        if not head or any(head.startswith(s) or s.startswith(head) for s in starts):
            return ""  # a call, or not known yet
        self.content_only = True
        out, self.held = self.held, ""
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls)."""
        if self.content_only:
            out, self.held = self.held, ""
            return out, []
        _, calls = self.tools.read(self.text)
        out, self.held = ("" if calls else self.held), ""
        return out, calls


def parse_tools(body: dict, parser: str | None) -> Tools | None:
    """A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``; None without
    tools. 400 for a bad shape, a choice naming no given function, or "auto" on a server
    without ``--enable-auto-tool-choice --tool-call-parser``."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad(f"tools must be a list of at most {MAX_TOOLS} function tools", "tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise bad(f'tools[{i}] must be {{"type": "function", "function": {{"name", "parameters"}}}}', "tools")
        if not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
            raise bad(f"tools[{i}].function.name must be 1..64 letters, digits, _ . or -", "tools")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(f["name"])
    if len(set(names)) != len(names):
        raise bad("tools name a function twice", "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        f = choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if choice.get("type") != "function" or name not in names:
            raise bad(
                f'tool_choice must name one of the tools ({", ".join(names)}): {{"type": "function", "function": {{"name"}}}}',
                "tool_choice",
            )
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise bad("tool_choice must be none, auto, required or a named function", "tool_choice")
    if choice == "auto" and parser is None:
        raise bad(
            '"auto" tool choice needs the server started with --enable-auto-tool-choice and --tool-call-parser',
            "tool_choice",
        )
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    return Tools(tuple(tools), str(choice), parallel, parser)


# -- the parsers ------------------------------------------------------------------------------


def _json_calls(text: str, args_key: str) -> list[ToolCall]:
    calls, dec, i = [], json.JSONDecoder(), 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i >= len(text):
            break
        value, i = dec.raw_decode(text, i)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ValueError("not a call")
        args = value.get(args_key, value.get("arguments", value.get("parameters", {})))
        calls.append(ToolCall(value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return calls


def _pythonic_calls(text: str) -> list[ToolCall]:
    tree = ast.parse(text.strip(), mode="eval").body
    if not isinstance(tree, ast.List):
        raise ValueError("not a list of calls")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a call with keyword arguments")
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


def parse_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) a model wrote under ``parser``'s format; a text that is no call stays content."""
    try:
        if parser == "hermes":
            found = _HERMES.findall(text)
            if not found:
                return text, []
            calls = [c for f in found for c in _json_calls(f, "arguments")]
            content = text[: text.index("<tool_call>")].strip()
            return content or None, calls
        if parser in ("llama3_json", "llama4_json"):
            body = text.strip().removeprefix("<|python_tag|>").strip()
            if not body.startswith("{"):
                return text, []
            return None, _json_calls(body, "parameters")
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        if not body.startswith("["):
            return text, []
        return None, _pythonic_calls(body)
    except (ValueError, SyntaxError):
        return text, []


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: a tool call's arguments as an object (Llama's and
    Qwen's templates write ``arguments | tojson``), as vLLM passes them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            fixed = []
            for c in calls:
                f = c.get("function")
                if isinstance(f, dict) and isinstance(f.get("arguments"), str):
                    try:
                        c = {**c, "function": {**f, "arguments": json.loads(f["arguments"])}}
                    except ValueError:
                        pass
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out


__all__ = ["PARSERS", "ToolCall", "Tools", "ToolStream", "parse_tools", "parse_calls", "template_messages"]
