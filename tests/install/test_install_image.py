"""The image's inputs: a pinned base, the constraints file, a non-root user, and runtime code that needs
neither the plotting nor the demo/stand-in extras (the Dockerfile removes them; this proves the roles start
without them), nor grpcio: the node daemon speaks gRPC through grpclib, and only the stand-in kubelets use grpcio."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        extras = ('matplotlib', 'scipy', 'jsonpatch', 'grpc', 'kubegpu_standins')
        if name.split('.')[0] in extras or name.startswith('kubegpu.demo'):
            raise ImportError(f'{name} is not in the runtime image')
        return None
sys.meta_path.insert(0, Block())
"""


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_dockerfile_pins_the_base_uses_constraints_and_runs_unprivileged() -> None:
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+|python@sha256:[0-9a-f]{64}", base[1])
    assert "-c constraints.txt" in text
    assert re.search(r"^USER 65532", text, re.M)
    assert "rm -rf \"$site/kubegpu_standins\" \"$site/kubegpu/demo\"" in text
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert ignore[0] == "*" and "!src/" in ignore and "!constraints.txt" in ignore  # tests, .git, .venv stay out


def test_constraints_pin_every_dependency_and_the_runtime_has_no_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, line
            pins[name.lower().replace("_", "-")] = version
    runtime = [_requirement_name(r) for r in project["dependencies"]]
    extras = project["optional-dependencies"]
    for name in runtime + [_requirement_name(r) for r in extras["sim"] + extras["demo"]]:
        assert name in pins, name
    assert not {"matplotlib", "scipy", "jsonpatch", "grpcio"} & set(runtime)
    assert extras["sim"] == ["matplotlib>=3.8", "scipy>=1.11"]
    assert extras["demo"] == ["jsonpatch>=1.33", "cel-python>=0.5", "grpcio>=1.60"]
    assert "kubegpu[sim,demo]" in extras["dev"]


@pytest.mark.parametrize("argv", [["node", "--help"], ["scheduler", "--help"], ["webhook", "--help"],
                                  ["manifests"], ["check", "--help"], ["demo"]])
def test_every_role_starts_without_the_extras(argv: list[str]) -> None:
    code = BLOCKER + f"sys.argv = ['kubegpu', *{argv!r}]\nfrom kubegpu.cli.main import app\napp()\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if argv == ["demo"]:
        assert done.returncode == 2 and "pip install 'kubegpu[demo]'" in done.stderr
        assert "Traceback" not in done.stderr
    else:
        assert done.returncode == 0, done.stderr
