"""Structured output's request fields: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` (and its older ``guided_*`` names), turned into the one
:class:`~moeserve.grammar.GrammarSpec` a request's tokens are constrained to (docs/http-api.md,
"Structured output").

    response_format      {"type": "text"} | {"type": "json_object"}
                         | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs   {"json": schema | text, "regex", "choice": [...], "grammar": EBNF,
                          "json_object": true, "disable_any_whitespace": bool}
    guided_json, guided_regex, guided_choice, guided_grammar, guided_whitespace_pattern (no)

At most one constraint per request; the shapes are checked here, the grammar itself by
``moeserve.grammar.check`` (off the event loop, with a deadline: ``Admission.check_grammar``).
"""

from __future__ import annotations

import json

from moeserve.grammar import GrammarError, GrammarSpec, choice_grammar
from moeserve.services.http.encode import bad

MAX_CHOICES = 1024  # guided choice's strings
STRUCTURED_KEYS = {
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
}
_SO_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
_SO_OPTIONS = (
    "disable_any_whitespace",
    "disable_fallback",
    "disable_additional_properties",
    "backend",
    "whitespace_pattern",
)


def _schema_text(value, where: str) -> str:
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as e:
            raise bad(f"{where} is not valid JSON: {e}", where) from None
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    raise bad(f"{where} must be a JSON schema (an object, or its JSON text), got {type(value).__name__}", where)


def _choice(value, where: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad(f"{where} must be a non-empty list of non-empty strings", where)
    if len(value) > MAX_CHOICES:
        raise bad(f"{where} has {len(value)} strings; at most {MAX_CHOICES}", where)
    return choice_grammar(value)


def _text(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad(f"{where} must be a non-empty string", where)
    return value


def _response_format(rf) -> GrammarSpec | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        kind = rf.get("type") if isinstance(rf, dict) else rf
        raise bad(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {json.dumps(kind)[:60]}",
            "response_format",
        )
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return GrammarSpec("json_object")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or "schema" not in js:
        raise bad(
            "response_format json_schema needs json_schema: {name, schema} (the schema as an object)", "response_format"
        )
    return GrammarSpec("json_schema", _schema_text(js["schema"], "response_format.json_schema.schema"))


def _structured_outputs(so) -> GrammarSpec | None:
    if not isinstance(so, dict):
        raise bad(f"structured_outputs must be an object with one of {', '.join(_SO_FIELDS)}", "structured_outputs")
    unknown = sorted(k for k in so if k not in _SO_FIELDS and k not in _SO_OPTIONS and k != "structural_tag")
    if unknown or so.get("structural_tag") is not None:
        name = unknown[0] if unknown else "structural_tag"
        raise bad(
            f"structured_outputs.{name} is not supported (supported: {', '.join(_SO_FIELDS + _SO_OPTIONS)})",
            "structured_outputs",
        )
    if so.get("whitespace_pattern") is not None:
        raise bad("structured_outputs.whitespace_pattern is not supported", "structured_outputs")
    given = [k for k in _SO_FIELDS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise bad(f"structured_outputs sets {' and '.join(given)}: give one constraint", "structured_outputs")
    ws = not bool(so.get("disable_any_whitespace", False))
    if not given:
        return None
    k, v = given[0], so[given[0]]
    where = f"structured_outputs.{k}"
    if k == "json":
        return GrammarSpec("json_schema", _schema_text(v, where), ws)
    if k == "json_object":
        return GrammarSpec("json_object", "", ws)
    if k == "regex":
        return GrammarSpec("regex", _text(v, where))
    if k == "choice":
        return GrammarSpec("ebnf", _choice(v, where))
    return GrammarSpec("ebnf", _text(v, where))


def parse_structured(body: dict) -> GrammarSpec | None:
    """The request's constraint (None: none); 400 for a bad shape or two constraints."""
    specs: list[tuple[str, GrammarSpec]] = []
    if body.get("guided_whitespace_pattern") is not None:
        raise bad("guided_whitespace_pattern is not supported", "guided_whitespace_pattern")
    try:
        if body.get("response_format") is not None:
            spec = _response_format(body["response_format"])
            if spec is not None:
                specs.append(("response_format", spec))
        if body.get("structured_outputs") is not None:
            spec = _structured_outputs(body["structured_outputs"])
            if spec is not None:
                specs.append(("structured_outputs", spec))
        for name, make in (
            ("guided_json", lambda v: GrammarSpec("json_schema", _schema_text(v, "guided_json"))),
            ("guided_regex", lambda v: GrammarSpec("regex", _text(v, "guided_regex"))),
            ("guided_choice", lambda v: GrammarSpec("ebnf", _choice(v, "guided_choice"))),
            ("guided_grammar", lambda v: GrammarSpec("ebnf", _text(v, "guided_grammar"))),
        ):
            if body.get(name) is not None:
                specs.append((name, make(body[name])))
    except GrammarError as e:  # GrammarSpec's own checks (the text's size)
        raise bad(str(e), "response_format") from None
    if len(specs) > 1:
        raise bad(f"{' and '.join(n for n, _ in specs)} both constrain the output: give one", specs[1][0])
    return specs[0][1] if specs else None


__all__ = ["parse_structured", "STRUCTURED_KEYS", "MAX_CHOICES"]
