"""Regenerate the Python gRPC code of ``proto/moeserve/v1/*.proto`` into ``moeserve/rpc/``.

    python -m moeserve.rpc.generate            # rewrite moeserve/rpc/*_pb2*.py(i)
    python -m moeserve.rpc.generate --out DIR  # write them elsewhere (the drift test does)

Needs grpcio-tools (the ``test`` extra), pinned there so that the output is reproducible.
protoc names modules after their proto path (``moeserve.v1.admin_pb2``); they live in
``moeserve.rpc`` instead, so the imports between them are rewritten.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
PROTOS = ("common", "serving", "admin", "balancer")
HERE = Path(__file__).resolve().parent


def generate(out: Path) -> list[Path]:
    """Write ``<name>_pb2.py``, ``<name>_pb2.pyi`` and ``<name>_pb2_grpc.py`` into ``out``."""
    from grpc_tools import protoc

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        files = [f"moeserve/v1/{name}.proto" for name in PROTOS]
        include = Path(protoc.__file__).parent / "_proto"
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_DIR}",
                f"-I{include}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                *files,
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        for src in sorted((Path(tmp) / "moeserve" / "v1").iterdir()):
            if src.suffix not in (".py", ".pyi"):
                continue
            text = re.sub(r"^from moeserve\.v1 import", "from moeserve.rpc import", src.read_text(), flags=re.M)
            dst = out / src.name
            dst.write_text(text)
            written.append(dst)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moeserve.rpc.generate", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE, help="output folder (default: moeserve/rpc)")
    args = p.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
