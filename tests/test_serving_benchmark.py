"""benchmarks/serving.py --smoke runs end to end on the CPU (moeserve up with dummy weights, the
front end, SDK clients in two processes, transformers) and writes every figure of the JSON; with
--apis grpc,http the same workloads also go through the HTTP API's streamed completions."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "serving.py"
sys.path.insert(0, str(SCRIPT.parent))  # the command's library, servinglib

from servinglib.figures import BURST_KEYS, ONLINE_KEYS, steady_steps  # noqa: E402
from servinglib.httpclient import SseTokens  # noqa: E402
from servinglib.prefix import HOPS, ttft_parts  # noqa: E402
from servinglib.roofline import ROOFLINE_KEYS, kv_bytes_read, roofline  # noqa: E402
from servinglib.shapes import SHAPES, model_sizes, weights_per_gpu, weights_read_per_gpu, write_model  # noqa: E402


def _bench():
    spec = importlib.util.spec_from_file_location("serving_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_smoke_run_writes_every_figure(tmp_path):
    out = tmp_path / "serving.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=230,
        env=dict(os.environ, MOESERVE_ATTENTION_PREFILL="sdpa"),
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    res = json.loads(out.read_text())
    assert {"shape", "command", "git", "gpu", "device", "model", "workload", "hbm", "configs", "elapsed_s"} <= set(res)
    assert res["shape"] == "tiny" and res["smoke"] and "--smoke" in res["command"]
    assert res["switches"]["MOESERVE_ATTENTION_PREFILL"] == "sdpa"  # set below: what the clusters inherited
    # no datasheet rate on a CPU: the measured copy rate stands in for it, and the JSON says so
    hbm = res["hbm"]
    assert hbm["datasheet_Bps"] is None and hbm["device"] == "cpu" and hbm["roof_rate"] == "measured_copy"
    assert hbm["measured_copy_Bps"] > 0
    assert "(datasheet: unknown for cpu, the measured copy rate used)" in run.stdout
    assert set(res["configs"]) == {"moeserve-1rank", "transformers"}

    ms = res["configs"]["moeserve-1rank"]
    assert ms["error"] is None, ms["error"]
    burst, online, roof = ms["burst"], ms["online"], ms["roofline"]
    assert set(BURST_KEYS) <= set(burst) and set(ONLINE_KEYS) <= set(online)
    assert set(ROOFLINE_KEYS) <= set(roof)
    assert roof["datasheet"]["rate_Bps"] == roof["measured_copy"]["rate_Bps"] == hbm["measured_copy_Bps"]
    n, new = burst["requests"], burst["output_tokens_per_request"]
    assert burst["completed"] == n and burst["output_tokens"] == n * new and not burst["errors"]
    assert burst["steady_all_running"] and burst["steady_gaps"] > 0
    # tokens a stream fell behind on reach the client in one message (gaps of 0 on a loaded CPU)
    assert 0 <= burst["steady_step_p10_s"] <= burst["steady_step_s"] <= burst["steady_step_p90_s"]
    assert burst["steady_step_s"] > 0
    assert burst["output_tok_s"] > 0 and burst["ttft_p50_s"] <= burst["ttft_p99_s"]
    assert online["completed"] == online["requests"] >= 1 and online["cancelled"] == 0 and not online["errors"]
    assert online["arrival_rate_req_s"] > 0 and online["itl_p99_over_p50"] >= 1.0
    assert online["ttft_p50_s"] > 0 and online["e2e_p99_s"] >= online["e2e_p50_s"]
    for rate in ("datasheet", "measured_copy"):
        r = roof[rate]
        assert r["step_s"] > 0 and r["step_over_roofline"] == pytest.approx(burst["steady_step_s"] / r["step_s"])
    assert roof["weight_bytes_per_gpu"] > 0 and roof["kv_bytes_per_step_per_gpu"] > 0
    assert ms["engine"]["burst_forward_steps"] >= new
    # the engine's own decode step, from the leader's step count over time, beside the clients'
    eng = ms["engine"]["engine_decode_step_s"]
    assert eng is not None and 0 < eng < 10 * burst["steady_step_s"]
    assert ms["engine"]["client_step_over_engine"] == pytest.approx(burst["steady_step_s"] / eng)

    hf = res["configs"]["transformers"]
    assert hf["error"] is None, hf.get("error_detail")
    assert hf["burst"]["output_tokens"] == n * new and hf["burst"]["steady_step_s"] > 0
    # the roofline reads every weight but an untied embedding table (a row per token is gathered)
    assert hf["roofline"]["weight_bytes_per_gpu"] == hf["run"]["read_bytes"] < hf["run"]["weight_bytes"]
    assert "moeserve-1rank" in run.stdout and "transformers" in run.stdout  # the table


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_smoke_run_through_grpc_and_http_on_one_cluster(tmp_path):
    """--apis grpc,http: the same workloads through the SDK and through /v1/completions with
    stream: true, back to back on one cluster; every token of every SSE stream is counted from
    its own chunk (none only from the usage), and the ratio is reported."""
    out = tmp_path / "serving.json"
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--smoke",
            "--configs",
            "moeserve-1rank",
            "--apis",
            "grpc,http",
            "--burst-requests",
            "4",
            "--burst-output",
            "12",
            "--requests",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["apis"] == ["grpc", "http"] and res["tokenizer"] == "words"
    ms = res["configs"]["moeserve-1rank"]
    assert ms["error"] is None, ms["error"]
    assert ms["burst"] == ms["by_api"]["grpc"]["burst"] and ms["online"] == ms["by_api"]["grpc"]["online"]
    for api in ("grpc", "http"):
        burst, online = ms["by_api"][api]["burst"], ms["by_api"][api]["online"]
        assert set(BURST_KEYS) <= set(burst) and set(ONLINE_KEYS) <= set(online)
        assert burst["api"] == api and burst["completed"] == 4 and burst["output_tokens"] == 4 * 12
        assert not burst["errors"] and burst["output_tok_s"] > 0 and burst["ttft_p50_s"] > 0
        assert online["completed"] == online["requests"] >= 1 and not online["errors"]
        # CPU times come from /proc in clock ticks (10 ms): a short smoke burst may round to 0.
        assert burst["frontend_cpu_s"] >= 0 and burst["frontend_cpu_us_per_token"] >= 0
        assert burst["client_cpu_s"] >= 0
        assert ms["by_api"][api]["engine"]["burst_forward_steps"] >= 12
        assert set(ROOFLINE_KEYS) <= set(ms["by_api"][api]["roofline"])
    http = ms["by_api"]["http"]
    assert http["burst"]["tokens_from_usage"] == 0 and http["online"]["tokens_from_usage"] == 0
    ratios = ms["http_over_grpc_output_tok_s"]
    for w in ("burst", "online"):
        assert ratios[w] == pytest.approx(http[w]["output_tok_s"] / ms["by_api"]["grpc"][w]["output_tok_s"])
    assert res["http_over_grpc_output_tok_s"] == {"moeserve-1rank": ratios}
    assert "http/grpc" in run.stdout


def test_sse_tokens_are_counted_per_chunk_and_checked_against_the_usage():

    def event(obj):
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def chunk(**choice):
        return event(
            {
                "object": "text_completion",
                "choices": [{"index": 0, "logprobs": None, "finish_reason": None, **choice}],
                "usage": None,
            }
        )

    s = SseTokens()
    stream = (
        chunk(text="t5")
        + chunk(text=" t7")
        + chunk(text="")
        + chunk(text=" t9")
        + chunk(text="", finish_reason="length")
        + event({"object": "text_completion", "choices": [], "usage": {"completion_tokens": 4}})
        + b"data: [DONE]\n\n"
    )
    got = [s.feed(stream[k : k + 7]) for k in range(0, len(stream), 7)]  # split anywhere
    assert sum(got) == 3 and s.counted == 3 and s.finish == "length" and s.done and s.error is None
    assert s.usage_tokens == 4 and s.missing() == 1  # the token the empty chunk held back

    s = SseTokens()
    assert s.feed(chunk(text="ab", token_ids=[3, 4])) == 2 and s.token_ids  # a chunk with several tokens
    assert s.feed(chunk(text="", token_ids=[5], finish_reason="stop")) == 1 and s.finish == "stop"
    assert s.feed(chunk(text="x", logprobs={"tokens": ["x"]})) == 1
    assert s.feed(event({"error": {"message": "boom"}})) == 0 and s.error == "boom"


def test_apis_flag():
    bench = _bench()
    assert (
        bench.parse(["--shape", "scout8"]).apis == ["grpc"] and bench.parse(["--shape", "scout8"]).tokenizer == "none"
    )
    a = bench.parse(["--shape", "scout8", "--apis", "grpc,http"])
    assert a.apis == ["grpc", "http"] and a.tokenizer == "words"
    for bad in (["--apis", "grpc,rest"], ["--apis", "http,http"], ["--apis", "http", "--tokenizer", "none"]):
        with pytest.raises(SystemExit):
            bench.parse(["--smoke", *bad])


def test_the_steady_window_is_where_every_stream_decodes():
    # Two streams in lockstep at 10 ms steps; the second's prompt is prefilled one step later.
    a = [0.10 + 0.01 * k for k in range(30)]
    b = [0.11 + 0.01 * k for k in range(30)]
    recs = [{"tokens": a, "prompt_len": 4}, {"tokens": b, "prompt_len": 4}]
    s = steady_steps(recs, trim=2)
    assert s["steady_all_running"] and s["steady_window_s"] == [0.11, a[-1]]
    assert s["steady_step_s"] == pytest.approx(0.01) and s["steady_step_mean_s"] == pytest.approx(0.01)
    # tokens handed out in twos (asynchronous steps): the gaps are 0 and 20 ms, the step is 10 ms
    pair = [0.10 + 0.02 * (k // 2) for k in range(60)]
    s = steady_steps([{"tokens": pair, "prompt_len": 4}], trim=2)
    assert s["steady_step_s"] == pytest.approx(0.01, rel=0.05)


def test_roofline_counts_chunked_layers_up_to_their_chunk():
    sizes = {"chunked": [True, False], "chunk": 8, "kv_layer_token": 10}
    assert kv_bytes_read(sizes, [20]) == (4 + 20) * 10  # position 20 is 4 tokens into its chunk
    windowed = {"chunked": [False, False], "chunk": None, "windows": [8, None], "kv_layer_token": 10}
    assert kv_bytes_read(windowed, [20]) == (8 + 20) * 10  # a window of 8 reads 8 keys
    r = roofline(1000, 200, 0.002, {"x": 1e6}, 1, 1, 20)
    assert r["x"]["step_s"] == pytest.approx(1.2e-3) and r["x"]["step_over_roofline"] == pytest.approx(0.002 / 1.2e-3)


def test_the_datasheet_rate_is_the_devices_own_and_an_unknown_one_is_said_so():
    from servinglib.report import table
    from servinglib.roofline import datasheet_hbm_bps, hbm_rates, rate_line

    assert datasheet_hbm_bps("NVIDIA H100 80GB HBM3") == 3.35e12  # SXM
    assert datasheet_hbm_bps("NVIDIA H100 NVL") == 3.9e12
    assert datasheet_hbm_bps("NVIDIA H100 PCIe") == 2.0e12
    assert datasheet_hbm_bps("NVIDIA H200") == datasheet_hbm_bps("NVIDIA H200 NVL") == 4.8e12
    assert datasheet_hbm_bps("NVIDIA H20") == 4.0e12  # not taken for an H200, nor an H200 for it
    assert datasheet_hbm_bps("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert datasheet_hbm_bps("NVIDIA A100-SXM4-40GB") == 1.555e12
    assert datasheet_hbm_bps("NVIDIA B200") == 8.0e12
    assert datasheet_hbm_bps("NVIDIA RTX 6000 Ada Generation") is None
    assert datasheet_hbm_bps("NVIDIA GH200 480GB") is None  # its rate depends on its memory
    assert datasheet_hbm_bps("cpu") is None

    rates, hbm = hbm_rates(["NVIDIA H100 80GB HBM3"], 3.03e12)
    assert rates == {"datasheet": 3.35e12, "measured_copy": 3.03e12} and hbm["datasheet_Bps"] == 3.35e12
    assert rate_line(hbm) == "NVIDIA H100 80GB HBM3: device-to-device copy 3.03 TB/s (datasheet 3.35)"
    result = dict(shape="tiny", gpu="NVIDIA H100 80GB HBM3", device="cuda", configs={}, hbm=hbm)
    assert "roof = datasheet 3.35 TB/s, roofc = measured copy 3.03 TB/s" in table(result)
    # two devices, one unknown: no datasheet rate for the run
    assert hbm_rates(["NVIDIA H200", "NVIDIA L40S"], 3e12)[1]["datasheet_Bps"] is None

    # an unknown device: the roof column at the measured copy rate, said so; no other GPU's figure
    rates, hbm = hbm_rates(["NVIDIA L40S"], 0.7e12)
    assert rates == {"datasheet": 0.7e12, "measured_copy": 0.7e12}
    assert hbm == dict(device="NVIDIA L40S", datasheet_Bps=None, measured_copy_Bps=0.7e12, roof_rate="measured_copy")
    line = rate_line(hbm)
    assert line == (
        "NVIDIA L40S: device-to-device copy 0.70 TB/s (datasheet: unknown for NVIDIA L40S, the measured copy rate used)"
    )
    text = table(dict(shape="tiny", gpu="NVIDIA L40S", device="cuda", configs={}, hbm=hbm))
    roof_line = next(x for x in text.splitlines() if x.startswith("roofline:"))
    assert "roof = the measured copy rate 0.70 TB/s (datasheet unknown for NVIDIA L40S)" in roof_line
    assert "4.8" not in line + roof_line


@pytest.mark.parametrize("shape", ["tiny", "scout8", "ernie28", "qwen3_30b", "gptoss20b"])
def test_the_bytes_a_gpu_holds_match_the_tensors_of_the_config(tmp_path, shape):
    """The roofline's weight bytes (router side, one expert) add up to the tensors a checkpoint
    of the shape's config.json holds (moeserve.models.dummy's table, each tensor in its stored
    dtype; no tensor is made)."""
    import torch

    from moeserve.models import DummyReader
    from moeserve.models.config import load_config
    from moeserve.models.dummy import checkpoint_shapes

    folder = write_model(str(tmp_path / shape), SHAPES[shape]["config"])
    sizes = model_sizes(folder, 2)
    cfg = load_config(folder)
    reader = DummyReader(folder)
    router = experts = 0
    for name, shape_ in checkpoint_shapes(cfg).items():
        n = 1
        for d in shape_:
            n *= d
        if ".experts." in name:
            experts += n * 2
        else:
            router += n * (4 if reader.stored_dtype(name) != cfg.dtype == torch.bfloat16 else 2)
    assert sizes["router_bytes"] == router and sizes["all_experts_bytes"] == experts
    # a decode step reads every weight held but an untied embedding table (it gathers a row per
    # token); a tied one is the LM head's product and is read whole
    table = cfg.vocab_size * cfg.hidden_size * 2
    assert sizes["lookup_bytes"] == (0 if cfg.tie_word_embeddings else table)
    assert weights_read_per_gpu(sizes, 0, 1) == weights_per_gpu(sizes, 0, 1) - sizes["lookup_bytes"]
    if shape != "gptoss20b":  # (FP8 experts with biases are refused)
        fp8 = model_sizes(folder, 2, quantization="fp8")  # the table stays unquantized, in its stored dtype
        stored = DummyReader(folder, quantization="fp8").stored_dtype("model.embed_tokens.weight")
        assert fp8["lookup_bytes"] == (0 if cfg.tie_word_embeddings else table // 2 * stored.itemsize)
    params = sizes["router_bytes"] / 2 + sizes["all_experts_bytes"] / 2
    if shape == "qwen3_30b":  # Qwen3-30B-A3B: 30.5B parameters, 128 experts top-8 in 48 MoE layers
        assert (cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == (
            48,
            2048,
            128,
            8,
            768,
        )
        assert cfg.routing.renormalize and cfg.qk_rms_norm and not cfg.rope.interleaved and 30e9 < params < 31e9
        assert cfg.attention_window == 0  # no sliding layer
    if shape == "gptoss20b":  # GPT-OSS-20B: 20.9B parameters, 32 experts top-4, window 128 every other layer
        assert (cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.head_dim) == (24, 2880, 32, 4, 64)
        assert cfg.sliding_layers == (True, False) * 12 and cfg.window(0) == 128 and cfg.rope.type == "yarn"
        assert sizes["windows"][:2] == [128, None] and 20.5e9 < params < 21.5e9
        assert cfg.attention_window == 128  # the window of its sliding layers (the prefix cache stays on)
    if shape == "scout8":
        assert not cfg.tie_word_embeddings and sizes["lookup_bytes"] == 202048 * 5120 * 2
        assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.top_k) == (8, 5120, 202048, 16, 1)
        assert cfg.use_rope == (True, True, True, False) * 2 and cfg.moe_layer_ids == tuple(range(8))
        assert cfg.rope.type == "llama3" and cfg.attention_chunk_size == 8192
    if shape == "ernie28":
        assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.top_k) == (
            28,
            2560,
            103424,
            64,
            6,
        )
        assert cfg.moe_layer_ids == tuple(range(1, 28)) and cfg.shared_intermediate_size == 3072
        assert 20e9 < sizes["router_bytes"] / 2 + sizes["all_experts_bytes"] / 2 < 22.5e9  # 21B parameters


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("step_model", [False, True], ids=["token-balance", "step-model"])
def test_smoke_eplb_workload_measures_a_rebalance_end_to_end(tmp_path, step_model):
    """--workloads eplb on the CPU: 2 co-located ranks over gloo with hot experts; the skewed burst
    before and after a rebalance through the balancer, decode bursts, and a live rebalance during
    the online load; every figure is present and sane. With a step-model table (the CPU example's
    entry) the balancer plans by predicted step time and sends break-even counts."""
    out = tmp_path / "eplb.json"
    extra = (
        [
            "--eplb-step-model",
            str(SCRIPT.parent / "results" / "step_model_cpu_example.json"),
            "--eplb-step-model-shape",
            "smoke-tiny",
        ]
        if step_model
        else []
    )
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--workloads", "eplb", "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res["configs"]) == {"moeserve-ep2"}
    c = res["configs"]["moeserve-ep2"]
    assert c["error"] is None, c["error"]
    assert c["ranks"] == 2 and c["redundant_experts"] >= 1
    hot = res["config_json"]["moeserve_dummy_hot_experts"]
    assert hot["experts"] == 2 and len(hot["ids"]) == 2
    e = c["eplb"]
    for phase in ("before", "after", "decode_before", "decode_after"):
        b = e[phase]
        assert b["completed"] == b["requests"] and b["failed"] == 0 and not b["errors"], (phase, b["errors"])
        assert b["output_tok_s"] > 0 and b["forward_steps"] > 0 and b["wall_per_step_s"] > 0
        assert 0 < b["balancedness"]["measured"] <= 1 and b["balancedness"]["steps"] > 0
    for phase in ("before", "after"):
        b = e[phase]
        assert b["prompt_tokens_total"] == b["requests"] * e["prompt"] and b["prefill_tok_s"] > 0
        assert b["prefill_steps"] > 0 and b["prefill_step_s"] > 0
    # the hot experts start on one worker: the initial placement is skewed, the rebalance fixes it
    assert e["before"]["balancedness"]["measured"] < 0.8
    assert e["after"]["balancedness"]["measured"] >= e["before"]["balancedness"]["measured"] + 0.1
    r = e["rebalance"]
    assert r["applied"] and r["slots_moved"] > 0 and r["bytes_moved"] > 0 and r["wall_s"] > 0 and r["bytes_per_s"] > 0
    assert r["migration_state"] == "done" and r["predicted_balancedness_after"] > r["predicted_balancedness_before"]
    assert r["phy2log"] != e["initial_phy2log"]
    assert r["breakeven_sent"] == step_model and (r["predicted_step_s_before"] is not None) == step_model
    i = e["ideal"]
    assert i["moe_time_ideal_over_measured_before"] == e["before"]["balancedness"]["measured"]
    assert i["moe_speedup_predicted"] > 1 and i["prefill_step_speedup_measured"] > 0
    assert e["decode_cost"]["step_after_over_before"] > 0
    assert e["restore"]["moves"] > 0
    lv = e["live"]
    assert lv["applied"] and lv["slots_moved"] > 0 and lv["migration_state"] == "done" and lv["error"] is None
    assert 0 <= lv["start_s"] <= lv["end_s"] and lv["wall_s"] > 0
    assert lv["failed"] == 0 and lv["completed"] == lv["requests"] >= 1 and not lv["errors"]
    assert lv["itl_during_n"] > 0 and lv["itl_steady_n"] > 0 and lv["itl_p99_during_over_steady"] > 0
    assert set(lv["targets"]) == {"rebalance_within_30s", "itl_p99_during_within_1_1x_steady", "no_request_failed"}
    assert lv["targets"]["rebalance_within_30s"] and lv["targets"]["no_request_failed"]
    assert e["failed_requests"] == 0
    assert "EPLB end to end" in run.stdout and "(f) live rebalance" in run.stdout  # the table


class _Status:
    def __init__(self, seq):
        self.seq, self.calls = list(seq), 0

    def status(self):
        running, steps = self.seq[min(self.calls, len(self.seq) - 1)]
        self.calls += 1
        return type("S", (), dict(running=running, forward_steps=steps))()


def test_the_live_rebalance_waits_for_two_steps_with_a_sequence_running():
    """The live rebalance starts once streams decode: two forward steps while a sequence runs
    (a step count kept from before the sequences ran does not count); with none running it
    gives up at its deadline."""
    import time

    from servinglib.eplb import wait_for_decoding

    s = _Status([(0, 10), (0, 14), (1, 15), (1, 16), (0, 16), (2, 17), (2, 18), (2, 19), (2, 30)])
    wait_for_decoding(s, time.monotonic() + 10, period=0)
    assert s.calls == 8  # restarted its count when nothing ran at (0, 16); done at 19 = 17 + 2
    idle = _Status([(0, 1)])
    t = time.monotonic()
    waited = wait_for_decoding(idle, t + 0.2, period=0.01)
    assert 0.2 <= waited < 2 and idle.calls > 3


def test_the_engines_decode_step_is_timed_over_the_bursts_last_steps():
    """decode_step_s: the time between the leader reaching steps end - (output - 1) + trim and
    end - trim, per step, from the poller's samples (the first sample of each count)."""
    from servinglib.steps import StepPoller, decode_step_s

    p = StepPoller.__new__(StepPoller)  # no thread: samples given
    # 5 prefill steps over 1 s, then 100 decode steps at 10 ms; a count sampled twice
    p.samples = [(0.0, 0), (1.0, 5), (1.0 + 0.01 * 50, 55), (1.6, 55), (1.0 + 0.01 * 100, 105)]
    assert p.time_at(30) == pytest.approx(1.25)  # 55 first reached at 1.5, not 1.6
    assert decode_step_s(p, 105, 101, 10) == pytest.approx(0.01)
    assert decode_step_s(p, 105, 200, 10) is None  # reaches back before the samples
    assert decode_step_s(p, 105, 12, 5) is None  # too few steps left


