"""``bench/starvation_extender.py`` runs end to end on the first pods of the churn: through the extender's HTTP
verbs, with and without reservations, its last line one JSON object. Its numbers are the benchmark's to report
(docs/scheduler.md); here only what must hold whatever the machine's load: the clock is virtual, and this many
pods never fill the cluster, so every pod is placed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)  # a guard against a hang, not a bound on speed
def test_the_extender_churn_bench_runs_and_places_every_pod_of_a_light_load() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "starvation_extender.py"), "--pods", "30"], env=env,
                       capture_output=True, text=True, timeout=280, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["pods"] == 30
    for key in ("wide_pods_never_placed", "wide_pods_never_placed_without", "small_pods_never_placed",
                "small_pods_never_placed_without"):
        assert out[key] == 0, out
