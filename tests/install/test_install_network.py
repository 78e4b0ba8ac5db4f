"""networkPolicy.enabled: kubegpu's pods admit only their metrics ports from the monitoring namespaces and the
webhook's port from the API server, evaluated with NetworkPolicy's semantics (a pod selected by any ingress
policy admits only what one of their rules admits); the policies name the ports the containers serve."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import kubernetes_validate
import pytest

from kubegpu.install.render import render
from kubegpu.install.values import ValuesError, values_from_dict

Obj = dict[str, Any]


def _selects(selector: Obj, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        have = e["key"] in labels
        ok = {"In": have and labels.get(e["key"]) in e.get("values", []),
              "NotIn": not have or labels[e["key"]] not in e.get("values", []),
              "Exists": have, "DoesNotExist": not have}[e["operator"]]
        if not ok:
            return False
    return True


@dataclass
class Source:
    ip: str
    namespace: dict[str, str] = field(default_factory=dict)  # the namespace's labels; {} = not a pod
    pod: dict[str, str] = field(default_factory=dict)


def _peer_admits(peer: Obj, src: Source, own_namespace: str) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(src.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(x) for x in block.get("except", []))
    if not src.namespace:
        return False
    if "namespaceSelector" in peer:
        ns_ok = _selects(peer["namespaceSelector"], src.namespace)
    else:
        ns_ok = src.namespace.get("kubernetes.io/metadata.name") == own_namespace
    return ns_ok and _selects(peer.get("podSelector", {}), src.pod)


def admitted(objs: list[Obj], pod_labels: dict[str, str], port: int, src: Source) -> bool:
    policies = [o for o in objs if o["kind"] == "NetworkPolicy" and "Ingress" in o["spec"]["policyTypes"]
                and _selects(o["spec"]["podSelector"], pod_labels)]
    if not policies:
        return True
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            port_ok = "ports" not in rule or any(x.get("port") in (None, port) and x.get("protocol", "TCP") == "TCP"
                                                for x in rule["ports"])
            from_ok = "from" not in rule or any(_peer_admits(peer, src, p["metadata"]["namespace"])
                                               for peer in rule["from"])
            if port_ok and from_ok:
                return True
    return False


def _pods(objs: list[Obj]) -> dict[str, tuple[dict[str, str], set[int]]]:
    """component -> (pod labels, the TCP ports its containers declare)."""
    out = {}
    for o in objs:
        if o["kind"] in ("Deployment", "DaemonSet"):
            t = o["spec"]["template"]
            ports = {p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
            out[t["metadata"]["labels"]["app.kubernetes.io/component"]] = (t["metadata"]["labels"], ports)
    return out


PROMETHEUS = Source("10.1.0.7", {"kubernetes.io/metadata.name": "monitoring"}, {"app": "prometheus"})
TENANT = Source("10.1.3.9", {"kubernetes.io/metadata.name": "team-a"}, {"app": "job"})
API_SERVER = Source("172.16.0.10")


def test_off_by_default() -> None:
    assert not [o for o in render(values_from_dict({})) if o["kind"] == "NetworkPolicy"]


def test_metrics_only_from_monitoring_and_the_webhook_from_anywhere_without_cidrs() -> None:
    objs = render(values_from_dict({"networkPolicy": {"enabled": True}}))
    pods = _pods(objs)
    assert set(pods) == {"node", "scheduler", "webhook"}
    for component, (labels, ports) in pods.items():
        assert ports, component
        for port in ports:
            assert admitted(objs, labels, port, PROMETHEUS), (component, port)
            # Without apiServerCIDRs the webhook's port stays open: the API server may come from anywhere.
            assert admitted(objs, labels, port, TENANT) == (component == "webhook"), (component, port)
        assert not admitted(objs, labels, 12345, PROMETHEUS), component  # every other port is closed
    node_labels = pods["node"][0]
    assert admitted(objs, node_labels, 9400, PROMETHEUS) and not admitted(objs, node_labels, 9400, API_SERVER)


def test_api_server_cidrs_close_the_webhook_to_tenants() -> None:
    objs = render(values_from_dict({"networkPolicy": {"enabled": True, "apiServerCIDRs": ["172.16.0.0/24"]}}))
    labels, (port,) = _pods(objs)["webhook"]
    assert admitted(objs, labels, port, API_SERVER)
    assert admitted(objs, labels, port, PROMETHEUS)  # /metrics is served on the same port
    assert not admitted(objs, labels, port, TENANT)
    assert not admitted(objs, labels, port, Source("172.16.1.10"))


def test_selectors_and_ports_follow_the_values() -> None:
    objs = render(values_from_dict({"mode": "node-only", "metricsPort": 9500, "networkPolicy": {
        "enabled": True, "metricsNamespaceSelector": {"matchLabels": {"team": "obs"}},
        "metricsPodSelector": {"matchLabels": {"app": "vmagent"}}}}))
    labels, ports = _pods(objs)["node"]
    assert ports == {9500}
    vmagent = Source("10.1.0.8", {"team": "obs"}, {"app": "vmagent"})
    assert admitted(objs, labels, 9500, vmagent)
    assert not admitted(objs, labels, 9500, PROMETHEUS)  # monitoring is no longer named
    assert not admitted(objs, labels, 9500, Source("10.1.0.8", {"team": "obs"}, {"app": "other"}))
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "NetworkPolicy"} == {
        "kubegpu-default-deny", "kubegpu-node-metrics"}


@pytest.mark.parametrize("release", ["1.25", "1.30", "1.37"])
def test_policies_validate_against_the_release_schema(release: str) -> None:
    objs = render(values_from_dict({"kubeVersion": release, "networkPolicy": {
        "enabled": True, "apiServerCIDRs": ["172.16.0.0/24", "fd00::/64"]}}))
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert len(policies) == 4
    for o in policies:
        kubernetes_validate.validate(o, f"{release}.0", strict=True)


def test_a_bad_cidr_is_refused() -> None:
    with pytest.raises(ValuesError, match="apiServerCIDRs"):
        values_from_dict({"networkPolicy": {"enabled": True, "apiServerCIDRs": ["10.0.0.0/33"]}})