def test_eplb_flags():
    bench = _bench()
    a = bench.parse(["--shape", "scout8", "--configs", "moeserve-ep2", "--workloads", "eplb"])
    assert a.eplb_prompt == 2048 and a.eplb_output == 32 and a.max_num_batched_tokens == 8192
    assert a.max_model_len >= 2048 + 32
    assert a.hot_experts_cfg == {"experts": 2, "share": 0.8, "ids": [2, 3]}  # one copy each, both on worker 0
    assert bench.parse(["--smoke", "--workloads", "eplb"]).configs == ["moeserve-ep2"]
    for bad in (
        ["--workloads", "eplb,burst"],
        ["--workloads", "eplb", "--configs", "moeserve-1rank"],
        ["--workloads", "eplb", "--hot-experts", "x"],
        ["--workloads", "eplb", "--redundant-experts", "0"],
        ["--workloads", "eplb", "--apis", "grpc,http"],
        ["--workloads", "eplb", "--dummy-routing", "spread"],
    ):
        with pytest.raises(SystemExit):
            bench.parse(["--smoke", *bad])


def test_dummy_routing_flag():
    bench = _bench()
    # the shapes whose plain dummy routing collapses get spread routing unless told otherwise
    assert bench.parse(["--shape", "ernie28"]).dummy_routing == "spread"
    assert bench.parse(["--shape", "dsv3_7"]).dummy_routing == "spread"
    assert bench.parse(["--shape", "scout8"]).dummy_routing == "default"
    assert bench.parse(["--shape", "ernie28", "--dummy-routing", "default"]).dummy_routing == "default"
    assert bench.parse(["--shape", "scout8", "--dummy-routing", "spread"]).dummy_routing == "spread"
    assert bench.parse(["--shape", "ernie28", "--configs", "moeserve-ep2", "--workloads", "eplb"]).dummy_routing == (
        "default"
    )
    with pytest.raises(SystemExit):
        bench.parse(["--shape", "scout8", "--dummy-routing", "even"])


