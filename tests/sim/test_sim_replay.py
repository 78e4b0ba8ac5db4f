"""The simulator on cut-down traces: protocol, metrics, failures, the CLI and its JSON, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.sim.replay import CHECKPOINTS, arrival_order, replay
from kubegpu.sim.study import run_study, study_json
from kubegpu.sim.timeline import replay_time
from kubegpu.sim.trace import TraceError, default_path, load_nodes, load_pods

NODE_HEADER = "sn,cpu_milli,memory_mib,gpu,model\n"
POD_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
)


def cut_trace(tmp_path: Path, n_nodes: int = 60, n_pods: int = 400) -> tuple[Path, Path]:
    """The first nodes of the packaged node list and a slice of the packaged pod list."""
    nodes = default_path("openb_node_list_gpu_node.csv").read_text().splitlines()
    pods = default_path("openb_pod_list_default.csv").read_text().splitlines()
    # Every 20th node keeps a mix of models; pods without a model constraint only.
    n = tmp_path / "nodes.csv"
    n.write_text("\n".join([nodes[0], *nodes[1::20][:n_nodes]]) + "\n")
    p = tmp_path / "pods.csv"
    p.write_text("\n".join([pods[0], *pods[1 : n_pods + 1]]) + "\n")
    return n, p


def test_packaged_default_trace_is_the_paper_cluster():
    nodes = load_nodes().gpu_only()
    assert len(nodes.names) == 1213 and nodes.total_gpus == 6212
    assert len(load_pods()) == 8152


def test_arrival_order_inflates_to_the_target_and_depends_on_the_seed(tmp_path):
    _, p = cut_trace(tmp_path)
    pods = load_pods(p)
    cap = 10 * 8000
    a = arrival_order(pods, cap, 1, 1.3)
    assert sum(pods[i].demand.gpu_milli_total for i in a) >= 1.3 * cap
    assert sorted(a[: len(pods)]) == list(range(len(pods)))  # a permutation first, then resampling
    assert a == arrival_order(pods, cap, 1, 1.3) and a != arrival_order(pods, cap, 2, 1.3)


@pytest.mark.parametrize("policy", ["random", "bestfit", "fgd", "kubegpu"])
def test_replay_metrics(tmp_path, policy):
    n, p = cut_trace(tmp_path)
    r = replay(load_nodes(n).gpu_only(), load_pods(p), policy, seed=3)
    assert len(r.arrived_pct) == len(r.allocated_pct) == r.pods
    assert np.all(np.diff(r.arrived_pct) >= 0) and r.arrived_pct[-1] >= 130
    assert np.all(r.allocated_pct <= r.arrived_pct + 1e-9) and r.allocated_pct.max() <= 100 + 1e-9
    for pct in CHECKPOINTS:
        u = r.unallocated_at(pct)
        i = int(np.searchsorted(r.arrived_pct, pct))
        # Never below the ideal (everything arrived so far allocated), never above 100.
        assert u is not None and max(0.0, 100 - r.arrived_pct[i]) - 1e-6 <= u <= 100
    assert sum(r.failed.values()) > 0  # at 130 % something must be dropped
    assert set(r.fragment_pct) == set(CHECKPOINTS)


def test_policies_rank_as_in_the_paper_on_a_cut_down_trace(tmp_path):
    n, p = cut_trace(tmp_path, 120, 1200)
    nodes, pods = load_nodes(n).gpu_only(), load_pods(p)
    res = run_study(nodes, pods, ["random", "bestfit", "fgd"], seeds=[1, 2])
    at = {k: s.mean_at(100) for k, s in res.items()}
    assert at["bestfit"] < at["random"] and at["fgd"] < at["random"]


def test_study_json_shape(tmp_path):
    n, p = cut_trace(tmp_path)
    res = run_study(load_nodes(n).gpu_only(), load_pods(p), ["bestfit"], seeds=[1, 2])
    out = study_json({"pods": "x"}, res)
    body = out["policies"]["bestfit"]
    assert set(body["unallocated_pct_at"]) == {str(c) for c in CHECKPOINTS}
    assert set(body["unallocated_pct_sd_at"]) == {str(c) for c in CHECKPOINTS}
    assert body["seconds"] >= 0 and body["seeds"] == [1, 2]


def test_cli_json_is_the_last_line(tmp_path):
    n, p = cut_trace(tmp_path)
    res = CliRunner().invoke(
        app,
        [
            "simulate",
            "--nodes",
            str(n),
            "--pods",
            str(p),
            "--policy",
            "bestfit",
            "--policy",
            "packing",
            "--seeds",
            "2",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output.strip().splitlines()[-1])
    assert set(data["policies"]) == {"bestfit", "packing"}
    assert data["trace"]["seeds"] == [42, 43]
    assert set(data["policies"]["packing"]["unallocated_pct_at"]) == {"80", "90", "95", "100", "110", "120", "130"}


def test_cli_table_and_plot(tmp_path):
    n, p = cut_trace(tmp_path)
    png = tmp_path / "fig.png"
    res = CliRunner().invoke(
        app, ["simulate", "--nodes", str(n), "--pods", str(p), "-p", "random", "-p", "fgd", "--plot", str(png)]
    )
    assert res.exit_code == 0, res.output
    assert "fgd" in res.output and "1 seed(s)" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_unknown_policy_and_bad_files(tmp_path):
    res = CliRunner().invoke(app, ["simulate", "--policy", "nope", "--json"])
    assert res.exit_code == 2 and "unknown policy" in res.output
    bad = tmp_path / "bad.csv"
    bad.write_text(POD_HEADER + "p0,1000,1024,1,abc,,LS,Running,0,1,0\n")
    res = CliRunner().invoke(app, ["simulate", "--pods", str(bad)])
    assert res.exit_code == 2 and "bad.csv:2: gpu_milli='abc' is not a number" in res.output


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("name,cpu_milli\np,1\n", "missing column"),
        (POD_HEADER, "no pods"),
        (POD_HEADER + "p,1000,1024,1,5000,,LS,R,0,1,0\n", "out of range"),
        (POD_HEADER + "p,1000,1024,999999,1000,,LS,R,0,1,0\n", "out of range"),
        ("\x00\x01\x02", "missing column"),
    ],
)
def test_bad_pod_files_are_clear_errors(tmp_path, text, words):
    f = tmp_path / "p.csv"
    f.write_text(text)
    with pytest.raises(TraceError, match=words):
        load_pods(f)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_nodes(tmp_path / "absent.csv")


def test_time_replay_frees_gpus_on_departure(tmp_path):
    nodes = tmp_path / "n.csv"
    nodes.write_text(NODE_HEADER + "a,8000,16384,1,T4\n")
    pods = tmp_path / "p.csv"
    # p0 holds the only GPU from t=0 to t=10; p1 arrives at 5 (dropped), p2 at 10 (fits after p0 leaves).
    pods.write_text(
        POD_HEADER + "p0,1000,1024,1,1000,,LS,R,0,10,0\np1,1000,1024,1,1000,,LS,R,5,20,5\n"
        "p2,1000,1024,1,1000,,LS,R,10,30,10\np3,1000,1024,0,0,,LS,R,,,\n"
    )
    r = replay_time(load_nodes(nodes), load_pods(pods), "bestfit")
    assert r.failed == {"1-gpu": 1} and r.skipped == 1 and r.pods == 3
    assert r.peak_allocated_pct == 100.0
    res = CliRunner().invoke(
        app, ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--replay-time", "-p", "bestfit", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["policies"]["bestfit"]["failed_pods"] == {"1-gpu": 1}


def test_model_constraints_and_cpu_limits_are_hard(tmp_path):
    nodes = tmp_path / "n.csv"
    nodes.write_text(NODE_HEADER + "a,4000,16384,2,T4\nb,64000,65536,2,V100M16\n")
    pods = tmp_path / "p.csv"
    pods.write_text(POD_HEADER + "p0,8000,1024,1,1000,T4,LS,R,0,1,0\np1,1000,1024,1,1000,V100M16|A10,LS,R,0,1,0\n")
    r = replay(load_nodes(nodes), load_pods(pods), "bestfit", seed=0, inflate=0.1)
    # p0 wants a T4 but the T4 node has 4 cores: dropped. p1 runs on the V100 node.
    assert r.failed.get("1-gpu", 0) >= 1 and r.allocated_pct.max() > 0


def test_time_replay_load_brings_contention_and_refuses_inflate(tmp_path):
    from kubegpu.sim.timeline import load_for_peak, peak_demand

    nodes = tmp_path / "n.csv"
    nodes.write_text(NODE_HEADER + "a,8000,16384,2,T4\n")
    pods = tmp_path / "p.csv"
    # Three one-GPU pods of 100 s each, 1,000 s apart: never two at once as recorded.
    pods.write_text(POD_HEADER + "".join(f"p{i},1000,1024,1,1000,,LS,R,{1000 * i},{1000 * i + 100},0\n"
                                         for i in range(3)))
    node_list, pod_list = load_nodes(nodes), load_pods(pods)
    assert peak_demand(pod_list, 1.0) == 1000
    assert replay_time(node_list, pod_list, "bestfit").failed == {}
    factor = load_for_peak(pod_list, 2000, target=1.5)  # all three at once: compressed 1,000 s -> <= 50 s
    assert peak_demand(pod_list, factor) >= 3000 > peak_demand(pod_list, factor / 2)
    r = replay_time(node_list, pod_list, "bestfit", load=factor)
    assert r.failed == {"1-gpu": 1} and r.load == factor and r.to_json()["peak_demand_pct"] == 150.0
    res = CliRunner().invoke(app, ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--replay-time",
                                   "--inflate", "1.2", "--json"])
    assert res.exit_code == 2 and "--load" in json.loads(res.output.strip().splitlines()[-1])["error"]
    res = CliRunner().invoke(app, ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--replay-time",
                                   "--load", "40", "-p", "bestfit", "--json"])
    out = json.loads(res.output.strip().splitlines()[-1])
    assert res.exit_code == 0 and out["trace"]["load"] == 40.0
    assert out["policies"]["bestfit"]["failed_pods"] == {"1-gpu": 1}


def test_cli_learned_workload_and_name_ties_are_stated(tmp_path):
    nodes, pods = cut_trace(tmp_path, 20, 150)
    res = CliRunner().invoke(app, ["simulate", "--nodes", str(nodes), "--pods", str(pods), "-p", "fgd",
                                   "--learned-workload", "--ties", "name", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["trace"]["workload"] == "learned" and out["trace"]["ties"] == "name"
    learned = replay(load_nodes(nodes).gpu_only(), load_pods(pods), "fgd", 42, learned=True, ties="name")
    assert out["policies"]["fgd"]["unallocated_pct_at"]["100"] == round(learned.unallocated_at(100), 3)
    res = CliRunner().invoke(app, ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--ties", "odd", "--json"])
    assert res.exit_code == 2 and "--ties" in res.output
