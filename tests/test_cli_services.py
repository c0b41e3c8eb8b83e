"""The service subcommands' flags: vLLM's names, aliases, and bad flags exit 2 with a message."""

import pytest

from moeserve.cli import flags as F
from moeserve.cli import main


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from moeserve.models import init_model

    return str(init_model(tmp_path_factory.mktemp("m"), "llama4", seed=1))


def parse(*argv):
    return F.cluster_kwargs(__import__("moeserve.cli", fromlist=["build_parser"]).build_parser().parse_args(list(argv)))


def test_eplb_config_and_the_single_flag_aliases_agree(model):
    kw = parse(
        "up",
        "--model",
        model,
        "--enable-eplb",
        "--eplb-config",
        '{"window_size": 10, "step_interval": 20, "num_redundant_experts": 2, "log_balancedness": true}',
    )
    assert (kw["window_size"], kw["step_interval"], kw["num_redundant_experts"], kw["log_balancedness"]) == (
        10,
        20,
        2,
        True,
    )
    kw = parse(
        "up",
        "--model",
        model,
        "--enable-eplb",
        "--num-redundant-experts",
        "2",
        "--eplb-window-size",
        "10",
        "--eplb-step-interval",
        "20",
        "--eplb-log-balancedness",
    )
    assert (kw["window_size"], kw["step_interval"], kw["num_redundant_experts"], kw["log_balancedness"]) == (
        10,
        20,
        2,
        True,
    )


def test_the_exchange_flag_reaches_the_cluster_config(model):
    assert parse("up", "--model", model)["exchange"] == "auto"
    assert parse("up", "--model", model, "--exchange", "collective")["exchange"] == "collective"
    kw = parse("up", "--model", model, "--backend", "nccl", "--exchange", "nvlink")
    from moeserve.config import ClusterConfig

    cfg = ClusterConfig(
        model_dir=model, routers=kw["routers"], workers=kw["workers"], backend=kw["backend"], exchange=kw["exchange"]
    )
    assert cfg.exchange == "nvlink"


def test_async_scheduling_is_on_by_default_and_the_no_flag_turns_it_off(model):
    from moeserve.cluster import LocalCluster

    assert parse("up", "--model", model)["async_scheduling"] is True
    c = LocalCluster(model, **{k: v for k, v in parse("up", "--model", model, "--no-async-scheduling").items()})
    assert c.config.async_scheduling is False  # the flag reaches every rank's ClusterConfig


def test_late_scheduling_is_on_by_default_and_its_flags_reach_the_ranks_config(model):
    from moeserve.cluster import LocalCluster

    kw = parse("up", "--model", model)
    assert kw["late_scheduling"] is True and kw["late_scheduling_margin_ms"] == 1.0
    argv = ("up", "--model", model, "--no-late-scheduling", "--late-scheduling-margin-ms", "2.5")
    c = LocalCluster(model, **parse(*argv))
    assert c.config.late_scheduling is False and c.config.late_scheduling_margin_ms == 2.5


@pytest.mark.parametrize(
    "argv,message",
    [
        (["up", "--model", "/no/such/dir"], "no such folder"),
        (["up", "--model", "{m}", "--eplb-config", "{{nope"], "not valid JSON"),
        (["up", "--model", "{m}", "--eplb-config", '{{"window": 3}}'], "unknown keys ['window']"),
        (["up", "--model", "{m}", "--eplb-config", '{{"window_size": "big"}}'], "must be an integer"),
        (
            [
                "up",
                "--model",
                "{m}",
                "--enable-eplb",
                "--eplb-config",
                '{{"window_size": 3}}',
                "--eplb-window-size",
                "4",
            ],
            "disagrees",
        ),
        (["up", "--model", "{m}", "--num-redundant-experts", "2"], "enable_eplb"),
        (["up", "--model", "{m}", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["up", "--model", "{m}", "--port", "5", "--admin-port", "5"], "must differ"),
        (["up", "--model", "{m}", "--tls-cert", "c.pem"], "both --tls-cert and --tls-key"),
        (["up", "--model", "{m}", "--eplb-min-balancedness", "2"], "min_balancedness must be in [0, 1]"),
        (["router", "--model", "{m}", "--rank", "0", "--world-size", "3"], "--world-size 3 does not match"),
        (["worker", "--model", "{m}", "--workers", "1", "--rank", "0", "--world-size", "2"], "use 'moeserve router'"),
        (["router", "--model", "{m}", "--rank", "0", "--world-size", "2", "--admin-port", "0"], "needs a token"),
        (["balancer", "--admin-address", "nohost"], "HOST:PORT"),
        (["status", "--address", "nohost"], "host:port"),
        (["up", "--model", "{m}", "--exchange", "nvlink"], "--exchange nvlink needs --backend nccl"),
        (["up", "--model", "{m}", "--late-scheduling-margin-ms", "-1"], "must be in [0, 100] milliseconds, got -1"),
        (["up", "--model", "{m}", "--late-scheduling-margin-ms", "101"], "must be in [0, 100] milliseconds, got 101"),
    ],
)
def test_bad_flags_exit_2_with_a_message(model, argv, message, capsys, monkeypatch):
    monkeypatch.delenv("MOESERVE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("MOESERVE_CONTROL_KEY", raising=False)
    assert main([a.format(m=model) for a in argv]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_port_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["up", "--model", ".", "--port", "99999"])
    assert e.value.code == 2
    assert "0..65535" in capsys.readouterr().err