def test_the_flop_aware_roofline_takes_each_class_at_its_bound():
    """Per class max(bytes / rate, FLOPs / peak), summed: a dense class bound by its products
    costs its FLOPs' time, the experts their bytes', beside the bytes-only figure; attention
    counts the keys each layer reads (a window's at most)."""
    from servinglib.roofline import roofline, step_classes

    sizes = dict(
        router_bytes=1e9,
        dense_params=4e9,
        top_k=1,
        num_moe_layers=2,
        expert_params=1e8,
        chunked=[False, False],
        chunk=None,
        attn_flops_per_key=4 * 1024,
    )
    classes = step_classes(sizes, weight_bytes=9e9, kv_bytes=1e9, tokens=100, contexts=[1000] * 100)
    assert classes["dense"] == (1e9, 2 * 100 * 4e9) and classes["experts"] == (8e9, 2 * 100 * 2 * 1e8)
    assert classes["attention"] == (1e9, 100 * 2 * 1000 * 4 * 1024)
    windowed = step_classes({**sizes, "windows": [128, None]}, 9e9, 1e9, 100, [1000] * 100)
    assert windowed["attention"][1] == 100 * (128 + 1000) * 4 * 1024  # a sliding layer reads its window
    r = roofline(9e9, 1e9, 0.010, {"copy": 1e12}, 1, 100, 1000, classes, 1e14)
    per = r["flop_aware"]["copy"]["per_class_s"]
    assert per["dense"] == pytest.approx(8e11 / 1e14) and per["experts"] == pytest.approx(8e9 / 1e12)
    assert r["flop_aware"]["copy"]["step_s"] == pytest.approx(sum(per.values()))
    assert r["copy"]["step_s"] == pytest.approx(1e10 / 1e12)  # bytes only, unchanged


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_prefix_workloads_measure_prefix_caching_side_by_side(tmp_path):
    """``--workloads prefix,multiturn`` on the CPU: moeserve-1rank with and without prefix caching,
    each workload's TTFT, tok/s and the prompt tokens its requests read from the cache."""
    out = tmp_path / "serving.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--workloads", "prefix,multiturn", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=290,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res["configs"]) == {"moeserve-1rank", "moeserve-1rank-no-prefix-cache"}
    on, off = res["configs"]["moeserve-1rank"], res["configs"]["moeserve-1rank-no-prefix-cache"]
    for c in (on, off):
        assert c["error"] is None, c["error"]
        for key in ("prefix", "multiturn"):
            f = c[key]
            assert f["completed"] == f["requests"] and not f["errors"] and f["ttft_p50_s"] > 0
        assert c["multiturn"]["requests"] == 4 * 3 and c["multiturn"]["conversations_completed"] == 4
    # 12 requests share a 64-token system prompt (4 blocks of 16): all but the first find it cached
    # unless they arrive while it is computed; an uncached server reads nothing from the cache
    p = on["prefix"]
    assert p["cached_prompt_tokens"] >= 64 and p["cached_prompt_tokens"] % 16 == 0
    assert p["engine"]["prefix_cache_hits"] == p["cached_prompt_tokens"]
    assert on["multiturn"]["later_turns"]["hit_rate"] > 0.5 and on["multiturn"]["first_turns"]["hit_rate"] == 0
    assert off["prefix"]["cached_prompt_tokens"] == 0 == off["multiturn"]["cached_prompt_tokens"]
    assert off["prefix"]["computed_prompt_tokens"] == 12 * (64 + 8)
    for c in (on, off):  # where each request's TTFT went, by clock: client >= front end >= leader
        for key in ("prefix", "multiturn"):
            t = c[key]["ttft_parts_mean_s"]
            assert t["queue_requests"] == t["front_end_requests"]  # the means cover the same requests
            assert t["front_end"] >= t["queue"] + t["prefill"] and t["prefill"] > 0
            # the client's mean covers the workload's requests only, the front end's its warm-ups
            # too (whose first tokens may come later): compared only where the sets are the same
            if t["front_end_requests"] == c[key]["requests"]:
                assert t["client"] >= t["front_end"]
            # and split at every hop: each part of every request the front end counted (the
            # workload's and the clients' warm-ups), none negative, adding up to its TTFT
            hops = t["hops"]
            parts = [hops[p] for p in HOPS]
            assert hops["requests"] == t["front_end_requests"] >= c[key]["requests"]
            assert all(v >= 0 for v in parts) and sum(parts) == pytest.approx(t["front_end"], abs=1e-3)
            assert (hops["queue"], hops["prefill"]) == pytest.approx((t["queue"], t["prefill"]))
    sbs = res["prefix_caching"]["moeserve-1rank"]
    assert set(sbs) == {"prefix", "multiturn"} and sbs["prefix"]["ttft_p50_uncached_over_cached"] > 0
    for key, n in (("prefix", 12), ("multiturn", 12)):  # fp32 on the CPU: the same tokens either way
        assert sbs[key]["compared_requests"] == n and sbs[key]["identical_outputs_share"] == 1.0
    assert "prefix caching: TTFT" in run.stdout and "moeserve-1rank-no-prefix-cache" in run.stdout  # the table


