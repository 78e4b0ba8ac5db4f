"""``bench/node.py --share-enforcement strict`` runs end to end: share Allocate with strict enforcement (the
stand-in MPS control, the fake driver's compute modes) beside the unenforced path. Its figures are for
docs/performance.md, not asserted here."""

from __future__ import annotations

from bench_runner import run_bench


def test_node_bench_measures_strict_share_allocate_beside_the_unenforced_path() -> None:
    result, _ = run_bench("node.py", "--share-enforcement", "strict", "--n", "20", timeout_s=300)
    assert result["mode"] == "share-allocate-strict" and result["n"] == 20
    assert set(result["share_allocate_p99_ms"]) == {"none", "strict"}
    assert all(v > 0 for v in result["share_allocate_p99_ms"].values())
    assert "share_allocate_p99_over_unenforced_ms" in result
