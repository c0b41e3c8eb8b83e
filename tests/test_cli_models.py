"""moeserve init-model and moeserve generate (docs/models.md), and clear usage errors."""

import subprocess
import sys

import pytest
import torch

from moeserve.cli import main
from moeserve.models import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    assert main(["init-model", str(path), "--family", "ernie45", "--seed", "3"]) == 0
    return path


def _lines(capsys):
    return dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines())


@pytest.mark.slow
def test_the_readme_main_job_runs_from_the_console_script(tmp_path):
    exe = [sys.executable, "-m", "moeserve"]
    out = subprocess.run(
        exe + ["init-model", str(tmp_path / "m"), "--family", "llama4"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        exe + ["generate", "--model", str(tmp_path / "m"), "--prompt-ids", "1,2,3", "--max-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "generated ids: " in out.stdout and "generated text: " in out.stdout


def test_generate_prints_the_tokens_of_the_reference_model(tiny, capsys):
    assert main(["generate", "--model", str(tiny), "--prompt-ids", "1,2,3", "--max-tokens", "8", "--ignore-eos"]) == 0
    out = _lines(capsys)
    expected = load_model(tiny).generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, ignore_eos=True)[0, 3:]
    assert out["prompt ids"] == "1,2,3"
    assert out["generated ids"] == ",".join(map(str, expected.tolist()))


def test_generate_from_text_uses_the_folders_tokenizer(tiny, capsys):
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny),
                "--prompt",
                "Hello world",
                "--max-tokens",
                "4",
                "--temperature",
                "0.7",
                "--seed",
                "1",
                "--ignore-eos",
            ]
        )
        == 0
    )
    out = _lines(capsys)
    assert out["prompt ids"].startswith("1,") and len(out["generated ids"].split(",")) == 4
    assert "generated text" in out


def test_sampled_generation_is_reproducible_with_a_seed(tiny, capsys):
    args = [
        "generate",
        "--model",
        str(tiny),
        "--prompt-ids",
        "5,6",
        "--max-tokens",
        "6",
        "--temperature",
        "1",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "11",
        "--ignore-eos",
    ]
    main(args)
    first = _lines(capsys)["generated ids"]
    main(args)
    assert _lines(capsys)["generated ids"] == first


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-ids", "1,,2"], "--prompt-ids must be comma-separated token ids such as 1,2,3, found '1,,2'"),
        (["--prompt-ids", "1,-2"], "--prompt-ids must be token ids >= 0"),
        (["--prompt-ids", "1,512"], "prompt token id 512 out of range 0..511"),
        (["--prompt-ids", "1", "--top-p", "2"], r"top_p must be in \(0, 1\]"),
        (["--prompt-ids", "1", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    ],
)
def test_bad_generate_input_is_a_usage_error(tiny, capsys, args, message):
    assert main(["generate", "--model", str(tiny)] + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeserve generate: error: ")
    assert __import__("re").search(message, err), err


def test_missing_model_folder_or_config_is_a_usage_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert f"{tmp_path}/config.json: no config.json in the folder" in capsys.readouterr().err


def test_prompt_text_without_a_tokenizer_is_a_usage_error(tmp_path, tiny, capsys):
    import shutil

    d = tmp_path / "no_tok"
    shutil.copytree(tiny, d)
    (d / "tokenizer.json").unlink()
    assert main(["generate", "--model", str(d), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"--prompt needs {d}/tokenizer.json, which does not exist; use --prompt-ids" in err


def test_init_model_refuses_a_folder_with_other_files_and_rewrites_its_own(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["init-model", str(tmp_path), "--family", "llama4"]) == 2
    assert "holds files init-model did not write (notes.txt)" in capsys.readouterr().err
    d = tmp_path / "m"
    assert main(["init-model", str(d), "--family", "llama4", "--hot-experts", "2", "--num-layers", "2"]) == 0
    assert "2 layers" in capsys.readouterr().out
    assert main(["init-model", str(d), "--family", "llama4", "--hot-experts", "99"]) == 2
    assert "hot_experts must be an integer in 0..8" in capsys.readouterr().err
