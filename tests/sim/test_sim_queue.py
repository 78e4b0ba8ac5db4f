"""The queued replay: pods wait instead of being dropped, and reservations keep wide pods from starving."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.placement.cluster import ClusterState, Demand
from kubegpu.placement.reservations import ReservationConfig
from kubegpu.sim.churn import Churn
from kubegpu.sim.queue import QueuedPod, replay_queue

NODE_HEADER = "sn,cpu_milli,memory_mib,gpu,model\n"
POD_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
)


def two_nodes() -> ClusterState:
    return ClusterState.from_arrays(["a", "b"], ["V100", "V100"], [4, 4], [64_000] * 2, [2**40] * 2)


def stream() -> list[QueuedPod]:
    """A wide pod behind a steady stream of 1-GPU pods that, alone, keeps every GPU busy."""
    pods = [QueuedPod(f"s{k}", Demand.whole(1), float(k), 8.0) for k in range(200)]
    return [*pods, QueuedPod("wide", Demand.whole(4), 10.5, 10.0)]


def test_a_stream_of_small_pods_starves_a_wide_one_without_reservations_not_with() -> None:
    without = replay_queue(two_nodes(), stream(), "bestfit", give_up_s=100)
    assert without.never_placed == {"4": 1}
    cfg = ReservationConfig(min_gpus=4, wait_seconds=5, max_share=1.0)
    with_ = replay_queue(two_nodes(), stream(), "bestfit", reservations=cfg, give_up_s=100)
    assert without.gave_up == {"4": 1}  # withdrawn after waiting, not cut off by the end of the replay
    assert with_.never_placed == {} and with_.reservations_made == 1
    (wait,) = with_.waits_s["4"]
    assert 5 <= wait <= 5 + 1 + 8  # the threshold, the next event, at most one lifetime of what ran there
    assert with_.stats(("1",)).pods == 200 and with_.held_idle_gpu_s > 0
    off = ReservationConfig(enabled=False)
    disabled = replay_queue(two_nodes(), stream(), "bestfit", reservations=off, give_up_s=100)
    assert disabled.never_placed == without.never_placed and not disabled.reservations


def test_declared_runtimes_let_short_pods_backfill_held_gpus() -> None:
    cfg = ReservationConfig(min_gpus=4, wait_seconds=5, max_share=1.0)
    plain = replay_queue(two_nodes(), stream(), "bestfit", reservations=cfg, give_up_s=100)
    declared = replay_queue(two_nodes(), stream(), "bestfit", reservations=cfg, give_up_s=100, declared_runtime=True)
    assert declared.never_placed == {}
    assert declared.held_idle_gpu_s <= plain.held_idle_gpu_s


def test_pods_wait_for_room_and_the_never_placed_are_counted() -> None:
    c = ClusterState.from_arrays(["a"], ["V100"], [2], [64_000], [2**40])
    pods = [QueuedPod("p0", Demand.whole(2), 0.0, 10.0), QueuedPod("p1", Demand.whole(1), 1.0, 5.0),
            QueuedPod("p2", Demand.whole(4), 2.0, 1.0), QueuedPod("p3", Demand.share(500), 3.0, None)]
    r = replay_queue(c, pods, "bestfit")
    assert r.waits_s["2"] == (0.0,) and r.waits_s["1"] == (9.0,) and r.waits_s["share"] == (7.0,)
    assert r.never_placed == {"4": 1} and r.gave_up == {}  # no node has 4 GPUs: still waiting at the end
    # In use: both GPUs until 10, then one whole and half of the other until p1 leaves at 15 (the last event).
    assert r.used_gpu_s == 2 * 10 + 1.5 * 5 and r.span_s == 15 and abs(r.used_pct - 27.5 / 30 * 100) < 1e-9
    assert r.to_json()["never_placed"] == 1 and r.to_json()["widths"]["4"]["never_placed"] == 1


def test_the_churn_stand_in_is_the_recorded_mix() -> None:
    churn = Churn()
    pods = churn.pods()
    widths = sorted({(p.demand.count if p.demand.exclusive else 0) for p in pods})
    assert len(pods) == 400 and widths == [0, 1, 2, 4, 8]
    assert sum(1 for p in pods if p.demand.exclusive and p.demand.count == 8) == 26
    assert int(churn.cluster().gpu_ok.sum()) == 80 and pods == Churn().pods()
    assert 1.7 < churn.offered_load < 1.9  # the recording's: more than the cluster can run


def test_the_churn_at_a_lighter_load_is_the_same_pods_arriving_slower() -> None:
    churn = Churn()
    light = churn.at_load(1.0)
    assert abs(light.offered_load - 1.0) < 1e-9 and light.rate < churn.rate
    pods, slower = churn.pods(), light.pods()
    assert [(p.key, p.demand, p.duration) for p in pods] == [(p.key, p.demand, p.duration) for p in slower]
    assert all(b.arrive > a.arrive for a, b in zip(pods, slower, strict=True))


def test_cli_reports_waits_by_width_with_and_without(tmp_path) -> None:
    nodes = tmp_path / "n.csv"
    nodes.write_text(NODE_HEADER + "a,64000,65536,4,V100M16\nb,64000,65536,4,V100M16\n")
    pods = tmp_path / "p.csv"
    rows = [f"s{k},1000,1024,1,1000,,LS,R,{k},{k + 8},0" for k in range(60)]
    rows.append("wide,1000,1024,4,1000,,LS,R,10,20,0")
    pods.write_text(POD_HEADER + "\n".join(rows) + "\n")
    args = ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--replay-time", "--load", "1", "-p", "bestfit",
            "--reservations", "--reserve-wait", "5", "--reserve-max-share", "1"]
    res = CliRunner().invoke(app, [*args, "-o", "json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    by = out["policies"]["bestfit"]
    assert by["with"]["widths"]["4"]["never_placed"] == 0 and by["with"]["reservations_made"] == 1
    assert out["trace"]["reservation"] == {"min_gpus": 4, "wait_seconds": 5.0, "max_share": 1.0}
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "Waits by pod width" in table.output
    refused = CliRunner().invoke(app, ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--reservations",
                                       "--json"])
    assert refused.exit_code == 2 and "--replay-time" in refused.output


def test_lists_without_times_borrow_them_or_are_refused(tmp_path) -> None:
    from kubegpu.sim.trace import load_pods, with_times_from

    nodes = tmp_path / "n.csv"
    nodes.write_text(NODE_HEADER + "a,64000,65536,8,V100M16\n")
    donor = tmp_path / "d.csv"
    donor.write_text(POD_HEADER + "p0,1000,1024,1,1000,,LS,R,5,50,0\np1,1000,1024,8,1000,,LS,R,7,70,0\n")
    bare = tmp_path / "b.csv"
    bare.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,1000\nx,1000,1024,8,1000\n")
    pods = with_times_from(load_pods(bare), load_pods(donor))
    assert [(p.creation, p.deletion) for p in pods] == [(5, 50), (7, 70)]  # by name; else the same GPU count
    args = ["simulate", "--nodes", str(nodes), "--pods", str(bare), "--replay-time", "--load", "1", "-p", "bestfit",
            "--reservations", "--json"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "--times-from" in refused.output
    res = CliRunner().invoke(app, [*args, "--times-from", str(donor)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["policies"]["bestfit"]["with"]["pods"] == 2 and out["trace"]["times_from"] == str(donor)
