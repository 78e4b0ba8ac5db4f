"""A bench script run as a user runs it (its own process, the source tree on the path), and the one JSON object it
prints as its last line: one helper for the bench tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, timeout_s: float) -> tuple[dict[str, Any], str]:
    """(the JSON result, stderr) of ``bench/<script> args``; fails the test when it exits non-zero."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args],
                       env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr
