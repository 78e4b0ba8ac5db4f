"""The node DaemonSet carries what MPS needs, in node-only and full installs."""

from __future__ import annotations

import pytest

from kubegpu.install.render import render
from kubegpu.install.values import values_from_dict


def _node_pod(objs: list[dict]) -> dict:  # type: ignore[type-arg]
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet" and o["metadata"]["name"].endswith("node")]
    return ds["spec"]["template"]["spec"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "node-only"])
def test_mps_root_and_shared_memory_are_the_hosts(mode: str) -> None:
    pod = _node_pod(render(values_from_dict({"mode": mode})))
    (ctr,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in ctr["volumeMounts"]}
    vols = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    assert mounts["mps-root"] == vols["mps-root"] == "/run/nvidia/mps"
    assert (mounts["mps-shm"], vols["mps-shm"]) == ("/dev/shm", "/run/nvidia/mps/shm")
    assert "SETUID" not in str(ctr["securityContext"])  # no MPS configured: no extra capability


@pytest.mark.parametrize("enforcement", ["mps", "per-shape", "strict"])
def test_enforcing_with_mps_lets_the_daemon_start_servers_as_their_clients(enforcement: str) -> None:
    cfg = f"version: v1\nkubegpu:\n  shareEnforcement: {enforcement}\n"
    pod = _node_pod(render(values_from_dict({"mode": "full", "config": {"map": {"default": cfg}}})))
    assert {"SETUID", "SETGID"} <= set(pod["containers"][0]["securityContext"]["capabilities"]["add"])


@pytest.mark.parametrize(("enforcement", "sys_admin"), [("mps", False), ("strict", True)])
def test_strict_enforcement_may_set_compute_modes(enforcement: str, sys_admin: bool) -> None:
    cfg = f"version: v1\nkubegpu:\n  shareEnforcement: {enforcement}\n"
    pod = _node_pod(render(values_from_dict({"mode": "full", "config": {"map": {"default": cfg}}})))
    assert ("SYS_ADMIN" in pod["containers"][0]["securityContext"]["capabilities"]["add"]) is sys_admin
