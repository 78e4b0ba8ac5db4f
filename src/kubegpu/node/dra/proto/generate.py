"""Regenerate the committed gRPC stubs from the ``.proto`` files beside this script.

The stubs are committed so the node daemon needs no build step; this script (and the
test that compares its output with the committed files) keeps them from going stale.
Run: ``python -m kubegpu.node.dra.proto.generate`` (or with ``--check`` to only compare).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
# Generate relative to ``src`` so the stubs import each other as ``kubegpu.node.dra.proto.*``.
SRC_ROOT = PROTO_DIR.parents[3]
PROTOS = ("dra_v1.proto", "dra_v1beta1.proto", "pluginregistration.proto", "dra_health.proto")
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def generated_names() -> list[str]:
    return [Path(p).stem + s for p in PROTOS for s in SUFFIXES]


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) and return the generated files inside ``out_dir``."""
    import grpc_tools  # type: ignore[import-untyped]
    from grpc_tools import protoc  # type: ignore[import-untyped]  # dev dependency, only to generate

    include = Path(grpc_tools.__file__).parent / "_proto"
    rel = PROTO_DIR.relative_to(SRC_ROOT)
    args = [
        "grpc_tools.protoc",
        f"-I{SRC_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(rel / p) for p in PROTOS),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return [out_dir / rel / name for name in generated_names()]


def stale_files() -> list[str]:
    """Names of committed stubs that differ from a fresh generation (empty when up to date)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        return [f.name for f in fresh
                if not (PROTO_DIR / f.name).exists() or (PROTO_DIR / f.name).read_bytes() != f.read_bytes()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale stubs (exit 1 if any)")
    ns = parser.parse_args(argv)
    if ns.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: {name}")
        return 1 if stale else 0
    with tempfile.TemporaryDirectory() as tmp:
        for f in generate(Path(tmp)):
            shutil.copyfile(f, PROTO_DIR / f.name)
            print(f"wrote {PROTO_DIR / f.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
