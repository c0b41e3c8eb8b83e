"""Structured output's pieces without a cluster: the HTTP fields that name a constraint, the front
end's checks and bounds (each refusal names the problem), the token mask in the batched sampler
(per row, the others untouched), a router's matchers fed the token sampled in the step before
and restarted from a header after a preemption, the leader's table of grammars (announced once,
ready when every router compiled it, a failure refused next time), and a server without
xgrammar refusing constrained requests by the package's name while it serves the rest."""

import asyncio
import importlib.util
import json
import time

import pytest
import torch

from moeserve import grammar
from moeserve.grammar import GrammarError, GrammarSpec
from moeserve.models import init_model
from moeserve.sampling import apply_token_bitmask
from moeserve.services.http.encode import ApiError
from moeserve.services.http.structured import parse_structured

pytestmark = pytest.mark.timeout(120)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "body,kind",
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json_schema"),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema"),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema"),
        ({"structured_outputs": {"json_object": True}}, "json_object"),
        ({"structured_outputs": {"regex": "[ab]+"}}, "regex"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, "ebnf"),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "ebnf"),
        ({"guided_json": SCHEMA}, "json_schema"),
        ({"guided_regex": "[ab]+"}, "regex"),
        ({"guided_choice": ["x", "y"]}, "ebnf"),
        ({"guided_grammar": 'root ::= "x"'}, "ebnf"),
    ],
)
def test_each_field_names_one_grammar(body, kind):
    assert parse_structured(body).kind == kind


def test_text_and_no_field_constrain_nothing_and_whitespace_can_be_turned_off():
    assert parse_structured({"response_format": {"type": "text"}}) is None
    assert parse_structured({}) is None
    spec = parse_structured({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    assert spec.any_whitespace is False


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "give one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "give one"),
        ({"response_format": {"type": "json_schema"}}, "json_schema: {name, schema}"),
        ({"guided_json": "{oops"}, "not valid JSON"),
        ({"guided_choice": ["a", ""]}, "non-empty strings"),
        ({"guided_choice": ["a"] * 2000}, "at most 1024"),
        ({"structured_outputs": {"bogus": 1}}, "structured_outputs.bogus"),
        ({"guided_regex": "a" * 70000}, "at most"),
    ],
)
def test_bad_shapes_are_400s_naming_the_field(body, fragment):
    with pytest.raises(ApiError) as e:
        parse_structured(body)
    assert e.value.status == 400 and fragment in e.value.message


needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="xgrammar is not installed")


@needs_xgrammar
@pytest.mark.parametrize(
    "spec,fragment",
    [
        (GrammarSpec("json_schema", json.dumps({"type": "object", "if": {}})), "'if'"),
        (GrammarSpec("json_schema", json.dumps({"type": "string", "format": "color"})), "format 'color'"),
        (GrammarSpec("json_schema", json.dumps({"type": "array", "maxItems": 10**6})), "maxItems"),
        (GrammarSpec("json_schema", json.dumps({"$ref": "http://example.com/s"})), "refer within"),
        (GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "a{1000}"})), "repetition"),
        (GrammarSpec("regex", "x{5,100000}"), "repetition"),
        (GrammarSpec("regex", "(ab"), "regex is not valid"),
        (GrammarSpec("ebnf", "root ::= "), "not valid"),
    ],
)
def test_the_front_end_refuses_what_it_cannot_bound_and_says_what(spec, fragment):
    with pytest.raises(GrammarError) as e:
        grammar.check(spec)
    assert fragment in str(e.value)


@needs_xgrammar
def test_a_deep_schema_is_refused_before_conversion():
    schema: dict = {"type": "integer"}
    for _ in range(grammar.MAX_SCHEMA_DEPTH + 2):
        schema = {"type": "array", "items": schema}
    with pytest.raises(GrammarError, match="nests deeper"):
        grammar.check(GrammarSpec("json_schema", json.dumps(schema)))


