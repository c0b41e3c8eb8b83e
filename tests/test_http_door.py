"""The HTTP front door's limits, against the production front end (HttpApi on uvicorn, in this
process) with stand-ins of the leader: headers over their size or count are 431 before the rest
is read; headers and bodies that trickle in are cut off with 408; idle connections close; more
connections than the cap get 503 while the others are served; numeric fields outside their
range and text that is not valid Unicode are 400 naming the range; a request over the size
budget is refused before a template renders it or a tokenizer sees it; one request of many
choices cannot starve another; a stream still running when the drain's grace period ends gets
an error event and ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time

import numpy as np
import pytest
from test_http_api import MODEL, Front, StandIn, is_openai_error, post

from moeserve.router.engine.api import Finished, FinishReason, Token
from moeserve.services.http.door import DoorLimits

pytestmark = pytest.mark.timeout(120)

C, CC = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1}


@pytest.fixture
def front():
    f = Front(
        StandIn(), None, api_key=None, door=DoorLimits(header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=0.5)
    )
    yield f
    f.stop()


def _connect(port) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _answer(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (which it must within
    ``timeout``)."""
    sock.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open for {timeout} s (sent {out[:80]!r})") from None
        if not chunk:
            break
        out += chunk
    return out


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else -1


def _error(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


# -- headers, bodies, connections ---------------------------------------------------------------


def test_a_header_line_over_the_limit_is_431_before_the_rest_is_read(front):
    sock = _connect(front.port)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
    sent, answered = 0, b""
    chunk = b"a" * (64 << 10)
    while sent < 64 << 20:  # a 64 MB header line, unless the server answers first
        if select.select([sock], [], [], 0)[0]:
            answered = _answer(sock)
            break
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            answered = _answer(sock)
            break
        sent += len(chunk)
    sock.close()
    assert _status(answered) == 431, answered[:200]
    assert "larger than 65536 bytes" in _error(answered)["error"]["message"]
    assert sent < 8 << 20, f"the server read {sent} bytes of the header before it answered"
    assert post(front.port, C, OK, key=None)[0] == 200


def test_more_header_fields_than_the_limit_is_431(front):
    sock = _connect(front.port)
    fields = b"".join(b"x-%d: 1\r\n" % i for i in range(300))
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + fields + b"\r\n")
    answer = _answer(sock)
    sock.close()
    assert _status(answer) == 431 and "301 header fields; at most 256" in _error(answer)["error"]["message"]


def test_headers_or_a_body_that_trickle_in_are_cut_off_with_408_and_the_connections_close(front):
    slow_heads = [_connect(front.port) for _ in range(200)]  # slowloris: a header line, then nothing
    for s in slow_heads:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
    slow_body = _connect(front.port)
    slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
    assert post(front.port, C, OK, key=None)[0] == 200  # served meanwhile
    answers = [_answer(s) for s in slow_heads]
    assert all(_status(a) == 408 for a in answers), {a[:40] for a in answers}
    assert "headers did not arrive within 0.5 s" in _error(answers[0])["error"]["message"]
    answer = _answer(slow_body)
    assert _status(answer) == 408 and "body did not arrive within 0.5 s" in _error(answer)["error"]["message"]
    for s in [*slow_heads, slow_body]:
        s.close()


def test_an_idle_connection_is_closed_fresh_and_between_requests(front):
    fresh = _connect(front.port)
    assert _answer(fresh) == b""  # closed by the server, no byte sent either way
    fresh.close()
    used = _connect(front.port)
    used.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    answer = _answer(used)  # the answer, then the close after the keep-alive timeout
    used.close()
    assert _status(answer) == 200


def test_connections_over_the_cap_get_503_and_the_others_are_served():
    f = Front(StandIn(), None, api_key=None, door=DoorLimits(max_connections=4, keep_alive_s=30))
    try:
        held = [_connect(f.port) for _ in range(4)]
        time.sleep(0.2)  # accepted
        extra = _connect(f.port)
        answer = _answer(extra)
        assert _status(answer) == 503 and "4 connections already" in _error(answer)["error"]["message"]
        held[0].sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        held[0].settimeout(30)
        assert held[0].recv(100).startswith(b"HTTP/1.1 200")
        for s in [*held, extra]:
            s.close()
        time.sleep(0.2)
        assert post(f.port, C, OK, key=None)[0] == 200  # the places came back
    finally:
        f.stop()


