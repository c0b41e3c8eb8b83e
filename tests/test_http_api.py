"""The OpenAI-compatible HTTP API (moeserve.services.http) in front of real clusters of the tiny
Llama 4 and ERNIE checkpoints (with their tokenizers), through the official ``openai`` client
(sync, async, streaming) and plain HTTP: greedy text equals transformers' generate decoded by
the same tokenizer, chat through the model's chat template, stop strings across token
boundaries, n > 1 with seeds, logprobs equal to the log-softmax of the model's logits; a table
of bad inputs each answered with its status and an OpenAI error body while the server keeps
serving and nothing else changes; a client that goes away cancels its request.

One cluster per family per module (started on first use), each with an in-process front end
(HTTP and gRPC on one event loop, the production classes) whose API key is KEY.
"""

import asyncio
import http.client
import json
import re
import socket
import threading
import time

import hf_oracle as hf
import numpy as np
import pytest
import torch
from cluster_util import reference_decode, reference_model, tiny_checkpoint

from moeserve.router.engine.api import Finished, FinishReason, FirstToken, QueueFull, Token
from moeserve.router.engine.channel import ClusterError

pytestmark = pytest.mark.timeout(300)

KEY = "sk-test-key"
MAX_MODEL_LEN = 256
MAX_BODY = 1 << 20
MODEL = "tiny"


class Front:
    """The front end's production parts (Admission, HttpApi + HttpServer, the gRPC servicer
    with the API key) on one uvloop event loop in a thread."""

    def __init__(
        self,
        engine,
        tokenizer,
        api_key=KEY,
        names=(MODEL,),
        max_model_len=MAX_MODEL_LEN,
        tls=(None, None),
        door=None,
        grace_s=5,
        **limits,
    ):
        import uvloop

        from moeserve.ops.metrics import FrontendMetrics, ProcessMetrics
        from moeserve.ops.vllm_metrics import VllmMetrics
        from moeserve.services.admission import Admission, AdmissionLimits
        from moeserve.services.frontend import make_server
        from moeserve.services.http import HttpApi, HttpServer
        from moeserve.services.http.door import DoorLimits
        from moeserve.services.server import ServerOptions

        self.pm = ProcessMetrics("frontend")
        vllm = VllmMetrics(self.pm.registry, names[0])
        self.admission = Admission(
            engine,
            tokenizer,
            FrontendMetrics(self.pm.registry, vllm),
            AdmissionLimits(max_model_len=max_model_len, **limits),
        )
        self.api = HttpApi(
            self.admission,
            list(names),
            "/models/tiny",
            api_key,
            self.pm.registry,
            max_body_bytes=MAX_BODY,
            vllm_metrics=vllm,
        )
        self.http = HttpServer(
            self.api,
            "127.0.0.1",
            0,
            grace_s=grace_s,
            ssl_certfile=tls[0],
            ssl_keyfile=tls[1],
            door=door or DoorLimits(),
        )
        self.grpc = make_server(None, None, ServerOptions(grace_s=1), admission=self.admission, api_key=api_key)
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self.run(self.http.start())
        self.grpc_port = self.run(self.grpc.start())
        self.base = f"{self.http.scheme}://127.0.0.1:{self.port}"

    def run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        async def both():
            await asyncio.gather(self.http.stop(), self.grpc.stop())

        try:
            self.run(both())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


class Served:
    """A family's checkpoint, cluster, front end and oracles."""

    def __init__(self, family, tmp):
        from transformers import AutoTokenizer

        from moeserve.cluster.launcher import LocalCluster
        from moeserve.router.engine.channel import AsyncEngineClient
        from moeserve.services.tokenizer import ModelTokenizer

        self.family = family
        self.path = tiny_checkpoint(tmp / family, family)
        self.cluster = LocalCluster(
            self.path, routers=1, workers=1, max_model_len=MAX_MODEL_LEN, max_num_seqs=16, startup_timeout_s=240
        ).start()
        try:
            self.tok = ModelTokenizer.load(self.path)
            self.front = Front(AsyncEngineClient(self.cluster.control_address, self.cluster.authkey), self.tok)
        except BaseException:
            self.cluster.stop()
            raise
        self.hf_tok = AutoTokenizer.from_pretrained(self.path)
        self._oracle = self._model = None

    @property
    def oracle(self):
        if self._oracle is None:
            self._oracle = hf.load_oracle(self.path)
        return self._oracle

    @property
    def model(self):
        if self._model is None:
            self._model = reference_model(self.path)
        return self._model

    def hf_text(self, ids, n) -> str:
        """transformers' greedy generate (EOS ignored) decoded by the same tokenizer."""
        out = hf.hf_greedy(self.oracle, torch.tensor([list(ids)]), n)
        return self.hf_tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)

    def stop(self):
        try:
            self.front.stop()
        finally:
            self.cluster.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    started = {}

    def get(family):
        if family not in started:
            started[family] = Served(family, tmp_path_factory.mktemp("http"))
        return started[family]

    yield get
    for s in started.values():
        s.stop()