def test_ttft_parts_are_the_means_over_a_run_of_the_front_ends_histograms():
    before = {"ttft": (1.0, 10.0), "queue": (0.1, 10.0), "prefill": (0.5, 10.0)}
    before.update({f"part:{p}": (0.1, 10.0) for p in HOPS})
    after = {"ttft": (1.8, 14.0), "queue": (0.2, 14.0), "prefill": (0.9, 14.0)}
    after.update({f"part:{p}": (0.2, 14.0) for p in HOPS})
    t = ttft_parts(0.25, before, after)
    assert t["client"] == 0.25 and t["front_end_requests"] == 4
    assert (t["front_end"], t["queue"], t["prefill"]) == pytest.approx((0.2, 0.025, 0.1))
    assert t["hops"] == {**{p: pytest.approx(0.025) for p in HOPS}, "requests": 4}
    assert ttft_parts(0.25, {}, {})["hops"] is None  # a front end without metrics
    # a front end that records no parts (an older one), or not all of them: no split
    assert ttft_parts(0.25, {}, {k: v for k, v in after.items() if not k.startswith("part:")})["hops"] is None
    assert ttft_parts(0.25, {}, {k: v for k, v in after.items() if k != "part:queue"})["hops"] is None


def test_prefix_workload_flags():
    bench = _bench()
    a = bench.parse(["--shape", "scout8", "--workloads", "prefix,multiturn"])
    assert a.configs == ["moeserve-1rank", "moeserve-1rank-no-prefix-cache"]
    assert (a.prefix_requests, a.prefix_system, a.prefix_unique, a.prefix_output) == (256, 2048, 64, 128)
    assert (a.multiturn_conversations, a.multiturn_turns, a.multiturn_new, a.multiturn_output) == (64, 8, 64, 128)
    assert a.max_model_len >= 8 * (64 + 128)
    assert bench.parse(["--smoke", "--workloads", "burst,prefix"]).configs == ["moeserve-1rank", "transformers"]
    for bad in (
        ["--workloads", "prefix", "--configs", "moeserve-1rank,transformers"],
        ["--workloads", "online,prefix"],
        ["--workloads", "prefix", "--max-model-len", "64"],
    ):
        with pytest.raises(SystemExit):
            bench.parse(["--smoke", *bad])