# -- what a request may hold --------------------------------------------------------------------

SURROGATE = "abc\ud800def"
OUT_OF_RANGE = [
    # (name, path, body, message fragment, param)
    ("top_k of 2**63", C, {**OK, "top_k": 2**63}, "top_k must be in -1..", "top_k"),
    ("top_k over int32", C, {**OK, "top_k": 2**40}, "top_k must be in -1..", "top_k"),
    ("a prompt id of 10**30", C, {**OK, "prompt": [5, 10**30]}, "prompt token ids: ", "prompt"),
    ("a negative prompt id", C, {**OK, "prompt": [[5], [-1]]}, "prompt token ids: ", "prompt"),
    (
        "a stop id of 10**30",
        C,
        {**OK, "stop_token_ids": [10**30]},
        "is outside the ids an int32 holds",
        "stop_token_ids",
    ),
    ("a seed of 2**64", C, {**OK, "seed": 2**64}, "seed must be in 0..9223372036854775807", "seed"),
    ("n of 2**40", C, {**OK, "n": 2**40}, "n must be in 1..64", "n"),
    ("max_tokens of 10**30", C, {**OK, "max_tokens": 10**30}, "max_tokens must be in 1..256", "max_tokens"),
    ("logprobs of 10**30", C, {**OK, "logprobs": 10**30}, "logprobs must be in 0..20", "logprobs"),
    ("temperature 1e400", C, b'{"prompt": [5], "temperature": 1e400}', "temperature must be a finite number", None),
    # the sampling parameters of the OpenAI and vLLM APIs beyond the first ones
    ("min_p of 2**63", C, {**OK, "min_p": 2**63}, "min_p must be in [0, 1]", "min_p"),
    ("presence_penalty NaN", C, b'{"prompt": [5], "presence_penalty": NaN}', "presence_penalty must be a finite", None),
    ("frequency_penalty 1e308", C, {**OK, "frequency_penalty": 1e308}, "in [-2, 2]", "frequency_penalty"),
    ("repetition_penalty 2**63", C, {**OK, "repetition_penalty": 2**63}, "in (0, 10]", "repetition_penalty"),
    ("min_tokens of 2**63", C, {**OK, "min_tokens": 2**63}, "min_tokens must be in 0..", "min_tokens"),
    ("min_tokens true", C, {**OK, "min_tokens": True}, "min_tokens must be an integer", "min_tokens"),
    ("a logit_bias of 1e308", C, {**OK, "logit_bias": {"5": 1e308}}, "in [-100, 100]", "logit_bias"),
    ("a logit_bias id of 10**30", C, {**OK, "logit_bias": {str(10**30): 1}}, "token ids", "logit_bias"),
    ("a logit_bias id past int32", C, {**OK, "logit_bias": {str(2**33): 1}}, "the ids an int32 holds", "logit_bias"),
    ("a logit_bias id of a digit int() refuses", C, {**OK, "logit_bias": {"\u00b2": 1}}, "token ids", "logit_bias"),
    ("prompt_logprobs of 10**30", C, {**OK, "prompt_logprobs": 10**30}, "prompt_logprobs must be in 0..20", None),
    (
        "top_logprobs of 10**30",
        CC,
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 10**30},
        "top_logprobs must be in 0..20",
        "top_logprobs",
    ),
    ("a cache_salt too long", C, {**OK, "cache_salt": "s" * 2000}, "cache_salt must be", "cache_salt"),
    ("a lone surrogate in the prompt", C, {**OK, "prompt": SURROGATE}, "not valid Unicode", None),
    ("a lone surrogate in a stop string", C, {**OK, "stop": [SURROGATE]}, "not valid Unicode", None),
    ("a lone surrogate in a key", C, {**OK, SURROGATE: 1}, "not valid Unicode", None),
    (
        "a lone surrogate in a message",
        CC,
        {"model": MODEL, "messages": [{"role": "user", "content": SURROGATE}]},
        "not valid Unicode",
        None,
    ),
]


