"""The NetworkPolicies docs/security.md asks for, rendered when ``networkPolicy.enabled``.

Ingress only: every kubegpu pod in the install namespace refuses connections except the metrics ports
(node daemon, extender) from the monitoring namespaces and the webhook's port from the API server. The
extender's scheduling port is kube-scheduler's loopback (same pod), which no NetworkPolicy governs; the
kubelet's probes come from the pod's own node, which NetworkPolicy always admits. Egress stays open: every
role calls the API server, whose addresses (and a managed control plane's) no selector names portably.

Off by default: a policy that names the wrong monitoring namespace silently stops every scrape, and the
API server's source addresses are the cluster's to give (with none given the webhook's port is open to
every source, as without the policy). Needs a CNI that enforces NetworkPolicy.
"""

from __future__ import annotations

from typing import Any

from kubegpu.install.values import Values

Obj = dict[str, Any]
APP = "kubegpu"
EXTENDER_METRICS_PORT = 9401  # base/scheduler/deployment.yaml --metrics-listen
WEBHOOK_PORT = 8443  # base/webhook/deployment.yaml --listen (admission reviews and /metrics)


def _labels(v: Values) -> Obj:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "network-policy",
            "app.kubernetes.io/version": v.image.tag, "app.kubernetes.io/managed-by": "kubegpu-manifests"}


def _policy(v: Values, name: str, pods: Obj, ingress: list[Obj]) -> Obj:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": v.namespace, "labels": _labels(v)},
            "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": ingress}}


def _component(c: str) -> Obj:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": c}


def _scrapers(v: Values) -> list[Obj]:
    peer: Obj = {"namespaceSelector": v.network_policy.metrics_namespace_selector}
    if v.network_policy.metrics_pod_selector:
        peer["podSelector"] = v.network_policy.metrics_pod_selector
    return [peer]


def _tcp(port: int) -> list[Obj]:
    return [{"protocol": "TCP", "port": port}]


def network_policies(v: Values) -> list[Obj]:
    """The install namespace's ingress policies (none unless ``networkPolicy.enabled``)."""
    if not v.network_policy.enabled:
        return []
    objs = [
        # Everything kubegpu runs here refuses what the policies below do not admit (DRA pods included).
        _policy(v, f"{APP}-default-deny", {"app.kubernetes.io/name": APP}, []),
        _policy(v, f"{APP}-node-metrics", _component("node"),
                [{"from": _scrapers(v), "ports": _tcp(v.metrics_port)}]),
    ]
    if v.mode == "full":
        cidrs = v.network_policy.api_server_cidrs
        # The API server calls the webhook; Prometheus reads its /metrics on the same port.
        webhook_from = ([{"ipBlock": {"cidr": c}} for c in cidrs] + _scrapers(v)) if cidrs else None
        webhook_rule: Obj = {"ports": _tcp(WEBHOOK_PORT)}
        if webhook_from is not None:
            webhook_rule["from"] = webhook_from
        objs += [
            _policy(v, f"{APP}-scheduler-metrics", _component("scheduler"),
                    [{"from": _scrapers(v), "ports": _tcp(EXTENDER_METRICS_PORT)}]),
            _policy(v, f"{APP}-webhook", _component("webhook"), [webhook_rule]),
        ]
    return objs