def test_late_schedules_between_two_status_reads():
    _bench()  # puts servinglib on the path
    from servinglib.common import pacing

    s0 = dict(late_schedules=10.0, late_schedule_delay_s=0.05, late_schedule_bubbles=1.0, late_schedule_ahead_s=0.03)
    s1 = dict(
        late_schedules=30.0,
        late_schedule_delay_s=0.09,
        late_schedule_bubbles=4.0,
        late_schedule_ahead_s=0.09,
        late_schedule_slack_s=0.02,
    )
    got = pacing(s0, s1)
    assert got["late_schedules"] == 20 and got["late_schedule_bubbles"] == 3
    assert got["late_schedule_mean_delay_s"] == pytest.approx(0.002)
    assert got["late_schedule_mean_ahead_s"] == pytest.approx(0.003)
    assert got["late_schedule_mean_slack_s"] == pytest.approx(0.001)  # from 0 in s0
    assert pacing(s0, s0)["late_schedule_mean_delay_s"] is None
    assert pacing({}, {"forward_steps": 3}) == {}  # a leader without metrics: nothing made up


def test_the_late_scheduling_margin_reaches_the_configurations_that_schedule_late():
    bench = _bench()
    from servinglib.cluster import configuration_flags

    a = bench.parse(["--shape", "scout8", "--late-scheduling-margin-ms", "0.5"])
    late, _ = configuration_flags("moeserve-1rank-fp8", a, False)
    assert late[late.index("--late-scheduling-margin-ms") + 1] == "0.5"
    off, _ = configuration_flags("moeserve-1rank-no-late-schedule-fp8", a, False)
    assert "--no-late-scheduling" in off and "--late-scheduling-margin-ms" not in off
    plain, _ = configuration_flags("moeserve-1rank", bench.parse(["--shape", "scout8"]), False)
    assert "--late-scheduling-margin-ms" not in plain and "--no-late-scheduling" not in plain


