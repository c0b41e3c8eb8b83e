"""The moeserve command line: entry point, version, and usage errors."""

import subprocess
import sys

import pytest

import moeserve
from moeserve.cli import main


@pytest.mark.slow
def test_version_is_printed_by_the_console_entry_point():
    out = subprocess.run([sys.executable, "-m", "moeserve", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout.strip() == f"moeserve {moeserve.__version__}"


def test_no_subcommand_is_a_usage_error(capsys):
    assert main([]) == 2
    assert "usage: moeserve" in capsys.readouterr().err
