"""``bench/enforcement.py`` runs end to end against the stand-in MPS control daemon.

The bench is the check run on a real GPU when one is lent (docs/sharing.md); it only ever ran there after a
change to the DRA driver had broken it unnoticed. Running its stand-in mode here keeps it working, and its
figures are what kubegpu told MPS for every kind of share it serves.
"""

from __future__ import annotations

from bench_runner import run_bench


def test_enforcement_bench_standin_serves_every_share_within_its_limits() -> None:
    result, stderr = run_bench("enforcement.py", "--standin", "--allocations", "20", timeout_s=400)
    assert result["gpu"] is None
    assert result["shares_tested"] == 6
    assert result["memory_over_limit_gib"] == 0.0
    assert result["escapes"] == 0 and result["env_raise_escapes"] == 0
    assert result["void_limits_served"] == 0
    paths = {c["path"] for c in result["clients"]}
    assert paths == {"allocate", "prepare"}  # the device plugin's answers and the DRA driver's
    for client in result["clients"]:
        assert client["allocated_gib"] <= client["limit_gib"]
        assert client["measured_share_pct"] in (None, client["granted_core"])
    assert "refused while the daemon was down" in stderr
    # The tenant's edits, per enforcement mode: only strict holds against a client that skips its server.
    modes = result["modes"]
    assert result["pipe_escapes"] == 0 and result["compute_mode_restored"] is True
    assert modes["strict"]["escapes"] == 0 and modes["strict"]["compute_mode_while_shared"] == "Exclusive_Process"
    assert "locked to the share shape" in modes["strict"]["other_shape_refused"]
    assert modes["per-shape"]["pipe_escapes"] == 1  # the empty pipe directory; unset reaches the mounted pipe
    assert modes["none"]["escapes"] == 3
    assert all(m["compute_mode_restored"] for m in modes.values())
    assert set(result["allocate_p99_ms"]) >= {"none", "per-shape"}