FAMILIES = ["llama4", "ernie45"]


# -- plain HTTP -------------------------------------------------------------------------------


def request(port, method, path, body=None, headers=None, key=KEY, timeout=60):
    """(status, parsed JSON or text, headers). ``body``: bytes as they are, or an object as JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"content-type": "application/json"}
    if key is not None:
        h["authorization"] = f"Bearer {key}"
    h.update(headers or {})
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode(errors="replace")
    return r.status, parsed, dict(r.getheaders())


def post(port, path, body, **kw):
    return request(port, "POST", path, body, **kw)


def sse(port, path, body, key=KEY):
    """The data events of a streamed answer (parsed), the last being the string [DONE]."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(
        "POST",
        path,
        body=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    r = conn.getresponse()
    assert r.status == 200, r.read()
    assert r.getheader("content-type").startswith("text/event-stream")
    events = []
    for line in r.read().decode().split("\n"):
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    return events


def is_openai_error(body, status=None) -> bool:
    e = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(e, dict)
        and isinstance(e.get("message"), str)
        and e["message"]
        and isinstance(e.get("type"), str)
        and "param" in e
        and "code" in e
    )


def openai_client(front, asynchronous=False):
    import openai

    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(base_url=f"{front.base}/v1", api_key=KEY, max_retries=0, timeout=60)


PROMPT = "Hello experts, how are you?"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


# -- the official client ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_openai_client_completions_equal_transformers_greedy_text(served, family):
    s = served(family)
    c = openai_client(s.front)
    ids = s.hf_tok(PROMPT).input_ids
    want = s.hf_text(ids, 12)
    out = c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == want and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 12)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")

    # the same through a streamed answer, with the usage chunk at the end
    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])

    # token ids as the prompt: no special token added
    out = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == want and out.usage.prompt_tokens == len(ids)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_openai_client_chat_renders_the_template_and_equals_transformers(served, family):
    s = served(family)
    c = openai_client(s.front)
    text = s.hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = s.hf_tok(text, add_special_tokens=False).input_ids
    assert ids[0] == 1 and ids.count(1) == 1, "the template writes <s> once and tokenizing adds none"
    want = s.hf_text(ids, 10)
    out = c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].message.content == want and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 10
    assert out.object == "chat.completion"

    stream = c.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.slow
def test_async_openai_client_serves_concurrent_requests(served):
    s = served("llama4")
    prompts = ["The quick brown fox", "One, two, three", "In the beginning", PROMPT]
    wants = [s.hf_text(s.hf_tok(p).input_ids, 8) for p in prompts]

    async def main():
        async with openai_client(s.front, asynchronous=True) as c:
            outs = await asyncio.gather(
                *[
                    c.completions.create(
                        model=MODEL, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
                    )
                    for p in prompts
                ]
            )
            stream = await c.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=6,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            streamed = [ch async for ch in stream]
            models = await c.models.list()
            return outs, streamed, models

    outs, streamed, models = asyncio.run(main())
    assert [o.choices[0].text for o in outs] == wants
    assert streamed[-1].choices[0].finish_reason == "length"
    assert [m.id for m in models.data] == [MODEL]


# -- stop strings, n, logprobs ----------------------------------------------------------------


