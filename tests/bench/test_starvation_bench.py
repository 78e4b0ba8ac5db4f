"""``bench/starvation.py`` on the churn alone (``--openb-pods 0``) with one other draw (``--draws 1``): the
draws it reports are the churn's own seed and the next, and the churn's own draw in that table is the very
replay the headline keys report (the replay is deterministic: same pods, same policy, same numbers).

The numbers themselves are the benchmark's to report (docs/performance.md); here only what must hold whatever
they are."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from bench_runner import ROOT, run_bench

HEADLINE = ("wide_pods_never_placed", "wide_pods_never_placed_without", "small_pods_never_placed",
            "small_pods_never_placed_without", "idle_gpu_cost_pct", "small_wait_p99_s", "small_wait_p99_s_without")


@pytest.mark.timeout(600)  # a guard against a hang, not a bound on speed
def test_the_churn_draws_are_the_next_seeds_and_the_first_is_the_headline_run() -> None:
    out, err = run_bench("starvation.py", "--openb-pods", "0", "--loads", "--draws", "1", timeout_s=580)
    assert "openb" not in out["runs"]
    draws = out["churn_draws"]
    assert list(draws) == ["recorded"]
    recorded = draws["recorded"]
    assert [d["seed"] for d in recorded["draws"]] == [out["churn_seed"], out["churn_seed"] + 1]
    own = recorded["draws"][0]
    for key in HEADLINE:
        assert own[key] == out[key], key
    assert recorded["wide_pods_never_placed"] == sum(d["wide_pods_never_placed"] for d in recorded["draws"])
    costs = [d["idle_gpu_cost_pct"] for d in recorded["draws"]]
    assert recorded["idle_gpu_cost_pct"] == {"max": max(costs), "median": round(sum(costs) / 2, 3)}
    assert "churn draws at the recorded load" in err


def test_a_negative_number_of_draws_is_refused_with_a_message() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "starvation.py"), "--draws", "-1"], env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2
    assert "--draws must be 0 or more" in p.stderr
    assert "Traceback" not in p.stderr
