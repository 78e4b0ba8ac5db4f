"""``bench/churn.py --quick`` runs end to end: churn with an extender restart, a node daemon stopped (SIGTERM)
and one killed (SIGKILL) while pods pinned to them are being bound, and a kubelet restart; what it prints adds
up, and the restart that says it is stopping turns no pod away.

The timings are the benchmark's to report (docs/handoff.md, "Restarts"); here only what must hold whatever the
machine's load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)  # a guard against a hang, not a bound on speed
def test_churn_bench_turns_no_pod_away_at_a_node_daemon_restart() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "churn.py"), "--quick"], env=env, capture_output=True,
                       text=True, timeout=580, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    # node daemons: the SIGTERM restart in the churn, then the pinned SIGTERM and SIGKILL repeats
    assert out["restarts"] == {"extender": 1, "node_daemon": 3, "kubelet": 1}
    assert out["pods"] >= 16 * 2  # the two pinned series at least
    assert out["rejected_at_node_restart"] == 0, out["rejected_reasons"]
    assert out["rejected_other"] == 0, out["rejected_reasons"]
    assert out["gpu_over_capacity"] == 0
    assert out["lost_or_double_counted"] == 0, out["lost_or_double_counted_examples"]
    assert isinstance(out["rejected_at_node_crash"], int)
    assert out["ran_share"].split("/")[0] != "0" and out["ran_1"].split("/")[0] != "0"
    for key in ("running_s_p50_share", "running_s_p99_1", "ack_lag_s_p99_at_lag", "bind_refused_after_filter",
                "bind_refused_after_change"):
        assert key in out
