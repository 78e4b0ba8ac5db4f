"""``kubegpu node --kubelet-plugin dra``: dry run, bad flags, and the real process against the stand-ins."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dra_harness import FIXTURES, NODE
from polling import until

from kubegpu.install.dra import device_classes
from kubegpu.install.values import Values
from kubegpu.node.dra.names import DRIVER
from kubegpu_standins.apiserver import ApiServer
from kubegpu_standins.dra_allocator import Allocator, ClaimController
from kubegpu_standins.dra_kubelet import DraKubelet
from kubegpu_standins.dra_validation import validate

KUBEGPU = [sys.executable, "-c", "from kubegpu.cli.main import main; main()"]


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kgc-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KUBEGPU, "node", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_dry_run_prints_valid_slices() -> None:
    r = _run("--kubelet-plugin", "dra", "--inventory", "a100-mig", "--dry-run", "--json", "--dra-shared-gpus", "3")
    assert r.returncode == 0, r.stderr
    bodies = json.loads(r.stdout)
    assert [b["metadata"]["name"] for b in bodies] == ["a100-mig-gpu.kubegpu.io", "a100-mig-gpu.kubegpu.io-counters"]
    assert all(validate("ResourceSlice", b) == [] for b in bodies)
    devs = {d["name"]: d for d in bodies[0]["spec"]["devices"]}
    # GPU 3 takes shares beside whole claims; GPU 2 is whole only; both are plain GPUs to whole claims.
    assert devs["gpu-3"]["attributes"]["type"] == devs["gpu-2"]["attributes"]["type"] == {"string": "gpu"}
    assert devs["gpu-3"].get("allowMultipleAllocations") is True and "allowMultipleAllocations" not in devs["gpu-2"]


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--kubelet-plugin", "vfio"], 2, "expected device-plugin or dra"),
    (["--kubelet-plugin", "dra", "--inventory", "t4x4", "--dra-shared-gpus", "some", "--dry-run"], 2,
     "expected all, none or GPU indexes"),
    (["--kubelet-plugin", "dra", "--inventory", "t4x4", "--dra-resync", "soon", "--dry-run"], 2,
     "--dra-resync: 'soon' is not a duration"),
    (["--kubelet-plugin", "dra", "--inventory", "t4x4", "--dra-resync", "0", "--dry-run"], 2,
     "--dra-resync: must be more than 0 seconds"),
    (["--kubelet-plugin", "dra", "--inventory", "t4x4", "--no-such-flag", "1", "--dry-run"], 2, "unknown flag"),
    (["--kubelet-plugin", "dra", "--inventory", "t4x4", "--kubeconfig", "/nonexistent"], 1, "needs the API server"),
])
def test_bad_input_is_a_clear_error(args: list[str], code: int, message: str) -> None:
    r = _run(*args)
    assert r.returncode == code
    assert message in r.stderr and "Traceback" not in r.stderr


def _pod_with_claim(api: ApiServer, name: str) -> tuple[dict[str, Any], str]:
    """A pod of the node and the whole-GPU claim it uses; the claim's UID."""
    claim = api.put_object({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                            "metadata": {"name": name, "namespace": "default"},
                            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                                "deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 1}}]}}})
    pod = api.put_object({"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
                          "spec": {"nodeName": NODE, "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                                   "containers": [{"name": "c", "image": "x",
                                                   "resources": {"claims": [{"name": "gpu"}]}}]}})
    return pod, claim["metadata"]["uid"]


