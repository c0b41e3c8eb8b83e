"""Structured output through the HTTP API, on a real cluster of the tiny Llama 4 checkpoint with
its byte-level BPE tokenizer (written by ``init_model``: nothing downloads): every answer of a
set of JSON schemas (nested objects, arrays, enums, bounded numbers, required fields) parses
and validates, sampled and greedy, many at once beside unconstrained requests; guided choice
and regex; bad schemas, unsupported keywords, too-large grammars are 400s naming the problem
while the server keeps serving the others unchanged; tool calls with tool_choice required and
a named function through the ``openai`` client, streamed and not, and a history with tool calls
and results."""

import json
import re
import threading
import types

import pytest
from test_http_api import KEY, Served, _baseline, _idle, is_openai_error, post, sse

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

C, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "Answer in JSON:"

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                    "name": {"type": "string", "maxLength": 8},
                    "role": {"enum": ["admin", "user", "guest"]},
                },
                "required": ["id", "name", "role"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    "enums_and_consts": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "kind": {"const": "point"},
            "size": {"type": "string", "enum": ["s", "m", "l"]},
        },
        "required": ["colour", "kind", "size"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": 10, "maximum": 20},
            "y": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3},
        },
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
                    "required": ["a", "b"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            }
        },
        "required": ["points"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    served = Served("llama4", tmp_path_factory.mktemp("structured"))
    yield served
    served.stop()


def _json_schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _ask(s, body, path=C):
    st, out, _ = post(s.front.port, path, body)
    assert st == 200, out
    return out


def test_every_answer_of_every_schema_parses_and_validates_sampled_and_greedy_and_concurrently(s):
    """Each schema, 4 sampled seeds and greedy, through response_format and structured_outputs,
    all at once beside unconstrained requests."""
    answers: list = []
    plain: list = []
    errors: list = []

    def one(name, schema, seed):
        body = {"prompt": PROMPT, "max_tokens": 240, "temperature": 0.0 if seed is None else 1.0}
        if seed is None or seed % 2:  # vLLM's form, no whitespace between tokens (a random model loves it)
            body["structured_outputs"] = {"json": schema, "disable_any_whitespace": True}
        else:
            body["response_format"] = _json_schema_format(schema)
        if seed is not None:
            body["seed"] = seed
        try:
            out = _ask(s, body)
            answers.append((name, out["choices"][0]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def unconstrained(i):
        try:
            out = _ask(s, {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "seed": i, "temperature": 1.0})
            plain.append(out["choices"][0])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [
        threading.Thread(target=one, args=(n, sc, seed)) for n, sc in SCHEMAS.items() for seed in (None, 1, 2, 3, 4)
    ]
    threads += [threading.Thread(target=unconstrained, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(answers) == 5 * len(SCHEMAS)
    for name, choice in answers:
        assert choice["finish_reason"] == "stop", (name, choice)
        value = json.loads(choice["text"])
        jsonschema.validate(value, SCHEMAS[name])
    assert len(plain) == 4 and all(c["finish_reason"] == "length" for c in plain)


def test_structured_outputs_and_guided_names_choice_and_regex(s):
    for body in (
        {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
        {"guided_choice": ["yes", "no", "maybe"]},
    ):
        for seed in range(3):
            out = _ask(s, {"prompt": PROMPT, "max_tokens": 20, "temperature": 1.0, "seed": seed, **body})
            assert out["choices"][0]["text"] in ("yes", "no", "maybe"), out
    for body in ({"structured_outputs": {"regex": r"[a-c]{2}-\d{3}"}}, {"guided_regex": r"[a-c]{2}-\d{3}"}):
        for seed in range(3):
            out = _ask(s, {"prompt": PROMPT, "max_tokens": 20, "temperature": 1.0, "seed": seed, **body})
            assert re.fullmatch(r"[a-c]{2}-\d{3}", out["choices"][0]["text"]), out
    schema = SCHEMAS["bounded_numbers"]
    for body in (
        {"structured_outputs": {"json": schema}},
        {"guided_json": json.dumps(schema)},
        {"structured_outputs": {"grammar": 'root ::= "{\\"x\\": 1" [0-9] ", \\"y\\": 1}"'}},
    ):
        out = _ask(s, {"prompt": PROMPT, "max_tokens": 60, "temperature": 1.0, "seed": 5, **body})
        jsonschema.validate(json.loads(out["choices"][0]["text"]), schema)


def test_json_object_in_chat_and_streamed(s):
    body = {
        "messages": [{"role": "user", "content": "Give me an object."}],
        "max_tokens": 120,
        "response_format": {"type": "json_object"},
        "temperature": 0.0,
    }
    out = _ask(s, body, CHAT)
    choice = out["choices"][0]
    assert isinstance(json.loads(choice["message"]["content"]), dict), choice
    events = sse(s.front.port, CHAT, {**body, "stream": True})
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert text == choice["message"]["content"]


BAD = [
    ("unsupported keyword", {"response_format": _json_schema_format({"type": "object", "if": {}})}, "'if'"),
    ("bad type", {"response_format": _json_schema_format({"type": "objekt"})}, "json_schema.type"),
    ("schema not JSON", {"guided_json": "{not json"}, "not valid JSON"),
    ("huge repetition", {"guided_regex": "a{100000}"}, "repetition"),
    ("bad regex", {"guided_regex": "(ab"}, "regex is not valid"),
    ("bad grammar", {"guided_grammar": "root ::= "}, "not valid"),
    ("too large", {"guided_regex": "a" * 70000}, "at most"),
    ("two constraints", {"guided_regex": "a", "guided_choice": ["a"]}, "give one"),
    ("empty choice", {"guided_choice": []}, "non-empty list"),
    ("bad response_format", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("structural tag", {"structured_outputs": {"structural_tag": "{}"}}, "structural_tag"),
    ("min_tokens", {"guided_choice": ["a"], "min_tokens": 3}, "min_tokens"),
]


def test_bad_grammars_are_400s_naming_the_problem_and_change_nothing(s):
    before = _baseline(s)
    for name, extra, fragment in BAD:
        st, out, _ = post(s.front.port, C, {"prompt": PROMPT, "max_tokens": 8, **extra})
        assert st == 400, (name, st, out)
        assert is_openai_error(out), (name, out)
        assert fragment in out["error"]["message"], (name, out)
        assert _idle(s.cluster), name
    assert _baseline(s) == before


def test_the_key_is_still_checked(s):
    st, _, _ = post(s.front.port, C, {"prompt": PROMPT, "guided_choice": ["a"]}, key=KEY + "x")
    assert st == 401


# -- tool calls through the official client ---------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(s):
    import openai

    return openai.OpenAI(base_url=f"{s.front.base}/v1", api_key=KEY, max_retries=0, timeout=120)


def _check_call(call):
    assert call.type == "function" and call.id
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_tool_calls_round_trip_through_the_openai_client(s, choice, stream):
    pytest.importorskip("openai")
    client = _client(s)
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(
        model="tiny",
        messages=TOOL_MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_tokens=120,
        temperature=1.0,
        seed=3,
    )
    if not stream:
        out = client.chat.completions.create(**kw)
        msg = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls", out
        calls = msg.tool_calls
    else:
        deltas = {}
        finish = None
        for chunk in client.chat.completions.create(**kw, stream=True):
            if not chunk.choices:
                continue
            ch = chunk.choices[0]
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                entry = deltas.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls"
        calls = [
            types.SimpleNamespace(
                id=e["id"], type="function", function=types.SimpleNamespace(name=e["name"], arguments=e["arguments"])
            )
            for _, e in sorted(deltas.items())
        ]
    assert calls
    if choice == "named":
        assert [c.function.name for c in calls] == ["get_weather"]
    for c in calls:
        _check_call(c)
    client.close()


def test_a_history_with_tool_calls_and_results_renders_and_auto_needs_the_parser_flag(s):
    client = _client(s)
    history = TOOL_MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    import openai

    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=4)
    s.front.api.tool_parser = "hermes"  # as --enable-auto-tool-choice --tool-call-parser hermes
    try:
        out = client.chat.completions.create(
            model="tiny", messages=history, tools=[WEATHER], max_tokens=8, temperature=0.0
        )
        assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")
        out = client.chat.completions.create(
            model="tiny", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8
        )
        assert out.choices[0].message.tool_calls in (None, [])
    finally:
        s.front.api.tool_parser = None
    client.close()


def test_constrained_sequences_preempted_recomputed_and_migrated_under_still_follow_their_schemas(tmp_path):
    """A cluster with too few KV blocks for its requests, migrating to a random placement while
    they run: constrained sequences are preempted and recomputed (their matchers restarted from
    the header, past a prefix-cache hit of their prompt), experts move under them, and every
    answer still validates."""
    from cluster_util import moe_info, random_placement, tiny_checkpoint
    from test_http_api import Front

    from moeserve.cluster.launcher import LocalCluster
    from moeserve.router.engine.channel import AsyncEngineClient
    from moeserve.services.tokenizer import ModelTokenizer

    path = tiny_checkpoint(tmp_path / "m", "llama4")
    cluster = LocalCluster(
        path,
        routers=1,
        workers=2,
        num_redundant_experts=2,
        max_model_len=128,
        block_size=4,
        num_gpu_blocks_override=40,
        startup_timeout_s=240,
    ).start()
    info = moe_info(path)
    try:
        front = Front(
            AsyncEngineClient(cluster.control_address, cluster.authkey), ModelTokenizer.load(path), max_model_len=128
        )
        answers, errors = [], []

        def one(name, seed):
            body = {
                "prompt": PROMPT,
                "max_tokens": 100,
                "temperature": 1.0,
                "seed": seed,
                "structured_outputs": {"json": SCHEMAS[name], "disable_any_whitespace": True},
            }
            try:
                st, out, _ = post(front.port, C, body)
                assert st == 200, out
                answers.append((name, out["choices"][0]))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [
            threading.Thread(target=one, args=(n, seed)) for n in ("nested", "array_of_objects") for seed in range(4)
        ]
        for t in threads:
            t.start()
        target = random_placement(info.num_moe_layers, info.num_logical_experts, info.num_logical_experts + 2, seed=4)
        mid = cluster.apply_placement(target, wait=False)
        for t in threads:
            t.join(300)
        cluster.wait_migration(mid, 120)
        front.stop()
        assert not errors, errors
        assert cluster.status().preemptions > 0
        for name, choice in answers:
            assert choice["finish_reason"] == "stop", (name, choice)
            jsonschema.validate(json.loads(choice["text"]), SCHEMAS[name])
    finally:
        cluster.stop()


def test_a_replacement_router_compiles_the_grammars_in_use_before_it_starts_their_sequences(tmp_path):
    """A router lost and replaced: its replacement holds no grammar. The leader announces the
    grammars it knows again and admits their sequences only once the new router compiled them,
    so the same schema, asked again on both routers, still validates."""
    import os
    import signal
    import time

    from cluster_util import tiny_checkpoint
    from test_http_api import Front

    from moeserve.cluster.launcher import LocalCluster
    from moeserve.router.engine.channel import AsyncEngineClient
    from moeserve.services.tokenizer import ModelTokenizer

    path = tiny_checkpoint(tmp_path / "m", "llama4")
    cluster = LocalCluster(path, routers=2, workers=1, max_model_len=128, startup_timeout_s=240).start()
    front = Front(
        AsyncEngineClient(cluster.control_address, cluster.authkey), ModelTokenizer.load(path), max_model_len=128
    )

    def ask(seeds):  # at once, so that both routers take some
        out: list = []

        def one(seed):
            body = {
                "prompt": f"{PROMPT} {seed}",
                "max_tokens": 100,
                "temperature": 1.0,
                "seed": seed,
                "structured_outputs": {"json": SCHEMAS["nested"], "disable_any_whitespace": True},
            }
            out.append(post(front.port, C, body))

        threads = [threading.Thread(target=one, args=(seed,)) for seed in seeds]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(out) == len(threads) and all(st == 200 for st, _, _ in out), out
        return [res["choices"][0] for _, res, _ in out]

    try:
        ask(range(2))  # compiled on both routers, then idle on them
        os.kill(cluster.procs[1].pid, signal.SIGKILL)  # router rank 1
        deadline = time.monotonic() + 180
        while True:
            st = cluster.status()
            if st.ranks_replaced["router"] == 1 and 1 in st.members:
                break
            assert time.monotonic() < deadline, f"rank 1 did not rejoin: {st}"
            time.sleep(0.2)
        answers = ask(range(2, 10))  # spread over both routers, the replacement among them
        for choice in answers:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["text"]), SCHEMAS["nested"])
        st = cluster.status()
        assert st.ranks_replaced["router"] == 1 and st.members == (0, 1, 2)
    finally:
        front.stop()
        cluster.stop()


AUTO_FORMATS = {  # a parser and a regex that makes the random model write one call in its format
    "hermes": r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "days": [1-7]\}\}</tool_call>',
    "llama4_json": r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Oslo)", "days": [1-7]\}\}',
    "pythonic": r'\[get_weather\(city="(Paris|Oslo)", days=[1-7]\)\]',
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser", sorted(AUTO_FORMATS))
def test_auto_tool_calls_are_parsed_in_each_format_through_the_openai_client(s, parser, stream):
    """tool_choice auto with the server's parser; the model is steered into writing a call by a
    regex, so the parser has one to find."""
    client = _client(s)
    s.front.api.tool_parser = parser
    try:
        kw = dict(
            model="tiny",
            messages=TOOL_MESSAGES,
            tools=[WEATHER, TIME],
            max_tokens=80,
            temperature=1.0,
            seed=2,
            extra_body={"structured_outputs": {"regex": AUTO_FORMATS[parser]}},
        )
        if not stream:
            out = client.chat.completions.create(**kw)
            assert out.choices[0].finish_reason == "tool_calls", out
            assert not out.choices[0].message.content
            calls = out.choices[0].message.tool_calls
        else:
            deltas, content, finish = {}, "", None
            for chunk in client.chat.completions.create(**kw, stream=True):
                if not chunk.choices:
                    continue
                ch = chunk.choices[0]
                finish = ch.finish_reason or finish
                content += ch.delta.content or ""
                for d in ch.delta.tool_calls or []:
                    deltas[d.index] = d
            assert finish == "tool_calls" and content == ""
            calls = [deltas[i] for i in sorted(deltas)]
        assert [c.function.name for c in calls] == ["get_weather"]
        for c in calls:
            _check_call(types.SimpleNamespace(id=c.id, type="function", function=c.function))
    finally:
        s.front.api.tool_parser = None
        client.close()
