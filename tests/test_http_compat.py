"""What vLLM's users send, through the official ``openai`` client, against a real cluster of the
tiny Llama 4 checkpoint (its tokenizer, an in-process front end: test_http_api.Front): every
sampling parameter vLLM serves (penalties, logit_bias, min_p, min_tokens, max_completion_tokens
on both endpoints) gives the tokens of a per-token reference loop; echo's logprobs equal
transformers' prompt log-probabilities and prompt_logprobs name each token's rank;
stream_options.continuous_usage_stats puts the usage in every chunk; unknown fields are
ignored; a chat history with tool calls renders; /tokenize, /detokenize, /ping and
/v1/models/{id} answer as vLLM's do; /metrics carries vLLM's names."""

import hf_oracle as hf
import numpy as np
import pytest
import torch
from cluster_util import reference_model, tiny_checkpoint
from test_http_api import MODEL, Front, openai_client, post, request
from test_sampling_adjust import reference_tokens

from moeserve.ops.metrics import TTFT_PARTS
from moeserve.sampling import SamplingParams

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PROMPT = "Hello experts, how are you?"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    from moeserve.cluster.launcher import LocalCluster
    from moeserve.router.engine.channel import AsyncEngineClient
    from moeserve.services.tokenizer import ModelTokenizer

    path = tiny_checkpoint(tmp_path_factory.mktemp("compat") / "llama4", "llama4")
    cluster = LocalCluster(path, routers=1, workers=1, max_model_len=256, max_num_seqs=16, startup_timeout_s=240)
    cluster.start()
    try:
        front = Front(AsyncEngineClient(cluster.control_address, cluster.authkey), ModelTokenizer.load(path))
    except BaseException:
        cluster.stop()
        raise
    ns = type("Served", (), {})()
    ns.path, ns.cluster, ns.front = path, cluster, front
    ns.hf_tok = AutoTokenizer.from_pretrained(path)
    ns.model = reference_model(path)
    yield ns
    try:
        front.stop()
    finally:
        cluster.stop()


def test_every_sampling_parameter_gives_the_reference_tokens(served):
    c = openai_client(served.front)
    ids = served.hf_tok(PROMPT).input_ids
    eos = served.model.config.eos_token_ids
    plain = reference_tokens(served.model, ids, SamplingParams(), 8)
    cases = [
        (
            dict(presence_penalty=1.5, frequency_penalty=0.7),
            SamplingParams(presence_penalty=1.5, frequency_penalty=0.7),
        ),
        (dict(extra_body={"repetition_penalty": 1.8}), SamplingParams(repetition_penalty=1.8)),
        (
            dict(logit_bias={str(plain[1]): -100, "17": 5}),
            SamplingParams(logit_bias=tuple(sorted(((plain[1], -100.0), (17, 5.0))))),
        ),
        (
            dict(extra_body={"min_tokens": 6, "stop_token_ids": [plain[0]], "ignore_eos": False}),
            SamplingParams(min_tokens=6, stop_ids=tuple(sorted({plain[0], *eos}))),
        ),
        (dict(extra_body={"min_p": 0.2}), SamplingParams()),  # greedy rows: min_p changes nothing
    ]
    for kw, sp in cases:
        body = {"ignore_eos": True, **kw.pop("extra_body", {})}
        out = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body=body, **kw)
        got = out.choices[0]
        want = reference_tokens(served.model, ids, sp, 8)
        text = served.hf_tok.decode(want, skip_special_tokens=True)
        assert got.text == text, (kw, body)
    # max_completion_tokens on /v1/completions, as on chat
    out = c.completions.create(model=MODEL, prompt=ids, temperature=0, extra_body={"max_completion_tokens": 3})
    assert out.usage.completion_tokens <= 3 and out.choices[0].finish_reason in ("length", "stop")