def test_the_api_server_count_reaches_every_moeserve_configuration(capsys):
    bench = _bench()
    from servinglib.cluster import configuration_flags

    a = bench.parse(["--shape", "scout8", "--api-server-count", "4"])
    for name in ("moeserve-1rank", "moeserve-1rank-fp8", "moeserve-1rank-no-prefix-cache"):
        flags, _ = configuration_flags(name, a, False)
        assert flags[flags.index("--api-server-count") + 1] == "4"
    one, _ = configuration_flags("moeserve-1rank", bench.parse(["--shape", "scout8"]), False)
    assert "--api-server-count" not in one  # up's default
    with pytest.raises(SystemExit) as e:
        bench.parse(["--shape", "scout8", "--api-server-count", "0"])
    assert e.value.code == 2 and "--api-server-count must be 1 .. 64, got 0" in capsys.readouterr().err


def test_the_commit_of_a_copied_tree_comes_from_the_environment(monkeypatch):
    """A tree copied to a GPU machine by ``git archive`` inside another checkout records the
    commit it was made from (MOESERVE_GIT_COMMIT), not the surrounding checkout's HEAD."""
    from servinglib.common import git_commit

    monkeypatch.setenv("MOESERVE_GIT_COMMIT", "abc1234")
    assert git_commit() == {"commit": "abc1234", "dirty": None}  # git is not asked