@needs_xgrammar
def test_bounded_strings_exclude_raw_control_characters():
    """xgrammar writes minLength / maxLength strings with a class that lets control characters
    through (invalid JSON); moeserve's grammar keeps them out."""
    import xgrammar as xgr

    spec = GrammarSpec("json_schema", json.dumps({"type": "string", "maxLength": 4}))
    g = xgr.GrammarMatcher(
        xgr.GrammarCompiler(_byte_info(), cache_enabled=False).compile_grammar(grammar.json_grammar(spec))
    )
    assert g.accept_string('"')
    assert not g.accept_string("\x0c")
    assert g.accept_string('ab"')


def _byte_info():
    import xgrammar as xgr

    return xgr.TokenizerInfo([chr(i) for i in range(128)], xgr.VocabType.RAW, vocab_size=128)


def test_the_mask_sets_minus_inf_outside_each_rows_bitmask_and_leaves_other_rows():
    logits = torch.randn(3, 40)
    before = logits.clone()
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = (1 << 3) | (1 << 7)
    mask[0, 1] = 1 << (33 - 32)
    apply_token_bitmask(logits, torch.tensor([1]), mask)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    kept = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert kept == [3, 7, 33]
    assert torch.equal(logits[1, kept], before[1, kept])


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    from moeserve.router.grammars import GrammarBook

    path = init_model(tmp_path_factory.mktemp("tok"), family="llama4", seed=11)
    compiler = grammar.Compiler(path / "tokenizer.json", 512, [2])
    b = GrammarBook(compiler, 512, torch.device("cpu"), threads=1)
    b.update(((0, GrammarSpec("ebnf", grammar.choice_grammar(["red", "green"]))),), ())
    for _ in range(400):
        if b.reports() == {0: ""}:
            break
        time.sleep(0.05)
    yield b, path
    b.close()


