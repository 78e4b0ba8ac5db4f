"""``bench/node.py --share-enforcement strict`` runs end to end: share Allocate with strict enforcement (the
stand-in MPS control, the fake driver's compute modes) beside the unenforced path. Its figures are for
docs/performance.md, not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_node_bench_measures_strict_share_allocate_beside_the_unenforced_path() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "node.py"), "--share-enforcement", "strict", "--n", "20"],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["mode"] == "share-allocate-strict" and result["n"] == 20
    assert set(result["share_allocate_p99_ms"]) == {"none", "strict"}
    assert all(v > 0 for v in result["share_allocate_p99_ms"].values())
    assert "share_allocate_p99_over_unenforced_ms" in result
