"""``moeserve serve MODEL``: a Hugging Face id resolved from an offline hub cache starts the whole
cluster with the HTTP API; a vLLM command line from docs/http-api.md starts and serves; a
port in use, a missing model, vLLM flags moeserve cannot honour and Ctrl-C each give one clear
message and an exit code, no traceback; init-model's files are readable by every user."""

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import test_hub as H
from cluster_util import reference_generate, reference_model, tiny_checkpoint
from control_util import TOKEN, alive, children_of, free_ports

from moeserve.cli import main

pytestmark = pytest.mark.timeout(300)

KEY = "sk-serve"
REPO = "tiny-org/tiny-llama4"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("serve") / "llama4", "llama4")


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny):
    """An HF_HOME whose hub cache holds REPO (laid out as huggingface_hub lays it out)."""
    home = tmp_path_factory.mktemp("hf")
    H.make_hub_cache(home / "hub", REPO, tiny)
    return home


def offline_env(hf_home, **more) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "MOESERVE_API_KEY")
    }
    env.update(
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        HF_ENDPOINT="http://127.0.0.1:9",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        **more,
    )
    return env


class Serve:
    """``moeserve serve ...`` as a subprocess, ready when it printed "ready"."""

    def __init__(
        self, args, env, wait_ready=True, timeout_s=240.0, command=(sys.executable, "-m", "moeserve"), cwd=None
    ):
        self.http, self.grpc, self.admin, self.balancer = free_ports(4)
        self.log_dir = tempfile.mkdtemp(prefix="moeserve-serve-")
        self.out_path = os.path.join(self.log_dir, "serve.out")
        self.cmd = [
            *command,
            "serve",
            *args,
            "--port",
            str(self.http),
            "--grpc-port",
            str(self.grpc),
            "--admin-port",
            str(self.admin),
            "--balancer-port",
            str(self.balancer),
            "--admin-token",
            TOKEN,
            "--log-dir",
            self.log_dir,
            "--grace-period",
            "10",
        ]
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd
            )
        if wait_ready:
            self.wait_for("ready", timeout_s)

    def output(self) -> str:
        return Path(self.out_path).read_text(errors="replace")

    def wait_for(self, word: str, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while word not in self.output().splitlines():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                logs = "\n".join(
                    f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
                    for p in sorted(Path(self.log_dir).glob("*.log"))
                )
                raise RuntimeError(f"moeserve serve did not print {word!r}:\n{self.output()}\n{logs}")
            time.sleep(0.1)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http}/v1"

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _no_traceback(text: str) -> None:
    assert "Traceback" not in text, text


@pytest.mark.slow
def test_serve_a_hub_id_from_an_offline_cache(tiny, hf_home):
    """`moeserve serve <hub id>` with HF_HUB_OFFLINE=1: the snapshot in HF_HOME serves the HTTP
    API (openai client, API key), gRPC serving takes the same key; Ctrl-C drains and exits 0."""
    import openai

    from moeserve.client import Client

    want_ids = reference_generate(reference_model(tiny), [1, 5, 6, 7], 8)
    s = Serve([REPO, "--api-key", KEY, "--max-model-len", "256"], offline_env(hf_home))
    try:
        out = s.output()
        for line in (
            "loading ",
            "weights loaded",
            f"http     http://127.0.0.1:{s.http}/v1",
            f"model    {REPO}",
            f"serving  127.0.0.1:{s.grpc}",
            f"admin    127.0.0.1:{s.admin}",
        ):
            assert line in out, out
        c = openai.OpenAI(base_url=s.base, api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == [REPO]
        got = c.completions.create(
            model=REPO, prompt=[1, 5, 6, 7], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        from moeserve.services.tokenizer import ModelTokenizer

        assert got.choices[0].text == ModelTokenizer.load(tiny).decode(want_ids)
        chat = c.chat.completions.create(
            model=REPO, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert chat.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base, api_key="wrong", max_retries=0).models.list()
        grpc_out = Client(f"127.0.0.1:{s.grpc}", token=KEY, timeout=60).generate(
            prompt_token_ids=[1, 5, 6, 7], max_tokens=8, temperature=0.0, ignore_eos=True
        )
        assert grpc_out.token_ids == want_ids
        kids = children_of(s.proc.pid)
        assert kids
    finally:
        code = s.stop(signal.SIGINT)  # Ctrl-C: drains as SIGTERM does
    out = s.output()
    assert code == 0, out
    _no_traceback(out)
    assert "draining" in out
    deadline = time.monotonic() + 15
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in kids), "a child outlived moeserve serve"


@pytest.mark.slow
def test_serve_from_a_folder_that_holds_a_checkout_named_moeserve(tiny, hf_home, tmp_path):
    """A plain ``git clone`` names its folder after the project: started from the folder above
    it, every child process (ranks, front end, balancer) still imports the installed moeserve,
    not the checkout's root as a namespace package, and the cluster serves."""
    import openai

    script = Path(sys.executable).with_name("moeserve")
    assert script.exists(), f"the console script {script} is missing: install moeserve (scripts/setup)"
    checkout = tmp_path / "moeserve"
    for folder in ("router", "expert_worker", "balancer", "proto", "tests"):  # what a checkout's root holds
        (checkout / folder).mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("[project]\nname = 'moeserve'\n")
    env = offline_env(hf_home)
    s = Serve([str(tiny), "--max-model-len", "256"], env, command=(str(script),), cwd=tmp_path)
    try:
        c = openai.OpenAI(base_url=s.base, api_key="none", max_retries=0, timeout=60)
        out = c.completions.create(model=str(tiny), prompt=[1, 5, 6, 7], max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
    finally:
        assert s.stop() == 0


@pytest.mark.slow
def test_a_vllm_command_line_from_the_readme_starts_and_serves(tiny, hf_home):
    """The vLLM line of docs/http-api.md: -dp 2 with expert parallelism = 2 co-located ranks, tp 1,
    vLLM's --eplb-config keys, --served-model-name, --dtype auto, --trust-remote-code."""
    import openai

    from moeserve.client import Client

    s = Serve(
        [
            REPO,
            "--served-model-name",
            "tiny",
            "--data-parallel-size",
            "2",
            "--enable-expert-parallel",
            "--tensor-parallel-size",
            "1",
            "--enable-eplb",
            "--eplb-config",
            '{"window_size": 100, "step_interval": 500, "num_redundant_experts": 2, "use_async": true, '
            '"policy": "default", "log_balancedness": true, "log_balancedness_interval": 500}',
            "--max-model-len",
            "256",
            "--dtype",
            "auto",
            "--trust-remote-code",
        ],
        offline_env(hf_home),
    )
    try:
        c = openai.OpenAI(base_url=s.base, api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        events = list(
            c.completions.create(
                model="tiny", prompt="Hello", max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
            )
        )
        assert events[-1].choices[0].finish_reason == "length"
        status = Client(f"127.0.0.1:{s.admin}", TOKEN, timeout=30).status()
        assert [r.role for r in status.ranks] == ["router+worker", "router+worker"]
        assert status.eplb.enable_eplb and status.eplb.num_redundant_experts == 2
        assert status.eplb.window_size == 100 and status.eplb.step_interval == 500
        assert "use_async" in s.output()
    finally:
        code = s.stop()
    assert code == 0, s.output()
    _no_traceback(s.output())


@pytest.mark.slow
def test_the_second_of_two_requests_sharing_a_200_token_prompt_reads_192_tokens_from_the_cache(tiny, hf_home):
    """``moeserve serve`` (prefix caching on by default): the second request of one 200-token
    prompt reports all but its last block of 16 as cached (``usage.prompt_tokens_details``), the
    cluster's status counts the hit, and both answers are transformers' greedy text."""
    import hf_oracle as hf
    import numpy as np
    import openai
    import torch
    from transformers import AutoTokenizer

    from moeserve.client import Client
    from moeserve.models import load_config

    ids = np.random.default_rng(2).integers(3, load_config(tiny).vocab_size, 200).tolist()
    out = hf.hf_greedy(hf.load_oracle(tiny), torch.tensor([ids]), 16)[0, 200:].tolist()
    want = AutoTokenizer.from_pretrained(tiny).decode(out, skip_special_tokens=True)
    s = Serve([str(tiny), "--served-model-name", "tiny", "--max-model-len", "512"], offline_env(hf_home))
    try:
        c = openai.OpenAI(base_url=s.base, api_key="unused", max_retries=0, timeout=60)
        got = [
            c.completions.create(
                model="tiny", prompt=ids, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
            )
            for _ in range(2)
        ]
        assert [g.choices[0].text for g in got] == [want, want]
        cached = [g.usage.prompt_tokens_details.cached_tokens for g in got]
        assert cached[0] == 0 and cached[1] >= 192, cached
        status = Client(f"127.0.0.1:{s.admin}", TOKEN, timeout=30).status()
        assert status.prefix_cache_hits == cached[1] and status.prefix_cache_queries == 400
    finally:
        code = s.stop()
    assert code == 0, s.output()
    _no_traceback(s.output())


@pytest.mark.slow
def test_ctrl_c_while_loading_stops_everything_at_once(tiny, hf_home):
    s = Serve([REPO, "--max-model-len", "256"], offline_env(hf_home), wait_ready=False)
    deadline = time.monotonic() + 60
    while "loading " not in s.output():
        assert s.proc.poll() is None and time.monotonic() < deadline, s.output()
        time.sleep(0.05)
    time.sleep(0.5)
    kids = children_of(s.proc.pid)
    started = time.monotonic()
    code = s.stop(signal.SIGINT, timeout_s=30)
    assert code == 130, s.output()
    assert time.monotonic() - started < 20
    assert "interrupted while starting" in s.output()
    _no_traceback(s.output())
    deadline = time.monotonic() + 10
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in kids)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_missing_model_is_one_line_and_exit_1(hf_home):
    p = subprocess.run(
        [sys.executable, "-m", "moeserve", "serve", "tiny-org/not-there", "--port", "0"],
        env=offline_env(hf_home),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert p.returncode == 1
    err = p.stderr.strip()
    assert err.startswith("moeserve serve: error: model tiny-org/not-there") and "HF_HUB_OFFLINE" in err, err
    assert len(err.splitlines()) == 1
    _no_traceback(p.stderr + p.stdout)


@pytest.mark.timeout(60)
def test_a_port_in_use_is_one_line_and_exit_1(tiny, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", str(tiny), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 (--port (the HTTP API)) is already in use" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tensor-parallel-size", "2"], "without --enable-expert-parallel would split attention"),
        (["--pipeline-parallel-size", "2"], "moeserve does not split layers"),
        (["--data-parallel-size", "2"], "add --enable-expert-parallel"),
        (["--data-parallel-size", "2", "--enable-expert-parallel", "--routers", "3"], "disagrees with --routers 3"),
        (["--eplb-config", '{"policy": "flashlb"}'], "policy 'flashlb' is not available"),
        (["--eplb-config", '{"use_async": "yes"}'], "'use_async' must be true or false"),
        (
            ["--eplb-config", '{"log_balancedness": true, "step_interval": 100, "log_balancedness_interval": 7}'],
            "set step_interval to 7",
        ),
        (["--eplb-config", '{"window": 3}'], "unknown keys ['window']"),
        (["--model", "/elsewhere"], "disagree"),
    ],
)
def test_vllm_flags_moeserve_cannot_honour_exit_2_with_what_to_do(tiny, argv, message, capsys):
    assert main(["serve", str(tiny), *argv]) == 2
    assert message in capsys.readouterr().err


def test_vllm_flags_map_to_the_cluster(tiny):
    from moeserve.cli import build_parser, serve
    from moeserve.cli import flags as F

    args = build_parser().parse_args(
        [
            "serve",
            str(tiny),
            "-dp",
            "2",
            "--enable-expert-parallel",
            "--enable-eplb",
            "--eplb-config",
            '{"use_async": false, "num_redundant_experts": 2}',
        ]
    )
    serve.parallel(args)
    notes = serve.vllm_eplb_config(args)
    args.model = str(tiny)
    kw = F.cluster_kwargs(args)
    assert (kw["routers"], kw["workers"], kw["colocated"], kw["num_redundant_experts"]) == (2, 2, True, 2)
    assert kw["migration_bytes_per_step"] >= 1 << 40 and "one step" in notes[0]
    assert serve._dtype(args, Path(tiny)) == "float32"


def test_tensor_parallel_with_expert_parallel_is_n_colocated_ranks_and_needs_a_gpu_each(tiny):
    from moeserve.cli import UsageError, build_parser, serve

    def parse(*flags):
        return build_parser().parse_args(["serve", str(tiny), *flags])

    args = parse("-tp", "8", "--enable-expert-parallel")
    line = serve.parallel(args, visible_gpus=8)
    assert (args.routers, args.workers, args.colocated) == (8, 8, True)
    assert "8 co-located ranks on 8 GPUs" in line and "data-parallel attention" in line
    with pytest.raises(UsageError, match=r"needs 8 GPUs \(one per rank\); 4 are visible"):
        serve.parallel(parse("-tp", "8", "--enable-expert-parallel"), visible_gpus=4)
    args = parse("-tp", "2", "-dp", "2", "--enable-expert-parallel")
    assert "4 co-located ranks on 4 CPU ranks" in serve.parallel(args, visible_gpus=0)
    assert (args.routers, args.workers) == (4, 4)
    assert serve.parallel(parse(), visible_gpus=0) is None


def test_a_vllm_command_line_with_its_other_flags_maps_to_the_cluster_and_says_what_each_became(tiny, tmp_path):
    from moeserve.cli import UsageError, build_parser, serve, vllm_flags
    from moeserve.cli import flags as F

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    argv = ["serve", str(tiny), "-tp", "8", "--enable-expert-parallel", "--enable-eplb", "--seed", "7"]
    argv += ["--kv-cache-dtype", "auto", "--max-logprobs", "5", "--generation-config", "vllm"]
    argv += ["--chat-template", str(template), "--trust-remote-code", "--disable-log-requests"]
    argv += ["--enable-prefix-caching", "--swap-space", "16", "--distributed-executor-backend", "mp", "-O", "3"]
    args = build_parser().parse_args(argv)
    serve.parallel(args, visible_gpus=8)
    notes = vllm_flags.check_vllm_noops(args)
    assert any(n.startswith("--swap-space 16: accepted, a preempted sequence is recomputed") for n in notes)
    assert not any(n.startswith("--enable-prefix-caching") for n in notes) and len(notes) == 5
    args.model = str(tiny)
    kw = F.cluster_kwargs(args)
    assert (kw["routers"], kw["colocated"], kw["seed"], kw["enable_prefix_caching"]) == (8, True, 7, True)
    off = build_parser().parse_args(["serve", str(tiny), "--no-enable-prefix-caching"])
    off.model = str(tiny)
    assert F.cluster_kwargs(off)["enable_prefix_caching"] is False
    from moeserve.cli.up import frontend_text_flags

    flags = frontend_text_flags(args)
    assert flags[:4] == ["--max-logprobs", "5", "--generation-config", "vllm"]
    assert flags[-2:] == ["--chat-template", str(template)]
    for bad, message in (
        (["--kv-cache-dtype", "fp8"], "the KV cache is kept in the model's dtype; moeserve takes auto"),
        (["--enable-lora"], "moeserve does not serve this"),
        (["--speculative-config", "{}"], "moeserve does not serve this"),
    ):
        with pytest.raises(UsageError, match=message):
            vllm_flags.check_vllm_noops(build_parser().parse_args(["serve", str(tiny), *bad]))


def test_generation_config_defaults_and_overrides_are_read_and_bounded(tmp_path):
    from moeserve.services.tokenizer import chat_template_arg, generation_defaults

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "max_new_tokens": 64})
    )
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert generation_defaults(tmp_path, {"temperature": 0.1})["temperature"] == 0.1
    assert generation_defaults(tmp_path / "none") == {}
    with pytest.raises(ValueError, match="top_p = 2 is out of its range"):
        generation_defaults(tmp_path, {"top_p": 2})
    with pytest.raises(ValueError, match="unknown generation config keys"):
        generation_defaults(tmp_path, {"typo": 1})
    assert chat_template_arg("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="no such file, and not a template"):
        chat_template_arg("missing.jinja")


def test_init_model_files_are_readable_by_every_user(tmp_path):
    from moeserve.models.init import WRITTEN_FILES, init_model

    old = os.umask(0o077)  # as strict as a umask gets
    try:
        out = init_model(tmp_path / "m", "ernie45", seed=1)
    finally:
        os.umask(old)
    for name in WRITTEN_FILES:
        mode = stat.S_IMODE((out / name).stat().st_mode)
        assert mode == 0o644, (name, oct(mode))
    assert stat.S_IMODE(out.stat().st_mode) & 0o005 == 0o005, "others cannot list the folder"


@pytest.mark.timeout(60)
def test_vllm_ssl_flags_are_the_tls_files_of_every_server(tiny, tmp_path, capsys):
    """--ssl-certfile / --ssl-keyfile (vLLM's names for HTTPS) are --tls-cert / --tls-key: one
    certificate for the HTTP API and the gRPC services; giving half of it, or both spellings with
    other files, is a usage error (exit 2)."""
    from moeserve.cli import build_parser

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    for cmd in (["serve", str(tiny)], ["up", "--model", str(tiny)], ["frontend", "--http-port", "0"]):
        args = build_parser().parse_args([*cmd, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
        assert (args.tls_cert, args.tls_key) == (str(cert), str(key)), cmd
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", str(tiny), "--tls-cert", "a.pem", "--ssl-certfile", "b.pem"])
    assert e.value.code == 2 and "--ssl-certfile b.pem disagrees with --tls-cert a.pem" in capsys.readouterr().err
    assert main(["serve", str(tiny), "--ssl-certfile", str(cert)]) == 2
    assert "HTTPS needs both --ssl-certfile and --ssl-keyfile" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", [["--tokenizer", "none"], ["--skip-tokenizer-init"]])
def test_tokenizer_none_gives_the_front_end_no_tokenizer(tiny, flag, monkeypatch):
    from moeserve.cli import up
    from moeserve.services.tokenizer import ModelTokenizer

    seen = {}

    def fake_run(args):
        folder = Path(args.tokenizer_dir)
        seen.update(
            folder=folder,
            files=sorted(p.name for p in folder.iterdir()),
            model=args.model,
            tokenizer=ModelTokenizer.load(folder),
        )
        return 0

    monkeypatch.setattr(up, "run", fake_run)
    assert main(["serve", str(tiny), *flag, "--port", "0"]) == 0
    assert seen["files"] == [] and seen["tokenizer"] is None and seen["model"] == str(tiny)
    assert ModelTokenizer.load(tiny) is not None, "the model folder has a tokenizer that was left out"
    assert not seen["folder"].exists(), "the empty folder is removed when serve ends"


@pytest.mark.slow
def test_serve_with_vllm_ssl_flags_serves_https(tiny, hf_home, tmp_path):
    """``moeserve serve MODEL --ssl-certfile C --ssl-keyfile K``: the HTTP API answers a client that
    trusts the certificate; plain HTTP to that port gets no answer."""
    import http.client
    import json
    import ssl

    from tls_util import self_signed

    cert, key = self_signed(tmp_path)
    s = Serve([str(tiny), "--ssl-certfile", cert, "--ssl-keyfile", key], offline_env(hf_home))
    try:
        assert f"https://127.0.0.1:{s.http}/v1" in s.output()
        conn = http.client.HTTPSConnection(
            "127.0.0.1", s.http, context=ssl.create_default_context(cafile=cert), timeout=60
        )
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(
                {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            ),
            headers={"content-type": "application/json"},
        )
        r = conn.getresponse()
        out = json.loads(r.read())
        assert r.status == 200 and len(out["choices"][0]["token_ids"]) == 3
        with pytest.raises((http.client.HTTPException, OSError)):
            plain = http.client.HTTPConnection("127.0.0.1", s.http, timeout=10)
            plain.request("GET", "/health")
            plain.getresponse().read()
    finally:
        s.stop()