def _allowed(mask_row) -> list[int]:
    return [i for i in range(512) if (int(mask_row[i // 32]) >> (i % 32)) & 1]


class _Sampled:
    """As the runner's _Outputs: row j's token."""

    def __init__(self, tokens):
        self.tokens = tokens

    def token(self, j):
        return self.tokens[j]


@needs_xgrammar
def test_a_matcher_takes_the_token_sampled_in_the_step_before_and_a_restart_from_the_header(book):
    from tokenizers import Tokenizer

    b, path = book
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    red = tok.encode("red", add_special_tokens=False).ids
    g = b.start(0)
    g.known.extend([1, 5, 6])  # the prompt, from the header
    first = _allowed(b.fill([(g, 0)])[0])
    assert red[0] in first
    outputs = []
    for pos, t in enumerate(red):  # each step's token reaches the matcher in the next step
        g.last = (_Sampled({0: t}), 0)
        outputs.append(t)
        mask = b.fill([(g, pos + 1)])[0]
    assert _allowed(mask) == [2]  # the grammar is complete: only EOS
    again = b.start(0)  # preempted and recomputed: the header carries prompt + outputs
    again.known.extend([1, 5, 6] + outputs)
    assert _allowed(b.fill([(again, len(outputs))])[0]) == [2]


def test_without_xgrammar_constrained_requests_are_refused_by_the_package_name(monkeypatch):
    from moeserve.router.engine.api import InvalidRequest
    from moeserve.services.admission import Admission

    monkeypatch.setattr(grammar, "_xgr", None)
    monkeypatch.setattr(grammar, "_missing", "structured output needs the xgrammar package (not installed)")
    with pytest.raises(InvalidRequest, match="xgrammar"):
        asyncio.run(Admission(None).check_grammar(GrammarSpec("regex", "a")))


class _Result:
    def __init__(self, rank, grammars):
        self.rank, self.grammars = rank, grammars


class _Seq:
    finished = None


def test_the_leader_announces_a_grammar_once_and_it_is_ready_when_every_router_compiled_it():
    from moeserve.router.engine.grammars import GrammarTable

    t = GrammarTable(num_routers=2)
    spec = GrammarSpec("regex", "[ab]+")
    gid, why = t.acquire(spec)
    assert why is None and t.attach(gid, _Seq()) is None
    again, _ = t.acquire(spec)  # the same grammar: the same id, announced once
    t.attach(again, _Seq())
    assert again == gid
    assert t.header() == (((gid, spec),), ())
    assert t.header() == ((), ())
    assert t.on_results([_Result(1, {gid: ""})]) == [] and not t.ready(gid)
    assert t.on_results([_Result(2, {gid: ""})]) == [] and t.ready(gid)


def test_a_replacement_router_compiles_every_known_grammar_before_a_sequence_of_it_is_admitted():
    """A lost router's replacement holds no grammar: the leader announces every grammar it knows
    (in use and idle) again, the others skip it, and each is ready again only when the new
    router reports it; a failed or dropped one is not announced."""
    from moeserve.router.engine.grammars import GrammarTable

    t = GrammarTable(num_routers=2, keep_idle=4)
    used, idle, bad = GrammarSpec("regex", "[ab]+"), GrammarSpec("regex", "c+"), GrammarSpec("regex", "d+")
    ids = {}
    for name, spec in (("used", used), ("idle", idle), ("bad", bad)):
        ids[name], _ = t.acquire(spec)
        t.attach(ids[name], _Seq())
    t.header()
    t.on_results([_Result(1, {ids["used"]: "", ids["idle"]: "", ids["bad"]: "no"}), _Result(2, {ids["used"]: ""})])
    t.on_results([_Result(2, {ids["idle"]: ""})])
    t._users[ids["idle"]][0].finished = "stop"  # its request is done: idle, kept compiled
    t.header()
    assert t.ready(ids["used"]) and t.ready(ids["idle"]) and t.counts()["grammars_idle"] == 1

    t.router_joined(2)  # rank 2 lost and replaced
    assert not t.ready(ids["used"]) and not t.ready(ids["idle"]) and t.compiling
    announced, dropped = t.header()
    assert sorted(g for g, _ in announced) == sorted([ids["used"], ids["idle"]]) and dropped == ()
    assert dict(announced)[ids["used"]] == used
    t.on_results([_Result(1, {}), _Result(2, {ids["used"]: ""})])  # rank 1 has them: it reports nothing
    assert t.ready(ids["used"]) and not t.ready(ids["idle"])
    t.on_results([_Result(2, {ids["idle"]: ""})])
    assert t.ready(ids["idle"]) and not t.compiling
    assert t.header() == ((), ())


def test_a_grammar_a_router_cannot_compile_fails_its_requests_and_is_refused_next_time():
    from moeserve.router.engine.grammars import GrammarTable

    t = GrammarTable(num_routers=1)
    spec = GrammarSpec("regex", "x+")
    gid, _ = t.acquire(spec)
    t.attach(gid, _Seq())
    t.header()
    failed = t.on_results([_Result(1, {gid: "compiling it took longer than 30 s"})])
    assert failed == [(gid, "the grammar could not be compiled on router rank 1: compiling it took longer than 30 s")]
    assert t.header() == ((), (gid,))  # the routers forget it
    assert t.acquire(spec) == (-1, failed[0][1])


def test_a_server_without_xgrammar_refuses_constrained_requests_by_name_and_serves_the_rest(monkeypatch):
    from test_http_api import Front, StandIn, post

    monkeypatch.setattr(grammar, "_xgr", None)
    monkeypatch.setattr(grammar, "_missing", "structured output needs the xgrammar package (pip install xgrammar)")
    front = Front(StandIn(), None)
    try:
        st, out, _ = post(front.port, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "guided_choice": ["a"]})
        assert st == 400 and "xgrammar" in out["error"]["message"]
        st, out, _ = post(front.port, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert st == 200, out
    finally:
        front.stop()
