"""Regenerate the committed gRPC stubs from ``.proto`` files: the device plugin's here, DRA's in
``kubegpu.node.dra.proto`` (each package names its protos through :class:`StubSet`).

Two kinds of service stubs come from each file: ``*_grpc.py`` for grpclib, which the node daemon
serves and calls with (:mod:`kubegpu.node.rpc`), and ``*_pb2_grpc.py`` for grpcio, which the
stand-in kubelets and the tests use, as a kubelet's own gRPC stack would.

The stubs are committed so the node daemon needs no build step; this script (and the
tests that compare its output with the committed files) keeps them from going stale.
Run: ``python -m kubegpu.node.proto.generate`` (or with ``--check`` to only compare).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi", "_grpc.py")


@dataclass(frozen=True)
class StubSet:
    """The ``.proto`` files of one package and where its stubs live. Stubs are generated relative to
    ``src`` so they import each other by their package path (``kubegpu.node.proto.*``)."""

    proto_dir: Path
    src_root: Path
    protos: tuple[str, ...]

    def generated_names(self) -> list[str]:
        return [Path(p).stem + s for p in self.protos for s in SUFFIXES]

    def generate(self, out_dir: Path) -> list[Path]:
        """Run protoc (from grpcio-tools) and return the generated files inside ``out_dir``."""
        import grpc_tools  # type: ignore[import-untyped]
        from grpc_tools import protoc  # type: ignore[import-untyped]  # dev dependency, only to generate

        include = Path(grpc_tools.__file__).parent / "_proto"
        # grpclib installs its protoc plugin as a script beside the interpreter (or on PATH).
        plugin = Path(sys.executable).parent / "protoc-gen-grpclib_python"
        if not plugin.exists():
            plugin = Path(shutil.which("protoc-gen-grpclib_python") or plugin)
        rel = self.proto_dir.relative_to(self.src_root)
        args = [
            "grpc_tools.protoc",
            f"-I{self.src_root}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            f"--plugin=protoc-gen-grpclib_python={plugin}",
            f"--grpclib_python_out={out_dir}",
            *(str(rel / p) for p in self.protos),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        return [out_dir / rel / name for name in self.generated_names()]

    def stale_files(self) -> list[str]:
        """Names of committed stubs that differ from a fresh generation (empty when up to date)."""
        with tempfile.TemporaryDirectory() as tmp:
            fresh = self.generate(Path(tmp))
            return [f.name for f in fresh if not (self.proto_dir / f.name).exists()
                    or (self.proto_dir / f.name).read_bytes() != f.read_bytes()]

    def main(self, argv: Sequence[str] | None = None, doc: str | None = None) -> int:
        parser = argparse.ArgumentParser(description=doc)
        parser.add_argument("--check", action="store_true", help="only report stale stubs (exit 1 if any)")
        ns = parser.parse_args(argv)
        if ns.check:
            stale = self.stale_files()
            for name in stale:
                print(f"stale: {name}")
            return 1 if stale else 0
        with tempfile.TemporaryDirectory() as tmp:
            for f in self.generate(Path(tmp)):
                shutil.copyfile(f, self.proto_dir / f.name)
                print(f"wrote {self.proto_dir / f.name}")
        return 0


PROTO_DIR = Path(__file__).resolve().parent
STUBS = StubSet(PROTO_DIR, PROTO_DIR.parents[2], ("deviceplugin.proto", "podresources.proto"))
stale_files = STUBS.stale_files


if __name__ == "__main__":
    sys.exit(STUBS.main(doc=__doc__))
