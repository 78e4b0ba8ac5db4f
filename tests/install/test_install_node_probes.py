"""The node DaemonSet is scrapeable and probed: Prometheus annotations and a headless Service on the metrics
port the daemon is told to serve, and probes on the paths node/metrics.py answers (ready only once the GPUs
are served); the DRA driver's DaemonSet the same."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from kubegpu.install.dra import apply_dra
from kubegpu.install.render import render
from kubegpu.install.values import Values, ValuesError, values_from_dict
from kubegpu.node.config import load_config
from kubegpu.node.metrics import NodeMetrics, serve

Obj = dict[str, Any]


def _one(objs: list[Obj], kind: str, name: str) -> Obj:
    (o,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return o


def _node(objs: list[Obj], name: str = "kubegpu-node") -> tuple[Obj, Obj, Obj]:
    ds = _one(objs, "DaemonSet", name)
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return ds, c, _one(objs, "Service", f"{name}-metrics")


@pytest.mark.parametrize("raw", [{}, {"metricsPort": 9500, "mode": "node-only", "fullnameOverride": "gpu-plugin"}])
def test_daemonset_annotations_port_probes_and_service_agree(raw: Obj) -> None:
    v = values_from_dict(raw)
    port = v.metrics_port
    ds, c, svc = _node(render(v), v.fullname_override or "kubegpu-node")
    pod = ds["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                              "prometheus.io/path": "/metrics"}
    assert c["args"][c["args"].index("--metrics-address") + 1] == f":{port}"
    assert {"name": "metrics", "containerPort": port} in c["ports"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # Readiness is asked early; liveness gives NVML init and discovery minutes before a restart.
    assert c["readinessProbe"]["initialDelaySeconds"] <= 5
    live = c["livenessProbe"]
    assert live["initialDelaySeconds"] + live["periodSeconds"] * live["failureThreshold"] >= 120
    spec = svc["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
    assert spec["selector"].items() <= pod["metadata"]["labels"].items()
    assert spec["ports"] == [{"name": "metrics", "port": port, "targetPort": "metrics", "protocol": "TCP"}]
    assert "annotations" not in svc["metadata"]  # the pods are annotated: one scrape per node, not two


def test_pod_annotations_from_the_values_win() -> None:
    v = values_from_dict({"podAnnotations": {"prometheus.io/scrape": "false", "team": "gpu"}})
    ds, _, _ = _node(render(v))
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "false" and ann["team"] == "gpu" and ann["prometheus.io/port"] == "9400"


@pytest.mark.parametrize("port", [0, 70000])
def test_a_metrics_port_the_probes_cannot_use_is_refused(port: int) -> None:
    with pytest.raises(ValuesError, match="metricsPort"):
        values_from_dict({"metricsPort": port})


def test_the_node_commands_default_address_is_the_rendered_port() -> None:
    assert load_config().kubegpu.metrics_address == f":{Values().metrics_port}"


def test_dra_on_every_node_drops_the_scrape_service_with_the_daemonset() -> None:
    v = Values()
    objs = apply_dra(render(v), v, all_nodes=True)
    assert not [o for o in objs if o["kind"] in ("DaemonSet", "Service")
                and o["metadata"]["name"] in ("kubegpu-node", "kubegpu-node-metrics")]
    kept = apply_dra(render(v), v)
    assert _node(kept)[2]["spec"]["selector"]["app.kubernetes.io/component"] == "node"


@pytest.mark.parametrize("raw", [{}, {"metricsPort": 9500}])
def test_the_dra_daemonset_is_probed_and_scraped_as_the_device_plugin_one(raw: Obj) -> None:
    v = values_from_dict(raw)
    objs = apply_dra(render(v), v)
    _, node, _ = _node(objs)
    ds = _one(objs, "DaemonSet", "kubegpu-dra-node")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--metrics-address") + 1] == f":{v.metrics_port}"
    assert c["ports"] == [{"name": "metrics", "containerPort": v.metrics_port}]
    assert (c["readinessProbe"], c["livenessProbe"]) == (node["readinessProbe"], node["livenessProbe"])
    assert ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(v.metrics_port)


class _Daemon:
    """What the probes read, in the two states that matter to the kubelet."""

    def __init__(self, registered: bool) -> None:
        self.registered = registered

    def readiness(self) -> dict[str, str]:
        return {"kubelet:nvidia.com/gpu": "ok" if self.registered else "not registered with the kubelet"}

    def liveness(self) -> dict[str, str]:
        return {"lifecycle": "ok"}


def _get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            json.loads(r.read())
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_the_rendered_probe_paths_are_answered_by_the_node_endpoint() -> None:
    _, c, _ = _node(render(Values()))
    ready, live = c["readinessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"]
    daemon = _Daemon(registered=False)
    server, _ = serve(NodeMetrics(), 0, "127.0.0.1", daemon)
    try:
        port = server.server_port
        assert (_get(port, ready), _get(port, live)) == (503, 200)  # alive, not yet registered with the kubelet
        daemon.registered = True
        assert (_get(port, ready), _get(port, live)) == (200, 200)
    finally:
        server.shutdown()
        server.server_close()