def _http(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


def test_process_serves_the_kubelet_without_grpcio_and_stops_cleanly(root: Path) -> None:
    """The daemon as a node runs it, against the stand-in kubelet: a grpcio client, as the real kubelet's
    grpc-go is another implementation than the daemon's grpclib. It registers, streams health, prepares
    and unprepares, and never loads grpcio (its C core alone is a large part of the node's memory budget).
    It serves /metrics, /healthz and /readyz as the device-plugin node does, with the kubegpu_node_* series."""
    api = ApiServer().start()
    kubelet = DraKubelet(api, root / "kubelet", NODE)
    kubelet.start()
    log = root / "node.log"
    proc = subprocess.Popen([*KUBEGPU, "node", "--kubelet-plugin", "dra", "--inventory",
                             str(FIXTURES / "gpu-node-1.yaml"), "--node-name", NODE, "--kubeconfig",
                             str(api.write_kubeconfig(root / "kubeconfig")),
                             "--dra-plugins-dir", str(root / "kubelet" / "plugins"),
                             "--dra-registry-dir", str(root / "kubelet" / "plugins_registry"),
                             "--cdi-spec-dir", str(root / "cdi"), "--metrics-address", "127.0.0.1:0"],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True)
    try:
        assert until(lambda: re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", log.read_text()), 30), \
            log.read_text()
        found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", log.read_text())
        assert found is not None
        port = int(found.group(1))
        assert kubelet.wait(lambda: DRIVER in kubelet.plugins and
                            len(api.objects("resourceslices", "resource.k8s.io")) == 1, 30)
        # Ready once registered with the kubelet and the slices are written: poll, the two land apart.
        assert until(lambda: _http(port, "/readyz")[0] == 200, 30), _http(port, "/readyz")
        ready = json.loads(_http(port, "/readyz")[1])
        assert ready == {"ok": True, "checks": {"inventory": "ok", f"kubelet:{DRIVER}": "ok",
                                                "resourceslices": "ok"}}
        assert _http(port, "/healthz") == (200, json.dumps({"ok": True, "checks": {
            "lifecycle": "ok", "nvml-events": "ok"}}) + "\n")
        plugin = kubelet.plugins[DRIVER]
        assert kubelet.wait(lambda: len(plugin.health) == 4)
        assert set(plugin.health.values()) == {"HEALTHY"}
        for c in device_classes(Values()):
            api.put_object(c)
        pod, claim_uid = _pod_with_claim(api, "whole")
        assert ClaimController(api).schedule(Allocator(api), pod)
        kubelet.add_pod(api.get_object("pods", "whole", "default"))
        assert kubelet.wait(lambda: pod["metadata"]["uid"] in kubelet.running, 30)
        prepare = kubelet.calls[-1]
        assert prepare.method == "NodePrepareResources" and prepare.error == ""
        assert prepare.response.claims[claim_uid].error == ""
        assert [d.device_name for d in prepare.response.claims[claim_uid].devices] == ["gpu-0"]
        assert kubelet.remove_pod(pod) == [claim_uid]
        assert kubelet.calls[-1].method == "NodeUnprepareResources"
        status, metrics = _http(port, "/metrics")
        assert status == 200
        assert metrics.count("kubegpu_node_gpu_healthy{") == 4
        assert f'kubegpu_node_registrations_total{{resource="{DRIVER}"}} 1.0' in metrics
        assert f'kubegpu_node_devices{{health="Healthy",resource="{DRIVER}"}}' in metrics
        assert "kubegpu_node_dra_prepare_seconds_count 1.0" in metrics
        assert "kubegpu_node_dra_unprepare_seconds_count 1.0" in metrics
        assert "kubegpu_node_dra_prepared_claims 0.0" in metrics
        # grpcio's C extension is mapped into any process that imported grpc.
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "cygrpc" not in maps, "the DRA daemon loaded grpcio"
        proc.send_signal(signal.SIGHUP)  # rediscovery: same GPUs, nothing republished, still serving
        assert not kubelet.wait(lambda: proc.poll() is not None, 1.0)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        err = log.read_text()
        assert proc.returncode == 0, err
        assert "Traceback" not in err, err
        assert not (root / "kubelet" / "plugins_registry" / f"{DRIVER}-reg.sock").exists()
        assert not (root / "kubelet" / "plugins" / DRIVER / "dra.sock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        kubelet.stop()
        api.stop()
