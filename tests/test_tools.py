"""Tool calls without a cluster: each ``--tool-call-parser`` format read from golden texts (and a
text that is no call left as content), a streamed answer held back only while it may be a call,
``tools`` / ``tool_choice`` checked with errors that name the field, the grammar that
``required`` and a named function constrain the output to, the history's arguments as objects
for the template, ``tools`` reaching the chat template, and the serve flags."""

import json

import pytest

from moeserve.services.http.encode import ApiError
from moeserve.services.http.tools import ToolCall, ToolStream, parse_calls, parse_tools, template_messages

pytestmark = pytest.mark.timeout(60)

F = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
G = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    "parser,text,content,calls",
    [
        (
            "hermes",
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            "Let me look.",
            [("get_weather", {"city": "Paris"}), ("get_time", {})],
        ),
        ("hermes", "No tools needed.", "No tools needed.", []),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            None,
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            "llama4_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
            None,
            [("get_weather", {"city": "Oslo"}), ("get_time", {})],
        ),
        ("llama3_json", "{not json", "{not json", []),
        (
            "pythonic",
            '[get_weather(city="Paris", days=3), get_time()]',
            None,
            [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})],
        ),
        (
            "llama4_pythonic",
            "<|python_start|>[get_weather(city='Oslo', flags=[1, 2], on=True)]<|python_end|>",
            None,
            [("get_weather", {"city": "Oslo", "flags": [1, 2], "on": True})],
        ),
        ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
        ("pythonic", "[f(__import__('os'))]", "[f(__import__('os'))]", []),
    ],
)
def test_each_parser_reads_its_format_and_leaves_other_text_as_content(parser, text, content, calls):
    got_content, got = parse_calls(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def _stream(tools, pieces):
    st = ToolStream(tools)
    sent = "".join(st.feed(p) for p in pieces)
    rest, calls = st.finish()
    return sent + rest, calls


def test_a_stream_holds_back_only_what_may_be_a_call():
    hermes = parse_tools({"tools": [F]}, "hermes")
    sent, calls = _stream(
        hermes, ["Let me ", "look. <tool", '_call>{"name": "get_weather", ', '"arguments": {}}</tool_call>']
    )
    assert sent == "Let me look. " and [c.name for c in calls] == ["get_weather"]
    sent, calls = _stream(hermes, ["a <to", "day is fine"])
    assert sent == "a <today is fine" and calls == []
    pythonic = parse_tools({"tools": [F]}, "pythonic")
    st = ToolStream(pythonic)
    assert st.feed("Sure") == "Sure" and st.feed(", [x]") == ", [x]"  # not a call: streamed as it comes
    sent, calls = _stream(pythonic, ["[get_wea", "ther(city='x')]"])
    assert sent == "" and calls == [ToolCall("get_weather", '{"city": "x"}')]


@pytest.mark.parametrize(
    "body,parser,fragment,param",
    [
        ({"tools": [F]}, None, "--enable-auto-tool-choice", "tool_choice"),
        (
            {"tools": [F], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "hermes",
            "get_weather",
            "tool_choice",
        ),
        ({"tools": [F], "tool_choice": "sometimes"}, "hermes", "none, auto, required", "tool_choice"),
        ({"tool_choice": "required"}, "hermes", "needs tools", "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "hermes", "tools[0]", "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "hermes", "letters", "tools"),
        ({"tools": [F, F]}, "hermes", "twice", "tools"),
        ({"tools": [F], "parallel_tool_calls": "yes"}, "hermes", "true or false", "parallel_tool_calls"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(body, parser, fragment, param):
    with pytest.raises(ApiError) as e:
        parse_tools(body, parser)
    assert e.value.status == 400 and fragment in e.value.message and e.value.param == param


def test_required_and_named_constrain_the_output_and_read_it_as_calls():
    req = parse_tools({"tools": [F, G], "tool_choice": "required", "parallel_tool_calls": False}, None)
    schema = json.loads(req.grammar().text)
    assert schema["maxItems"] == 1 and [a["properties"]["name"]["const"] for a in schema["items"]["anyOf"]] == [
        "get_weather",
        "get_time",
    ]
    assert req.read('[{"name": "get_time", "parameters": {}}]') == (None, [ToolCall("get_time", "{}")])
    named = parse_tools({"tools": [F, G], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, None)
    assert json.loads(named.grammar().text) == {"type": "object"}
    assert named.read('{"zone": "UTC"}') == (None, [ToolCall("get_time", '{"zone": "UTC"}')])
    none = parse_tools({"tools": [F], "tool_choice": "none"}, None)
    assert none.grammar() is None and not none.parses


def test_history_arguments_become_objects_for_the_template_and_tools_reach_it(tmp_path):
    from moeserve.models import init_model
    from moeserve.services.tokenizer import ModelTokenizer

    msgs = template_messages(
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            }
        ]
    )
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    tok = ModelTokenizer.load(init_model(tmp_path / "m", family="llama4", seed=1))
    tok.chat_template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}{% endfor %}"
    )
    assert tok.render_chat(msgs, tools=[F]) == '[get_weather]f({"a": 1})'


def test_the_serve_flags_take_the_parser_and_refuse_a_plugin():
    from moeserve.cli.vllm_flags import VLLM_NOOP_FLAGS

    refused = {n for names, _, _, what in VLLM_NOOP_FLAGS if what is None for n in names}
    assert "--tool-parser-plugin" in refused
    assert "--enable-auto-tool-choice" not in refused and "--tool-call-parser" not in refused