def _token_pieces(s, ids):
    """Each generated token's text, as decoding the growing list of ids adds it."""
    pieces, prev = [], ""
    for i in range(1, len(ids) + 1):
        t = s.tok.decode(ids[:i])
        pieces.append(t[len(prev) :] if not t.endswith("\ufffd") else "")
        prev = t if not t.endswith("\ufffd") else prev
    return pieces


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_stop_strings_match_across_token_boundaries_and_are_not_included(served, family):
    s = served(family)
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    st, full, _ = post(s.front.port, "/v1/completions", {**base, "logprobs": 0})
    assert st == 200
    text = full["choices"][0]["text"]
    ids = _generated_ids(s, base)
    pieces = _token_pieces(s, ids)
    assert "".join(pieces) == text
    # a boundary between two tokens with text on both sides, whose spanning string first occurs there
    for k in range(2, len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        if len(a) >= 1 and len(b) >= 1:
            stop = a[-2:] + b[:2]
            at = len("".join(pieces[: k + 1])) - len(a[-2:])
            if text.find(stop) == at:
                break
    else:  # the tiny checkpoint is seeded: this would mean its output changed
        pytest.fail(f"no token boundary with a unique spanning string in {pieces!r}")
    st, out, _ = post(s.front.port, "/v1/completions", {**base, "stop": ["zzzz-never", stop]})
    ch = out["choices"][0]
    assert st == 200 and ch["text"] == text[:at] and ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
    assert out["usage"]["completion_tokens"] == k + 2, "generation ended at the token completing the stop string"
    events = sse(s.front.port, "/v1/completions", {**base, "stop": stop, "stream": True})
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[:at]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    st, out, _ = post(s.front.port, "/v1/completions", {**base, "stop": stop, "include_stop_str_in_output": True})
    assert out["choices"][0]["text"] == text[:at] + stop
    # a stop token id: the generation ends at that token, and stop_reason names it
    st, out, _ = post(s.front.port, "/v1/completions", {**base, "stop_token_ids": [ids[3]]})
    ch = out["choices"][0]
    assert (ch["finish_reason"], ch["stop_reason"]) == ("stop", ids[3])
    assert out["usage"]["completion_tokens"] == ids.index(ids[3]) + 1
    # chat: the same rule on the assistant's text
    st, chat, _ = post(
        s.front.port,
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
    )
    reply = chat["choices"][0]["message"]["content"]
    cut = reply[3:6]
    if cut and reply.find(cut) == 3:
        st, chat, _ = post(
            s.front.port,
            "/v1/chat/completions",
            {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": cut},
        )
        assert chat["choices"][0]["message"]["content"] == reply[:3]


def _generated_ids(s, body):
    """The generated ids of a greedy request, through the SDK's gRPC door (same admission path)."""
    from moeserve.client import Client

    c = Client(f"127.0.0.1:{s.front.grpc_port}", token=KEY, timeout=60)
    out = c.generate(prompt=body["prompt"], max_tokens=body["max_tokens"], temperature=0.0, ignore_eos=True)
    return out.token_ids


@pytest.mark.slow
def test_n_choices_use_seed_plus_index_and_repeat(served):
    s = served("llama4")
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    st, out, _ = post(s.front.port, "/v1/completions", {**base, "n": 3, "seed": 7})
    assert st == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in out["choices"]]
    singles = [
        post(s.front.port, "/v1/completions", {**base, "seed": 7 + j})[1]["choices"][0]["text"] for j in range(3)
    ]
    assert texts == singles
    assert len(set(texts)) > 1, "different seeds sampled the same text"
    assert out["usage"]["completion_tokens"] == 24 and out["usage"]["prompt_tokens"] == len(s.hf_tok(PROMPT).input_ids)
    again = post(s.front.port, "/v1/completions", {**base, "n": 3, "seed": 7})[1]
    assert [c["text"] for c in again["choices"]] == texts
    # streamed: chunks of the choices interleave; each choice's text is the same
    events = sse(s.front.port, "/v1/completions", {**base, "n": 3, "seed": 7, "stream": True})
    got = ["", "", ""]
    for e in events[:-1]:
        for c in e["choices"]:
            got[c["index"]] += c["text"]
    assert got == texts
    # a batch of prompts: choice index = prompt index * n + j
    st, out, _ = post(s.front.port, "/v1/completions", {**base, "prompt": [PROMPT, "One, two"], "n": 2, "seed": 7})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3] and [c["text"] for c in out["choices"][:2]] == texts[:2]
    # chat with n
    st, chat, _ = post(
        s.front.port,
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "n": 2, "seed": 3, "max_tokens": 6, "temperature": 1.0},
    )
    assert st == 200 and len(chat["choices"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_are_the_log_softmax_of_the_models_logits(served, family):
    s = served(family)
    ids = s.hf_tok(PROMPT).input_ids
    n, k = 8, 5
    toks, logits = reference_decode(s.model, ids, n)
    want = torch.log_softmax(torch.tensor(logits, dtype=torch.float32), -1).numpy()  # [n, V]
    st, out, _ = post(
        s.front.port,
        "/v1/completions",
        {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": k},
    )
    lp = out["choices"][0]["logprobs"]
    np.testing.assert_allclose(lp["token_logprobs"], want[np.arange(n), toks], atol=1e-4, rtol=0)
    assert lp["tokens"] == [s.tok.token_text(t) for t in toks]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for i in range(n):
        top = np.argsort(-want[i], kind="stable")[:k]
        for t in top:
            key = s.tok.token_text(int(t))
            if sum(s.tok.token_text(int(u)) == key for u in top) == 1:  # a unique text
                assert abs(lp["top_logprobs"][i][key] - want[i, t]) < 1e-4
    # chat: logprobs with top_logprobs, tokens named with their bytes
    st, chat, _ = post(
        s.front.port,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    content = chat["choices"][0]["logprobs"]["content"]
    text = s.hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    cids = s.hf_tok(text, add_special_tokens=False).input_ids
    ctoks, clogits = reference_decode(s.model, cids, n)
    cwant = torch.log_softmax(torch.tensor(clogits), -1).numpy()
    assert [e["bytes"] for e in content] == [list(s.tok.token_bytes(t)) for t in ctoks]
    np.testing.assert_allclose([e["logprob"] for e in content], cwant[np.arange(n), ctoks], atol=1e-4, rtol=0)
    for i, e in enumerate(content):
        top = np.argsort(-cwant[i], kind="stable")[:3]
        np.testing.assert_allclose([x["logprob"] for x in e["top_logprobs"]], cwant[i, top], atol=1e-4, rtol=0)


# -- return_token_ids, no tokenizer -----------------------------------------------------------


def _sdk_ids(s, prompt_ids, n) -> list:
    """The SDK's greedy tokens (gRPC, the same admission path) for a prompt of ids."""
    from moeserve.client import Client

    c = Client(f"127.0.0.1:{s.front.grpc_port}", token=KEY, timeout=60)
    return list(c.generate(prompt_token_ids=list(prompt_ids), max_tokens=n, temperature=0.0, ignore_eos=True).token_ids)


def _choice_ids(events, index=0) -> list:
    return [t for e in events[:-1] for c in e["choices"] if c["index"] == index for t in c["token_ids"]]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_return_token_ids_are_the_sdks_greedy_tokens_and_the_tokenizers_prompt_ids(served, family):
    s = served(family)
    port = s.front.port
    ids = s.hf_tok(PROMPT).input_ids
    want = _sdk_ids(s, ids, 12)
    base = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    st, out, _ = post(port, C, base)
    ch = out["choices"][0]
    assert st == 200 and ch["prompt_token_ids"] == ids and ch["token_ids"] == want
    assert ch["text"] == s.hf_tok.decode(want, skip_special_tokens=True)
    # streamed: each choice's first chunk carries the prompt's ids, every chunk the ids it adds (a
    # chunk for each token or tokens that arrived together, whether or not its text is held
    # back), the last one none
    events = sse(port, C, {**base, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in e["choices"][0] for e in chunks[1:])
    assert _choice_ids(events) == want
    sizes = [len(e["choices"][0]["token_ids"]) for e in chunks]
    assert sizes[-1] == 0 and min(sizes[:-1]) >= 1 and sum(sizes) == 12
    assert "".join(e["choices"][0]["text"] for e in chunks) == ch["text"]
    assert events[-2]["usage"]["completion_tokens"] == 12
    # a stop string: the ids end with the token that completed it, as usage counts them
    text = ch["text"]
    k = next(k for k in range(2, len(text) - 2) if text.find(text[k : k + 2]) == k and text[k : k + 2].strip())
    st, out, _ = post(port, C, {**base, "stop": text[k : k + 2]})
    ch = out["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["text"] == text[:k]
    assert ch["token_ids"] == want[: out["usage"]["completion_tokens"]]
    events = sse(port, C, {**base, "stop": text[k : k + 2], "stream": True})
    assert _choice_ids(events) == ch["token_ids"]
    # a batch of prompts with n: each choice carries its own prompt's ids
    ids2 = [5, 6, 7, 8]
    want2 = _sdk_ids(s, ids2, 12)
    st, out, _ = post(port, C, {**base, "prompt": [PROMPT, ids2], "n": 2})
    assert [c["prompt_token_ids"] for c in out["choices"]] == [ids, ids, ids2, ids2]
    assert [c["token_ids"] for c in out["choices"]] == [want, want, want2, want2]
    events = sse(port, C, {**base, "prompt": [PROMPT, ids2], "n": 2, "stream": True})
    assert [_choice_ids(events, i) for i in range(4)] == [want, want, want2, want2]
    # without it, no ids (the answer is as before)
    st, out, _ = post(port, C, {**base, "return_token_ids": False})
    assert "token_ids" not in out["choices"][0] and "prompt_token_ids" not in out["choices"][0]
    assert all(
        "token_ids" not in c
        for e in sse(port, C, {**base, "return_token_ids": False, "stream": True})[:-1]
        for c in e["choices"]
    )
    # the official client: vLLM's extension through extra_body
    o = openai_client(s.front).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert o.choices[0].token_ids == want and o.choices[0].prompt_token_ids == ids


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_chat_return_token_ids_carry_the_rendered_prompt_and_the_generated_ids(served, family):
    s = served(family)
    port = s.front.port
    text = s.hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    cids = s.hf_tok(text, add_special_tokens=False).input_ids
    want = _sdk_ids(s, cids, 10)
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    st, out, _ = post(port, CC, body)
    assert st == 200 and out["prompt_token_ids"] == cids and out["choices"][0]["token_ids"] == want
    assert out["choices"][0]["message"]["content"] == s.hf_tok.decode(want, skip_special_tokens=True)
    events = sse(port, CC, {**body, "stream": True})
    assert events[0]["prompt_token_ids"] == cids
    assert all("prompt_token_ids" not in e for e in events[1:-1])
    assert _choice_ids(events) == want
    assert (
        "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        == out["choices"][0]["message"]["content"]
    )
    o = openai_client(s.front).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert o.prompt_token_ids == cids and o.choices[0].token_ids == want


@pytest.mark.slow
def test_without_a_tokenizer_completions_stream_a_chunk_per_token(served):
    """A front end without a tokenizer (a model folder without tokenizer.json, --tokenizer none)
    on the same cluster: prompts of ids stream a chunk per token (or per tokens that arrived
    together), without text; with return_token_ids the ids are the content."""
    from moeserve.router.engine.channel import AsyncEngineClient

    s = served("llama4")
    front = Front(AsyncEngineClient(s.cluster.control_address, s.cluster.authkey), None)
    try:
        ids = s.hf_tok(PROMPT).input_ids
        want = _sdk_ids(s, ids, 8)
        body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        events = sse(front.port, C, {**body, "stream": True})
        assert events[-1] == "[DONE]" and 3 <= len(events) <= 8 + 2
        assert all(e["choices"][0]["text"] == "" and "token_ids" not in e["choices"][0] for e in events[:-1])
        assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 2) + ["length"]
        events = sse(front.port, C, {**body, "stream": True, "return_token_ids": True})
        got = [e["choices"][0]["token_ids"] for e in events[:-1]]
        assert got[-1] == [] and all(got[:-1]) and [t for x in got for t in x] == want
        assert events[0]["choices"][0]["prompt_token_ids"] == ids
        st, out, _ = post(front.port, C, {**body, "return_token_ids": True, "n": 2, "seed": 1})
        assert st == 200 and [c["token_ids"] for c in out["choices"]] == [want, want]
        assert [c["text"] for c in out["choices"]] == ["", ""] and out["usage"]["completion_tokens"] == 16
        # text, chat and stop strings need the tokenizer: 400 saying so
        for path, b in (
            (C, {**body, "prompt": PROMPT}),
            (CC, {"model": MODEL, "messages": MESSAGES}),
            (C, {**body, "stop": "x"}),
        ):
            st, out, _ = post(front.port, path, b)
            assert st == 400 and is_openai_error(out) and "tokenizer" in out["error"]["message"], out
    finally:
        front.stop()


# -- routes, auth, gRPC with the key ----------------------------------------------------------


@pytest.mark.slow
def test_models_health_version_metrics_on_the_same_port(served):
    s = served("llama4")
    p = s.front.port
    st, models, _ = request(p, "GET", "/v1/models")
    assert st == 200 and models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert request(p, "GET", "/health", key=None)[0] == 200
    st, v, _ = request(p, "GET", "/version", key=None)
    assert st == 200 and v["version"]
    st, text, _ = request(p, "GET", "/metrics", key=None)
    assert st == 200 and "moeserve_requests_total" in text and "moeserve_time_to_first_token_seconds" in text


@pytest.mark.slow
def test_the_api_key_guards_grpc_serving_too(served):
    import grpc

    from moeserve.client import Client, MoeserveError

    s = served("llama4")
    addr = f"127.0.0.1:{s.front.grpc_port}"
    out = Client(addr, token=KEY, timeout=30).generate(prompt=PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(out.token_ids) == 4
    for token in (None, "wrong"):
        with pytest.raises(MoeserveError) as e:
            Client(addr, token=token, timeout=30).generate(prompt=PROMPT, max_tokens=4)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED


# -- bad inputs -------------------------------------------------------------------------------

OK = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
C, CC = "/v1/completions", "/v1/chat/completions"
BAD = [
    # (name, path, body, headers/key, status, message fragment, param)
    ("malformed JSON", C, b'{"model": "tiny", "prompt": ', None, 400, "not valid JSON", None),
    ("not an object", C, b"[1, 2, 3]", None, 400, "must be a JSON object", None),
    ("not UTF-8", C, b'{"prompt": "\xc3\x28"}', None, 400, "not valid JSON", None),
    ("max_tokens a string", C, {**OK, "max_tokens": "10"}, None, 400, "max_tokens must be an integer", "max_tokens"),
    (
        "temperature a string",
        C,
        {**OK, "temperature": "hot"},
        None,
        400,
        "temperature must be a finite number",
        "temperature",
    ),
    ("prompt an object", C, {**OK, "prompt": {"text": "hi"}}, None, 400, "prompt must be", "prompt"),
    ("prompt missing", C, {"model": MODEL}, None, 400, "prompt is required", "prompt"),
    ("unknown model", C, {**OK, "model": "gpt-4"}, None, 404, "does not exist", "model"),
    ("negative max_tokens", C, {**OK, "max_tokens": -1}, None, 400, "max_tokens must be in 1..", "max_tokens"),
    ("zero max_tokens", CC, {**CHAT, "max_tokens": 0}, None, 400, "max_tokens must be in 1..", "max_tokens"),
    (
        "prompt + max_tokens over max_model_len",
        C,
        {**OK, "max_tokens": MAX_MODEL_LEN},
        None,
        400,
        "exceeds max_model_len",
        None,
    ),
    ("prompt text too long", C, {**OK, "prompt": "a" * (MAX_MODEL_LEN * 64 + 1)}, None, 400, "characters", None),
    ("too many prompt ids", C, {**OK, "prompt": [5] * (MAX_MODEL_LEN + 1)}, None, 400, "tokens", None),
    ("prompt id outside the vocabulary", C, {**OK, "prompt": [5, 99999]}, None, 400, "outside the vocabulary", None),
    ("empty prompt list", C, {**OK, "prompt": []}, None, 400, "non-empty", "prompt"),
    ("empty messages", CC, {**CHAT, "messages": []}, None, 400, "messages must be a non-empty list", "messages"),
    (
        "a message without a role",
        CC,
        {**CHAT, "messages": [{"content": "hi"}]},
        None,
        400,
        "role must be one of",
        "messages",
    ),
    (
        "an image part",
        CC,
        {
            **CHAT,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        },
        None,
        400,
        "text only",
        "messages",
    ),
    ("huge n", C, {**OK, "n": 100000}, None, 400, "n must be in 1..64", "n"),
    ("presence_penalty over 2", C, {**OK, "presence_penalty": 2.5}, None, 400, "in [-2, 2]", "presence_penalty"),
    ("frequency_penalty a string", C, {**OK, "frequency_penalty": "x"}, None, 400, "finite", "frequency_penalty"),
    ("repetition_penalty 0", C, {**OK, "repetition_penalty": 0}, None, 400, "in (0, 10]", "repetition_penalty"),
    ("min_p over 1", C, {**OK, "min_p": 1.5}, None, 400, "min_p must be in [0, 1]", "min_p"),
    ("min_tokens over max_tokens", C, {**OK, "max_tokens": 4, "min_tokens": 5}, None, 400, "0..4", "min_tokens"),
    ("logit_bias over 100", C, {**OK, "logit_bias": {"5": 101}}, None, 400, "in [-100, 100]", "logit_bias"),
    ("logit_bias key not an id", C, {**OK, "logit_bias": {"a": 1}}, None, 400, "token ids", "logit_bias"),
    (
        "logit_bias of too many",
        C,
        {**OK, "logit_bias": {str(i): 1 for i in range(1025)}},
        None,
        400,
        "at most 1024",
        "logit_bias",
    ),
    (
        "logit_bias outside the vocabulary",
        C,
        {**OK, "logit_bias": {"99999": 1}},
        None,
        400,
        "outside the vocabulary",
        None,
    ),
    (
        "prompt_logprobs over the limit",
        C,
        {**OK, "prompt_logprobs": 21},
        None,
        400,
        "prompt_logprobs must be in 0..20",
        "prompt_logprobs",
    ),
    (
        "tool_choice auto without the parser flag",
        CC,
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
        None,
        400,
        "--enable-auto-tool-choice",
        "tool_choice",
    ),
    ("functions", CC, {**CHAT, "functions": [{"name": "f"}]}, None, 400, "does not support functions", "functions"),
    ("echo in chat", CC, {**CHAT, "echo": True}, None, 400, "does not support echo", "echo"),
    ("top_logprobs without logprobs", CC, {**CHAT, "top_logprobs": 2}, None, 400, "needs logprobs", "top_logprobs"),
    ("too many logprobs", C, {**OK, "logprobs": 50}, None, 400, "logprobs must be in 0..20", "logprobs"),
    (
        "stream_options without stream",
        C,
        {**OK, "stream_options": {"include_usage": True}},
        None,
        400,
        "only allowed with stream",
        "stream_options",
    ),
    ("negative seed", C, {**OK, "seed": -1}, None, 400, "seed must be in", "seed"),
    ("top_p 0", C, {**OK, "top_p": 0}, None, 400, "top_p must be in (0, 1]", "top_p"),
    ("stop of numbers", C, {**OK, "stop": [1, 2]}, None, 400, "stop must be a string or a list", "stop"),
    ("empty stop string", C, {**OK, "stop": [""]}, None, 400, "1..1024 characters", "stop"),
    ("stop_token_ids of strings", C, {**OK, "stop_token_ids": ["a"]}, None, 400, "list of integers", "stop_token_ids"),
    ("too many stop ids", C, {**OK, "stop_token_ids": [3] * 300}, None, 400, "at most 256", "stop_token_ids"),
    (
        "return_token_ids a string",
        C,
        {**OK, "return_token_ids": "yes"},
        None,
        400,
        "must be true or false",
        "return_token_ids",
    ),
    ("body over the limit", C, {**OK, "prompt": "a" * (MAX_BODY - 10)}, None, 413, "bytes", None),
    ("no API key", C, OK, {"key": None}, 401, "needs an API key", None),
    ("wrong API key", C, OK, {"key": "sk-wrong"}, 401, "wrong API key", None),
    ("not a bearer", C, OK, {"key": None, "headers": {"authorization": "Basic abc"}}, 401, "Bearer", None),
    ("models without a key", "/v1/models", None, {"key": None, "method": "GET"}, 401, "needs an API key", None),
    ("unknown route", "/v1/embeddings", OK, None, 404, "no route", None),
    ("GET on a POST route", C, None, {"method": "GET"}, 405, "not allowed", None),
]


def _baseline(s):
    st, out, _ = post(s.front.port, C, {**OK, "max_tokens": 8, "ignore_eos": True})
    assert st == 200
    return out["choices"][0]["text"]


def _idle(cluster, timeout=10.0):
    """The leader holds no request (waiting or running) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        st = cluster.status()
        if st.waiting == 0 and st.running == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.mark.slow
def test_bad_inputs_get_their_status_and_an_openai_error_and_change_nothing(served):
    s = served("llama4")
    before = _baseline(s)
    for name, path, body, opts, status, fragment, param in BAD:
        opts = dict(opts or {})
        method = opts.pop("method", "POST")
        st, out, _ = request(s.front.port, method, path, body, **opts)
        assert st == status, (name, st, out)
        assert is_openai_error(out), (name, out)
        assert fragment in out["error"]["message"], (name, out)
        if param is not None:
            assert out["error"]["param"] == param, (name, out)
        assert _idle(s.cluster), f"{name}: the leader holds a request"
        assert request(s.front.port, "GET", "/health", key=None)[0] == 200, name
    assert _baseline(s) == before
    st, text, _ = request(s.front.port, "GET", "/metrics", key=None)
    assert re.search(r"^moeserve_requests_in_flight 0\.0$", text, re.M), "a request is still counted in flight"


class StandIn:
    """As AsyncEngineClient: ``error`` raised by generate and by call."""

    def __init__(self):
        self.error = None

    async def generate(self, reqs):
        if self.error:
            raise self.error
        yield 0, Token(5)
        yield 0, Finished(FinishReason.LENGTH)

    async def call(self, method, *args):
        if self.error:
            raise self.error
        return None


@pytest.mark.timeout(60)
def test_queue_full_is_429_and_a_cluster_gone_or_draining_is_503():
    engine = StandIn()
    front = Front(engine, None, api_key=None)
    try:
        ok = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1}
        assert post(front.port, C, ok, key=None)[0] == 200
        engine.error = QueueFull("the admission queue is full (1024 waiting requests); retry later")
        for body in (ok, {**ok, "stream": True}):
            st, out, _ = post(front.port, C, body, key=None)
            assert st == 429 and is_openai_error(out) and "queue is full" in out["error"]["message"]
        engine.error = ClusterError("rank 1 exited with signal SIGKILL")
        st, out, _ = post(front.port, C, ok, key=None)
        assert st == 503 and "rank 1 exited" in out["error"]["message"]
        assert request(front.port, "GET", "/health", key=None)[0] == 503
        engine.error = None
        assert request(front.port, "GET", "/health", key=None)[0] == 200
        # text without a tokenizer: 400 saying what to send instead
        st, out, _ = post(front.port, C, {**ok, "prompt": "hi"}, key=None)
        assert st == 400 and "no tokenizer" in out["error"]["message"]
        front.api.draining = True
        st, out, _ = post(front.port, C, ok, key=None)
        assert st == 503 and "shutting down" in out["error"]["message"]
        assert request(front.port, "GET", "/health", key=None)[0] == 503
    finally:
        front.stop()


class Recording(StandIn):
    """A stand-in engine that keeps every request it was given."""

    def __init__(self):
        super().__init__()
        self.reqs = []

    async def generate(self, reqs):
        self.reqs.extend(reqs)
        async for ev in super().generate(reqs):
            yield ev


@pytest.mark.timeout(60)
def test_generation_config_defaults_fill_what_a_request_leaves_out_and_max_logprobs_bounds(caplog):
    engine = Recording()
    front = Front(engine, None, api_key=None)
    front.api.defaults = {"temperature": 0.5, "top_k": 7, "repetition_penalty": 1.2, "max_tokens": 3}
    front.api.max_logprobs = 2
    try:
        ok = {"model": MODEL, "prompt": [5, 6]}
        with caplog.at_level("WARNING", logger="moeserve.services.http"):
            assert post(front.port, C, {**ok, "not_a_field": 1}, key=None)[0] == 200
        assert "fields moeserve ignores: not_a_field" in caplog.text
        req = engine.reqs[-1]
        assert (req.sampling.temperature, req.sampling.top_k, req.sampling.repetition_penalty) == (0.5, 7, 1.2)
        assert req.max_tokens == 3
        assert post(front.port, C, {**ok, "temperature": 0, "top_k": 0, "max_tokens": 2}, key=None)[0] == 200
        req = engine.reqs[-1]
        assert (req.sampling.temperature, req.sampling.top_k, req.max_tokens) == (0.0, 0, 2)
        st, out, _ = post(front.port, C, {**ok, "logprobs": 3}, key=None)
        assert st == 400 and "logprobs must be in 0..2" in out["error"]["message"]
    finally:
        front.stop()


# -- cancellation -----------------------------------------------------------------------------


def _cancelled_count(port) -> float:
    _, text, _ = request(port, "GET", "/metrics", key=None)
    m = re.search(r'^moeserve_requests_total\{finish_reason="cancelled"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request(served, stream):
    s = served("llama4")
    port = s.front.port
    before = _cancelled_count(port)
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": [5, 6, 7],
            "max_tokens": MAX_MODEL_LEN - 3,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer "
        + KEY.encode()
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    deadline = time.monotonic() + 30
    while s.cluster.status().running == 0:  # the request reached the leader
        assert time.monotonic() < deadline
        time.sleep(0.01)
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    assert _idle(s.cluster, 10.0), "the leader still runs the request of a client that left"
    deadline = time.monotonic() + 10
    while _cancelled_count(port) < before + 1:
        assert time.monotonic() < deadline, "the request was not recorded as cancelled"
        time.sleep(0.05)


# -- HTTPS ------------------------------------------------------------------------------------

from tls_util import self_signed as _self_signed  # noqa: E402


def _https(port, ctx, body, path=C):
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.mark.timeout(60)
def test_https_serves_a_client_that_trusts_the_certificate_and_not_plain_http(tmp_path):
    import ssl

    from moeserve.services.http import HttpServer

    cert, key = _self_signed(tmp_path)
    front = Front(StandIn(), None, api_key=None, tls=(cert, key))
    try:
        assert front.base.startswith("https://")
        trusting = ssl.create_default_context(cafile=cert)
        ok = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1, "return_token_ids": True}
        st, raw = _https(front.port, trusting, ok)
        out = json.loads(raw)
        assert st == 200 and out["choices"][0]["token_ids"] == [5] and out["choices"][0]["prompt_token_ids"] == [5, 6]
        st, raw = _https(front.port, trusting, {**ok, "stream": True})
        assert st == 200 and raw.endswith(b"data: [DONE]\n\n") and b'"token_ids":[5]' in raw
        # a client that does not trust the certificate refuses the server
        with pytest.raises(ssl.SSLCertVerificationError):
            _https(front.port, ssl.create_default_context(), ok)
        # plain HTTP to the HTTPS port gets no answer
        with pytest.raises((http.client.HTTPException, OSError)):
            request(front.port, "GET", "/health", key=None, timeout=10)
        with pytest.raises((http.client.HTTPException, OSError)):
            post(front.port, C, ok, key=None, timeout=10)
        st, raw = _https(front.port, trusting, ok)  # and it still serves
        assert st == 200
    finally:
        front.stop()
    # a certificate and key that do not load: one OSError naming them, before the port is bound
    for files, fragment in (((key, key), "cannot serve HTTPS"), ((cert, str(tmp_path / "none.pem")), "not a file")):
        server = HttpServer(front.api, "127.0.0.1", 0, ssl_certfile=files[0], ssl_keyfile=files[1])
        with pytest.raises(OSError, match=fragment):
            asyncio.run(server.start())
    with pytest.raises(ValueError, match="both"):
        HttpServer(front.api, ssl_certfile=cert)


class Backlog(StandIn):
    """As AsyncEngineClient's ``generate_batches``: every stream's events in the lists
    ``batches`` (a front end behind the leader gets several steps' tokens at once)."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    async def generate_batches(self, reqs):
        for b in self.batches:
            yield [(0, ev) for ev in b]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("coalesce", ["1", "0"])
def test_a_backlog_of_tokens_streams_as_one_chunk_unless_coalescing_is_off(monkeypatch, coalesce):
    """Tokens that arrived together leave in one SSE chunk (ids in order), the finish in the
    last; with $MOESERVE_STREAM_COALESCE=0 a chunk per token."""
    monkeypatch.setenv("MOESERVE_STREAM_COALESCE", coalesce)
    engine = Backlog([[FirstToken(5), Token(6), Token(7)], [Token(8)], [Finished(FinishReason.LENGTH)]])
    front = Front(engine, None, api_key=None)
    try:
        body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 4, "stream": True, "return_token_ids": True}
        events = sse(front.port, C, body, key=None)
        assert events[-1] == "[DONE]"
        parts = [e["choices"][0] for e in events[:-1] if e["choices"]]
        ids = [p["token_ids"] for p in parts]
        if coalesce == "1":  # the HTTP side's own queue may have caught the last token too
            assert [t for x in ids for t in x] == [5, 6, 7, 8] and ids[0][:3] == [5, 6, 7] and len(ids) <= 3
        else:
            assert ids == [[5], [6], [7], [8], []]
        assert parts[-1]["finish_reason"] == "length" and all(p["finish_reason"] is None for p in parts[:-1])
    finally:
        front.stop()