@pytest.mark.parametrize("name,path,body,fragment,param", OUT_OF_RANGE, ids=[row[0] for row in OUT_OF_RANGE])
def test_a_value_outside_its_range_is_400_naming_the_range(front, name, path, body, fragment, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # json.dumps keeps \ud800 escaped
    st, out, _ = post(front.port, path, raw, key=None)
    assert st == 400 and is_openai_error(out), (st, out)
    assert fragment in out["error"]["message"], out
    if param is not None:
        assert out["error"]["param"] == param, out
    assert post(front.port, C, OK, key=None)[0] == 200


class CountingTokenizer:
    """A ModelTokenizer of the tiny checkpoint that counts what it renders and encodes."""

    def __new__(cls, path):
        from moeserve.services.tokenizer import ModelTokenizer

        class Counting(ModelTokenizer):
            renders = 0
            encoded = 0

            def render_chat(self, *a, **kw):
                Counting.renders += 1
                return super().render_chat(*a, **kw)

            def encode(self, text, add_special_tokens=True):
                Counting.encoded += len(text)
                return super().encode(text, add_special_tokens)

        base = ModelTokenizer.load(path)
        return Counting(base.tokenizer, base.special_tokens, base.chat_template)


def test_a_request_over_the_size_budget_is_refused_before_a_template_renders_it_or_a_tokenizer_sees_it(tmp_path):
    from cluster_util import tiny_checkpoint

    tok = CountingTokenizer(tiny_checkpoint(tmp_path / "m", "llama4"))
    f = Front(StandIn(), tok, api_key=None)
    try:
        hi = [{"role": "user", "content": "hi"}]
        assert post(f.port, CC, {"model": MODEL, "messages": hi, "max_tokens": 1}, key=None)[0] == 200
        renders, encoded = type(tok).renders, type(tok).encoded
        budget = 256 * 64 + (64 << 10)  # request_budget at max_model_len 256
        heavy = [
            ("a template variable", {"messages": hi, "chat_template_kwargs": {"bos_token": "x" * (budget + 10)}}),
            ("empty messages", {"messages": [{"role": "user", "content": ""}] * 20000}),
            ("a message's other fields", {"messages": [{"role": "user", "content": "hi", "name": "n" * budget}]}),
            ("stop strings", {"messages": hi, "stop": ["s" * 1024] * 64, "chat_template_kwargs": {"a": "b" * 20000}}),
            ("tools", {"messages": hi, "tools": [{"type": "function", "function": {"name": "f" * budget}}]}),
            ("a cache_salt", {"messages": hi, "cache_salt": "c" * (budget + 10)}),
            ("a logit_bias", {"messages": hi, "logit_bias": {str(i): 1 for i in range(budget // 4)}}),
        ]
        for name, body in heavy:
            st, out, _ = post(f.port, CC, {"model": MODEL, "max_tokens": 1, **body}, key=None)
            assert st == 400 and "larger than this server takes" in out["error"]["message"], (name, st, out)
        st, out, _ = post(f.port, C, {**OK, "prompt": "p" * 10000, "unknown_field": "u" * budget}, key=None)
        assert st == 400 and "larger than this server takes" in out["error"]["message"], out
        assert (type(tok).renders, type(tok).encoded) == (renders, encoded), "a refused request was rendered or encoded"
    finally:
        f.stop()


def test_n_times_the_prompts_tokens_and_max_tokens_over_the_request_tokens_is_400(front):
    st, out, _ = post(front.port, C, {**OK, "prompt": [[5] * 10] * 4, "n": 64, "max_tokens": 100}, key=None)
    assert st == 400 and "hold" in out["error"]["message"] and "at most 4096" in out["error"]["message"], out
    assert out["error"]["param"] == "n"
    assert post(front.port, C, {**OK, "prompt": [[5] * 10] * 4, "n": 8, "max_tokens": 100}, key=None)[0] == 200


# -- one request's share of the batch -----------------------------------------------------------


class FifoLeader:
    """The leader as the front end sees it: requests admitted in arrival order to ``capacity``
    running places, each producing max_tokens tokens, one per ``tick`` seconds."""

    def __init__(self, capacity: int = 8, tick: float = 0.002, vocab: int = 32):
        self.capacity, self.tick, self.vocab = capacity, tick, vocab
        self.sem = None
        self.open = 0  # requests submitted and not ended
        self.most_open = 0
        self.finished = 0
        self.first_token_of: dict[int, int] = {}  # max_tokens -> requests finished before its first token

    async def generate(self, reqs):
        if self.sem is None:
            self.sem = asyncio.Semaphore(self.capacity)  # FIFO waiters: the leader's queue
        req = reqs[0]
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            async with self.sem:
                for j in range(req.max_tokens):
                    await asyncio.sleep(self.tick)
                    if j == 0:
                        self.first_token_of.setdefault(req.max_tokens, self.finished)
                    logits = np.zeros((1, self.vocab), dtype=np.float32) if req.return_logits else None
                    yield 0, Token(5, logits)
                self.finished += 1  # the consumer closes this generator at the Finished event
                yield 0, Finished(FinishReason.LENGTH)
        finally:
            self.open -= 1


@pytest.mark.parametrize("logprobs", [None, 2])
def test_one_request_of_many_choices_cannot_starve_another(logprobs):
    leader = FifoLeader()
    f = Front(leader, None, api_key=None, max_model_len=64, max_request_tokens=1 << 20)
    try:
        big = {"model": MODEL, "prompt": [[5]] * 4, "n": 64, "max_tokens": 20, "logprobs": logprobs}
        box = {}
        th = threading.Thread(target=lambda: box.update(big=post(f.port, C, big, key=None)))
        th.start()
        deadline = time.monotonic() + 30
        while leader.finished < 2:  # the big request is running
            assert time.monotonic() < deadline
            time.sleep(0.005)
        st, out, _ = post(f.port, C, {**OK, "max_tokens": 3}, key=None)  # the victim
        th.join(60)
        assert st == 200 and box["big"][0] == 200 and len(box["big"][1]["choices"]) == 256
        share = 16 if logprobs is None else 4
        assert leader.most_open <= share + 1, f"{leader.most_open} choices of one request were on the leader at once"
        before = leader.first_token_of[3]
        assert before <= share + leader.capacity, f"the victim waited for {before} choices of the other request"
    finally:
        f.stop()


# -- the drain ----------------------------------------------------------------------------------


class EndlessLeader:
    """Tokens every 50 ms, never finishing."""

    async def generate(self, reqs):
        while True:
            await asyncio.sleep(0.05)
            yield 0, Token(5)


def test_a_stream_still_running_when_the_grace_period_ends_gets_an_error_event_and_done():
    f = Front(EndlessLeader(), None, api_key=None, grace_s=0.5)
    try:
        sock = _connect(f.port)
        body = json.dumps({**OK, "max_tokens": 200, "stream": True}).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        sock.settimeout(30)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200") and b"data: " in first
        stopping = threading.Thread(target=lambda: f.run(f.http.stop()))
        stopping.start()
        rest = first + _answer(sock)
        stopping.join(30)
        sock.close()
        events = [ln[len(b"data: ") :] for ln in rest.split(b"\n") if ln.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert "shutting down" in error["message"] and "grace period" in error["message"], error
        assert error["type"] == "service_unavailable"
    finally:
        f.stop()


def test_text_that_takes_too_long_to_tokenize_is_refused_and_others_are_served(monkeypatch, tmp_path):
    from cluster_util import tiny_checkpoint

    import moeserve.services.admission as admission
    from moeserve.services.tokenizer import ModelTokenizer

    monkeypatch.setattr(admission, "TEXT_WORK_S", 0.3)
    base = ModelTokenizer.load(tiny_checkpoint(tmp_path / "m", "llama4"))

    class Slow(ModelTokenizer):
        def encode(self, text, add_special_tokens=True):
            if "slow" in text:
                time.sleep(2)
            return super().encode(text, add_special_tokens)

    f = Front(
        StandIn(), Slow(base.tokenizer, base.special_tokens, base.chat_template), api_key=None, max_model_len=2048
    )
    try:
        st, out, _ = post(f.port, C, {**OK, "prompt": "slow " * 400}, key=None)
        assert st == 400 and "took more than 0.3 s to render or tokenize" in out["error"]["message"], out
        assert post(f.port, C, {**OK, "prompt": "fast " * 210}, key=None)[0] == 200  # off the loop too
    finally:
        f.stop()