def test_echo_logprobs_equal_transformers_prompt_log_probabilities(served):
    c = openai_client(served.front)
    ids = served.hf_tok(PROMPT).input_ids
    oracle = hf.load_oracle(served.path)
    with torch.no_grad():
        lp = torch.log_softmax(oracle(torch.tensor([ids])).logits[0].float(), -1)
    want = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    # lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1
    out = c.completions.create(model=MODEL, prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True)
    got = out.choices[0].logprobs
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    np.testing.assert_allclose(got.token_logprobs[1 : len(ids)], want, atol=1e-4, rtol=0)
    greedy = [max(t.values()) for t in got.top_logprobs[1 : len(ids)]]
    is_greedy = lp[torch.arange(len(ids) - 1)].argmax(-1).numpy() == np.array(ids[1:])
    assert [abs(g - w) < 1e-4 for g, w in zip(greedy, want)] == is_greedy.tolist()
    assert out.choices[0].text.startswith(served.hf_tok.decode(ids, skip_special_tokens=True))
    assert len(got.tokens) == len(ids) + 1 and got.text_offset == sorted(got.text_offset)
    # a text prompt echoes as given; vLLM's prompt_logprobs name rank and the top tokens
    st, body, _ = post(
        served.front.port,
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": True, "prompt_logprobs": 2},
    )
    ch = body["choices"][0]
    assert st == 200 and ch["text"].startswith(PROMPT)
    plp = ch["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i, entry in enumerate(plp[1:]):
        mine = entry[str(ids[i + 1])]
        assert abs(mine["logprob"] - want[i]) < 1e-4
        assert mine["rank"] == 1 + int((lp[i] > lp[i, ids[i + 1]]).sum())
        top = torch.topk(lp[i], 2).indices.tolist()
        assert all(str(t) in entry for t in top)


def test_streams_carry_usage_in_every_chunk_with_continuous_usage_stats(served):
    c = openai_client(served.front)
    for kind in ("completions", "chat"):
        common = dict(
            model=MODEL,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
        if kind == "chat":
            chunks = list(c.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **common))
        else:
            chunks = list(c.completions.create(prompt=PROMPT, **common))
        assert all(ch.usage is not None for ch in chunks), kind
        done = [ch.usage.completion_tokens for ch in chunks]
        assert done == sorted(done) and done[-1] == 5 and chunks[-1].choices == []


def test_unknown_fields_are_ignored_and_a_tool_call_history_renders(served):
    c = openai_client(served.front)
    out = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"not_a_field": {"x": 1}})
    assert out.usage.completion_tokens >= 1
    messages = [
        {"role": "user", "content": "What is the weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens > 10


def test_tokenize_detokenize_ping_and_one_model(served):
    port = served.front.port
    st, body, _ = post(port, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert st == 200 and body["tokens"] == served.hf_tok(PROMPT).input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256
    st, chat, _ = post(port, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    text = served.hf_tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert st == 200 and chat["tokens"] == served.hf_tok(text, add_special_tokens=False).input_ids
    st, body, _ = post(port, "/detokenize", {"tokens": body["tokens"]})
    assert st == 200 and body["prompt"] == served.hf_tok.decode(served.hf_tok(PROMPT).input_ids)
    assert request(port, "GET", "/ping", key=None)[0] == 200
    assert request(port, "POST", "/ping", key=None)[0] == 200
    st, card, _ = request(port, "GET", f"/v1/models/{MODEL}")
    assert st == 200 and card["id"] == MODEL and card["object"] == "model"
    st, err, _ = request(port, "GET", "/v1/models/gpt-4")
    assert st == 404 and err["error"]["code"] == "model_not_found"
    st, err, _ = post(port, "/detokenize", {"tokens": [10**9]})
    assert st == 400 and "tokens must be ids" in err["error"]["message"]


def test_metrics_carry_vllms_names_with_model_name(served):
    from prometheus_client.parser import text_string_to_metric_families

    c = openai_client(served.front)
    c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    st, text, _ = request(served.front.port, "GET", "/metrics", key=None)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert name in fams, name
        assert all(s.labels.get("model_name") == MODEL for s in fams[name].samples), name
    gen = [s.value for s in fams["vllm:generation_tokens"].samples if s.name.endswith("_total")]
    assert gen and gen[0] >= 4

    def hist(name, suffix):
        return sum(s.value for s in fams[name].samples if s.name == name + suffix)

    # the leader's queue and prefill times lie inside the front end's TTFT of the same requests
    n = hist("vllm:time_to_first_token_seconds", "_count")
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds"):
        assert hist(name, "_count") == n, name
    for name in ("vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"):
        assert hist(name, "_count") >= 1, name
    queue, prefill = hist("vllm:request_queue_time_seconds", "_sum"), hist("vllm:request_prefill_time_seconds", "_sum")
    assert prefill > 0 and queue >= 0
    assert queue + prefill <= hist("vllm:time_to_first_token_seconds", "_sum")
    # moeserve's TTFT split at every hop between front end and leader: one of each part per
    # request with a first token, none negative, adding up to the TTFT
    part = "moeserve_time_to_first_token_part_seconds"
    by = {
        (smp.labels["part"], smp.name[len(part) :]): smp.value
        for smp in fams[part].samples
        if smp.name in (part + "_sum", part + "_count")
    }
    n = hist("moeserve_time_to_first_token_seconds", "_count")
    ttft = hist("moeserve_time_to_first_token_seconds", "_sum")
    assert n >= 1 and all(by[(p, "_count")] == n for p in TTFT_PARTS)
    assert all(by[(p, "_sum")] >= 0 for p in TTFT_PARTS) and by[("prefill", "_sum")] > 0
    assert sum(by[(p, "_sum")] for p in TTFT_PARTS) == pytest.approx(ttft, abs=1e-3 * n)
    assert by[("queue", "_sum")] == pytest.approx(hist("moeserve_request_queue_time_seconds", "_sum"))
    assert hist("vllm:request_inference_time_seconds", "_sum") >= prefill