def test_a_result_records_the_switches_its_clusters_inherit():
    """``switches``: every MOESERVE_* setting of the environment but the commit's, so that a
    JSON measured with MOESERVE_ATTENTION_PREFILL=sdpa says so."""
    from servinglib.common import switches

    env = {"MOESERVE_ATTENTION_PREFILL": "sdpa", "MOESERVE_GIT_COMMIT": "abc1234", "PATH": "/bin", "XMOESERVE_A": "1"}
    assert switches(env) == {"MOESERVE_ATTENTION_PREFILL": "sdpa"}
    assert switches({}) == {}


def test_the_latency_scrape_waits_until_ttft_queue_and_prefill_count_the_same_requests():
    """A scrape that fell between a first token's queue/prefill observation and its TTFT's is
    taken again, so that a window's means cover the same requests."""
    from servinglib.prefix import settled_latency

    class Up:
        def __init__(self, scrapes):
            self.scrapes = scrapes

        def frontend_latency(self):
            return self.scrapes.pop(0)

    torn = {"ttft": (1.0, 4.0), "queue": (0.3, 5.0), "prefill": (0.5, 5.0)}
    whole = {"ttft": (1.3, 5.0), "queue": (0.3, 5.0), "prefill": (0.5, 5.0)}
    up = Up([torn, torn, whole, torn])
    assert settled_latency(up, wait_s=0) is whole and len(up.scrapes) == 1
    assert settled_latency(Up([{}]), wait_s=0) == {}  # a front end without metrics
    assert settled_latency(Up([torn, torn]), tries=1, wait_s=0) is torn  # gives up after its tries
