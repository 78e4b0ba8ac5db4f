"""``kubegpu demo --short --json`` end to end: its end state, read from its JSON, checked here again
independently of the demo's own checks; and an interrupted demo leaves no process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

DEMO = [sys.executable, "-c", "from kubegpu.cli.main import app; app()", "demo"]


@pytest.fixture(scope="module")
def summary() -> dict[str, Any]:
    r = subprocess.run([*DEMO, "--short", "--json"], capture_output=True, text=True, timeout=150)
    assert r.stdout.strip(), r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["_rc"] = r.returncode
    out["_stderr"] = r.stderr
    return out


def _visible(env: dict[str, str]) -> set[str]:
    return {v for v in env.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if v}


def test_demo_passes_its_own_checks(summary: dict[str, Any]) -> None:
    failed = [c for c in summary["checks"] if not c["ok"]]
    assert summary["ok"] and summary["_rc"] == 0 and not failed, (failed, summary["_stderr"][-3000:])
    assert {c["name"] for c in summary["checks"]} >= {
        "admission", "every pod placed and running", "placed where recorded", "handoff acknowledged",
        "Xid GPU unhealthy", "nothing new on the Xid GPU", "no overcommit", "extender agrees"}


def test_every_admitted_pod_runs_where_recorded(summary: dict[str, Any]) -> None:
    gpus_of = {n["name"]: {g["uuid"] for g in n["gpus"]} for n in summary["view"]["nodes"]}
    admitted = {k: p for k, p in summary["pods"].items() if p["admitted"]}
    assert len(admitted) >= 10
    for key, pod in admitted.items():
        assert pod["phase"] == "Running" and pod["node"] in gpus_of, (key, pod)
        for name, c in pod["containers"].items():
            recorded = {g["mig"] or g["uuid"] for g in c["recorded"]}
            parents = {g["uuid"] for g in c["recorded"]}
            if recorded:
                assert parents <= gpus_of[pod["node"]], (key, name)
                assert _visible(c["env"]) == recorded, (key, name, c)
                if "KUBEGPU_GPU_CORE_PERCENT" in c["env"] and len(c["recorded"]) == 1:
                    assert int(c["env"]["KUBEGPU_GPU_CORE_PERCENT"]) == c["recorded"][0]["core"]
                    assert int(c["env"]["KUBEGPU_GPU_MEMORY_BYTES"]) == c["recorded"][0]["memory_bytes"]


def test_every_request_style_was_served(summary: dict[str, Any]) -> None:
    pods = summary["pods"]
    legacy = pods["demo/legacy-alpha"]["containers"]
    assert set(legacy) == {"trainer", "evaluator"}
    assert not _visible(legacy["trainer"]["env"]) & _visible(legacy["evaluator"]["env"])  # never shared
    assert len(_visible(pods["demo/nccl-pair"]["containers"]["nccl"]["env"])) == 2
    share = pods["demo/share-core-ratio"]["containers"]["main"]
    assert share["env"]["KUBEGPU_GPU_CORE_PERCENT"] == "50" and "kubegpu.io/gpu.shared" in share["devices"]
    assert pods["demo/share-core-memory"]["containers"]["main"]["env"]["KUBEGPU_GPU_MEMORY_BYTES"] == str(4 * 2**30)
    assert pods["demo/share-gpu-100"]["containers"]["main"]["recorded"][0]["core"] == 100
    by_model = pods["demo/a100-by-model"]  # a100-mig has the label too, but no share slots
    assert by_model["node"] == "dgx-a100" and by_model["containers"]["main"]["recorded"][0]["core"] == 25
    mig = pods["demo/mig-slice"]["containers"]["infer"]
    assert mig["recorded"][0]["mig"] and _visible(mig["env"]) == {mig["recorded"][0]["mig"]}
    replica = pods["demo/replica"]["containers"]["notebook"]
    ids = replica["devices"]["nvidia.com/sharedgpu"]
    assert len(ids) == 1 and _visible(replica["env"]) == {ids[0].split("::")[0]}
    assert pods["demo/plain"]["containers"]["exporter"]["env"]["NVIDIA_VISIBLE_DEVICES"] == "void"
    refused = pods["demo/core-only"]
    assert not refused["admitted"] and "memory" in refused["refusal"] and "node" not in refused


def test_xid_gpu_unhealthy_and_avoided(summary: dict[str, Any]) -> None:
    xid = summary["xid"]
    assert xid and xid["xid"] in (48, 79) and xid["unhealthy_after_s"] is not None
    node = next(n for n in summary["view"]["nodes"] if n["name"] == xid["node"])
    gpu = next(g for g in node["gpus"] if g["uuid"] == xid["uuid"])
    assert gpu["healthy"] is False and gpu["holders"] == []
    after = xid["after_xid_pods"]
    assert after, "a second wave was submitted after the Xid"
    for key in after:
        pod = summary["pods"][key]
        assert pod["node"] == xid["node"] and pod["phase"] == "Running", (key, pod)
        for c in pod["containers"].values():
            assert xid["uuid"] not in _visible(c["env"])
            assert all(g["uuid"] != xid["uuid"] for g in c["recorded"])


def test_no_gpu_overcommitted(summary: dict[str, Any]) -> None:
    assert summary["view"]["problems"] == []
    for n in summary["view"]["nodes"]:
        for g in n["gpus"]:
            assert g["core_used"] <= 100 and g["memory_used"] <= g["memory_bytes"], (n["name"], g)
            assert sum(h["core"] for h in g["holders"]) == g["core_used"]


def _processes_mentioning(text: str, but: int = 0) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), but):
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def _kept_demo(workdir: Path) -> subprocess.Popen[str]:
    """A demo holding its cluster up, returned once its five role processes run."""
    proc = subprocess.Popen([*DEMO, "--short", "--quiet", "--workdir", str(workdir), "--keep-running", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    # The webhook, the extender and the node daemons name the work dir on their command lines.
    while len(_processes_mentioning(str(workdir), but=proc.pid)) < 5:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.2)
    return proc


def _gone(workdir: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _processes_mentioning(str(workdir)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 130), (signal.SIGKILL, -signal.SIGKILL)])
def test_stopped_demo_leaves_no_role_running(sig: signal.Signals, code: int) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="kgd-", dir="/tmp"))
    proc = _kept_demo(workdir)
    try:
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == code, out
        if sig == signal.SIGTERM:
            assert "interrupted" in out
            assert _processes_mentioning(str(workdir)) == []  # stopped before the demo exits
        else:
            assert _gone(workdir, 10)  # each role follows its parent (PR_SET_PDEATHSIG)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in _processes_mentioning(str(workdir)):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(workdir, ignore_errors=True)


def test_too_deep_workdir_is_refused_before_anything_starts(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    r = subprocess.run([*DEMO, "--short", "--json", "--workdir", str(deep)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] is False and "unix socket" in out["error"]
    assert not deep.exists()


def test_live_view_shows_the_time_slicing_replica_pod(summary: dict[str, Any]) -> None:
    """The replica pod holds no extender record; the live view shows it from the Node and the pod."""
    node = next(n for n in summary["view"]["nodes"] if n["name"] == "a100-mig")
    (replicas,) = node["replicas"]
    assert replicas["resource"] == "nvidia.com/sharedgpu" and replicas["per_gpu"] == 4
    assert [(h["pod"], h["container"]) for h in replicas["holders"]] == [("demo/replica", "notebook")]
    assert summary["view"]["totals"]["replica_pods"] == 1
    assert all(g["replica_only"] for g in node["gpus"] if not g["mig_enabled"])
    assert "demo/replica[notebook]" in summary["_stderr"]
