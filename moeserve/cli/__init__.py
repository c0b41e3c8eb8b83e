"""The ``moeserve`` command line.

Each subcommand lives in its own module of this package and exposes ``register(subparsers)``,
which adds its parser and sets ``func`` (called with the parsed namespace, returning an exit
code). Bad input raises :class:`UsageError`: the message goes to stderr and the exit code is 2,
as for argparse's own errors.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moeserve.version import __version__

# Modules under moeserve.cli that provide subcommands, in the order ``--help`` lists them.
SUBCOMMAND_MODULES: tuple[str, ...] = ("demo", "init_model", "generate", "serve", "up", "services", "ops", "health")


class UsageError(Exception):
    """Bad command-line input: printed as ``moeserve <cmd>: error: <message>``, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeserve",
        description="Expert-parallel Mixture-of-Experts serving with online EPLB.",
    )
    parser.add_argument("--version", action="version", version=f"moeserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"moeserve.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"moeserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
