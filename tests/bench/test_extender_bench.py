"""``bench/extender.py`` runs end to end on a small cluster: every process it starts (the stand-in API
server, ``kubegpu scheduler``, the node daemons' acknowledger) plays its part, and what it prints adds up.

The figures themselves are the benchmark's to report, on a quiet machine at 5,000 nodes (docs/performance.md);
here only that the bench still places, binds and acknowledges what it says it does.
"""

from __future__ import annotations

from bench_runner import run_bench


def test_extender_bench_places_binds_and_acknowledges_every_pod() -> None:
    result, _ = run_bench("extender.py", "--nodes", "40", "--pods", "30", timeout_s=120)
    assert result["nodes"] == 40 and result["pods"] == 30
    assert result["placed"] + result["unschedulable"] + result["bind_errors"] == 30
    assert result["placed"] > 0 and result["bind_errors"] == 0
    assert result["binds_acknowledged"] == result["placed"]  # every bind reached its "node"
    assert set(result["extender_cpu_ms_per_pod_by_verb"]) == {"filter", "prioritize", "bind", "other"}
    assert result["extender_cpu_ms_per_pod"] > 0 and result["pods_per_s"] > 0
