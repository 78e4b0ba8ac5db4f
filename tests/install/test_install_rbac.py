"""The rendered RBAC grants each role exactly the verbs its code calls, and the policies narrow them.

Two independent sources are compared with the rendered ClusterRoles: the table below (what each role is
meant to do, reviewed by hand) and a scan of each role's source for the API calls it makes (so a new call
without a grant, or a grant nobody calls any more, fails here).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kubegpu.install.render import render
from kubegpu.install.values import Values, values_from_dict

SRC = Path(__file__).resolve().parents[2] / "src" / "kubegpu"

# role -> {(apiGroup, resource): verbs}
TABLE: dict[str, dict[tuple[str, str], set[str]]] = {
    "kubegpu-node": {
        ("", "nodes"): {"get", "patch"},
        ("", "nodes/status"): {"patch"},
        ("", "pods"): {"list", "watch", "patch"},
        ("", "events"): {"create"},
        ("kubegpu.io", "devices"): {"get", "create", "update"},
    },
    "kubegpu-scheduler-extender": {
        ("", "pods"): {"get", "list", "watch"},
        ("", "pods/binding"): {"create"},
        ("", "nodes"): {"list", "watch"},
        ("kubegpu.io", "devices"): {"list", "watch"},
    },
}
DRA_TABLE: dict[str, dict[tuple[str, str], set[str]]] = {
    "kubegpu-dra-node": {
        ("resource.k8s.io", "resourceclaims"): {"get"},
        ("resource.k8s.io", "resourceslices"): {"list", "watch", "create", "update", "delete"},
        ("", "nodes"): {"get"},  # its Node's UID, the slices' owner reference
    },
}
# The DRA driver (node/dra) runs under its own service account, rendered only with --dra.
ROLE_SOURCES = {"kubegpu-node": ["node"], "kubegpu-scheduler-extender": ["scheduler"],
                "kubegpu-dra-node": ["node/dra"]}
EXCLUDED_SOURCES = {"kubegpu-node": ["node/dra"]}
KINDS = {"Node": ("", "nodes"), "Node.Status": ("", "nodes/status"), "Pod": ("", "pods"), "SlimPod": ("", "pods"),
         "HandoffPod": ("", "pods"), "Device": ("kubegpu.io", "devices"), "Event": ("", "events"),
         "Pod.Binding": ("", "pods/binding"),
         "ResourceClaim": ("resource.k8s.io", "resourceclaims"),
         "ResourceSlice": ("resource.k8s.io", "resourceslices")}
VERB = {"get": "get", "list": "list", "watch": "watch", "patch": "patch", "create": "create", "replace": "update",
        "delete": "delete"}
CALL = re.compile(r"client\.(get|list|watch|patch|create|replace|delete)\(\s*([A-Z]\w*(?:\.[A-Z]\w*)?)\b")
INFORMER = re.compile(r"\b(?:Informer|InformerThread)\(\s*[\w.]+,\s*([A-Z]\w*)\b")
HELPERS = {  # kube/writes.py helpers -> what they call
    "emit_event(": [("create", "Event")], "aemit_event(": [("create", "Event")],
    "bind_pod(": [("create", "Pod.Binding")], "abind_pod(": [("create", "Pod.Binding")],
}


def called(role: str) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}

    def add(verb: str, kind: str) -> None:
        out.setdefault(KINDS[kind], set()).add(VERB[verb])

    for sub in ROLE_SOURCES[role]:
        for path in sorted((SRC / sub).rglob("*.py")):
            if any(path.is_relative_to(SRC / ex) for ex in EXCLUDED_SOURCES.get(role, ())):
                continue
            text = path.read_text()
            for verb, kind in CALL.findall(text):
                add(verb, kind)
            for kind in INFORMER.findall(text):
                add("list", kind)
                add("watch", kind)
            for helper, calls in HELPERS.items():
                if re.search(rf"(?<![\w.]){re.escape(helper)}", text) and f"def {helper}" not in text:
                    for verb, kind in calls:
                        add(verb, kind)
    return out


def rendered_roles(v: Values) -> dict[str, dict[tuple[str, str], set[str]]]:
    roles: dict[str, dict[tuple[str, str], set[str]]] = {}
    for o in render(v):
        if o["kind"] != "ClusterRole":
            continue
        rules: dict[tuple[str, str], set[str]] = {}
        for r in o["rules"]:
            assert "resourceNames" not in r or r["resourceNames"]
            for g in r["apiGroups"]:
                for res in r["resources"]:
                    rules.setdefault((g, res), set()).update(r["verbs"])
        roles[o["metadata"]["name"]] = rules
    return roles


def test_rendered_rbac_is_the_table() -> None:
    assert rendered_roles(Values()) == TABLE


def test_rendered_dra_rbac_is_the_table() -> None:
    from kubegpu.install.dra import apply_dra

    v = Values()
    roles: dict[str, dict[tuple[str, str], set[str]]] = {}
    for o in apply_dra(render(v), v):
        if o["kind"] == "ClusterRole" and o["metadata"]["name"] in DRA_TABLE:
            for r in o["rules"]:
                for g in r["apiGroups"]:
                    for res in r["resources"]:
                        roles.setdefault(o["metadata"]["name"], {}).setdefault((g, res), set()).update(r["verbs"])
    assert roles == DRA_TABLE


@pytest.mark.parametrize("role", sorted({**TABLE, **DRA_TABLE}))
def test_the_table_is_what_the_code_calls(role: str) -> None:
    assert called(role) == {**TABLE, **DRA_TABLE}[role]


def test_the_scan_sees_a_call_the_table_lacks(tmp_path: Path) -> None:
    """The scan is not vacuous: the extender's code calls get on pods, which only the table grants."""
    assert "get" in called("kubegpu-scheduler-extender")[("", "pods")]
    assert "patch" not in called("kubegpu-scheduler-extender")[("", "pods")]


def test_extender_and_kube_scheduler_do_not_share_an_identity() -> None:
    objs = render(Values())
    dep = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "kubegpu-scheduler")
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kubegpu-scheduler-extender"
    assert pod["automountServiceAccountToken"] is False
    containers = {c["name"]: c for c in pod["containers"]}
    mounts = {c: {m["name"] for m in containers[c].get("volumeMounts", [])} for c in containers}
    assert "extender-token" in mounts["extender"] and "extender-token" not in mounts["kube-scheduler"]
    assert "kube-scheduler-token" in mounts["kube-scheduler"] and "kube-scheduler-token" not in mounts["extender"]
    bindings = [o for o in objs if o["kind"] in ("ClusterRoleBinding", "RoleBinding")]
    for b in bindings:
        names = {s["name"] for s in b["subjects"]}
        if b["roleRef"]["name"] in ("system:kube-scheduler", "system:volume-scheduler"):
            assert names == {"kubegpu-kube-scheduler"}
        if b["roleRef"]["name"] == "kubegpu-scheduler-extender":
            assert names == {"kubegpu-scheduler-extender"}
    # The extender listens on loopback only; kube-scheduler reaches it inside the pod.
    args = containers["extender"]["args"]
    assert args[args.index("--listen") + 1].startswith("127.0.0.1:")


def test_every_workload_has_a_tight_security_context() -> None:
    for o in render(Values()):
        if o["kind"] not in ("Deployment", "DaemonSet"):
            continue
        pod = o["spec"]["template"]["spec"]
        for c in pod["containers"]:
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True
            assert ctx["capabilities"]["drop"] == ["ALL"]
            seccomp = ctx.get("seccompProfile") or pod.get("securityContext", {}).get("seccompProfile")
            assert seccomp == {"type": "RuntimeDefault"}, (o["metadata"]["name"], c["name"])
            if o["kind"] == "DaemonSet":
                assert "add" not in ctx["capabilities"]  # migStrategy none: no SYS_ADMIN
            else:
                assert pod["securityContext"]["runAsNonRoot"] is True


def test_policies_are_rendered_from_1_30_only() -> None:
    def kinds(version: str) -> set[str]:
        return {o["kind"] for o in render(values_from_dict({"kubeVersion": version}))}
    assert {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} <= kinds("1.30")
    assert "ValidatingAdmissionPolicy" not in kinds("1.29")
    names = {o["metadata"]["name"] for o in render(values_from_dict({"mode": "node-only"}))
             if o["kind"] == "ValidatingAdmissionPolicy"}
    assert names == {"kubegpu-node-restriction"}


def test_the_webhook_trusts_the_record_writers_the_policy_admits() -> None:
    objs = render(values_from_dict({"fullnameOverride": "gpu-plugin", "namespace": "gpu"}))
    dep = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "kubegpu-webhook")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    writers = {a.split("=", 1)[1] for a in args if a.startswith("--record-writer=")}
    assert writers == {"system:serviceaccount:gpu:gpu-plugin", "system:serviceaccount:gpu:kubegpu-scheduler-extender"}
    (policy,) = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"
                 and o["metadata"]["name"] == "kubegpu-record-writers"]
    text = str(policy["spec"]["validations"])
    assert all(w in text for w in writers)
    sas = {o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"}
    assert {w.rsplit(":", 1)[1] for w in writers} <= sas


# --- what the policies allow, evaluated as the API server would -----------------------------------------

def _policy(name: str) -> dict:
    return next(o for o in render(Values()) if o["kind"] == "ValidatingAdmissionPolicy"
                and o["metadata"]["name"] == name)


def _admits(policy: dict, request: dict) -> bool:
    """matchConditions, then every validation, with celpy (the semantics of the API server's CEL)."""
    import celpy

    env = celpy.Environment()

    def run(text: str, act: dict) -> object:
        return env.program(env.compile(text)).evaluate(act)

    act = {"request": celpy.json_to_cel({k: v for k, v in request.items() if k not in ("object", "oldObject")}),
           "object": celpy.json_to_cel(request.get("object")), "oldObject": celpy.json_to_cel(request.get("oldObject"))}
    spec = policy["spec"]
    if not all(bool(run(c["expression"], act)) for c in spec.get("matchConditions", [])):
        return True
    bound: dict = {}
    for var in spec.get("variables", []):
        bound[var["name"]] = run(var["expression"], {**act, "variables": celpy.celtypes.MapType(bound)})
    act["variables"] = celpy.celtypes.MapType(bound)
    return all(bool(run(v["expression"], act)) for v in spec["validations"])


def _pod(node: str, **ann: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "a", "annotations": ann},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]}}


def _req(user: str, op: str, resource: str, obj: dict | None, old: dict | None, node: str = "node-a",
         sub: str = "") -> dict:
    r = {"uid": "1", "operation": op, "kind": {"group": "", "version": "v1", "kind": "Pod"},
         "resource": {"group": "kubegpu.io" if resource == "devices" else "", "version": "v1", "resource": resource},
         "userInfo": {"username": user, "extra": {"authentication.kubernetes.io/node-name": [node]}}}
    if sub:
        r["subResource"] = sub
    if obj is not None:
        r["object"] = obj
    if old is not None:
        r["oldObject"] = old
    return r


NODE_SA = "system:serviceaccount:kubegpu-system:kubegpu-node"
EXT_SA = "system:serviceaccount:kubegpu-system:kubegpu-scheduler-extender"


def test_the_node_daemon_writes_only_its_own_node_device_and_pods() -> None:
    p = _policy("kubegpu-node-restriction")
    old = _pod("node-a", **{"kubegpu.io/device-allocated": "r"})
    ack = _pod("node-a", **{"kubegpu.io/device-allocated": "r", "kubegpu.io/device-assigned": "x",
                            "kubegpu.io/device-assigned-signature": "s"})
    assert _admits(p, _req(NODE_SA, "UPDATE", "pods", ack, old))
    other = _pod("node-b", **{"kubegpu.io/device-allocated": "r"})
    assert not _admits(p, _req(NODE_SA, "UPDATE", "pods", {**ack, "spec": other["spec"]}, other))
    forged = _pod("node-a", **{"kubegpu.io/device-allocated": "forged"})
    assert not _admits(p, _req(NODE_SA, "UPDATE", "pods", forged, old))
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a", "labels": {"a": "1"}}, "spec": {}}
    labelled = {**node, "metadata": {"name": "node-a", "labels": {"a": "1", "nvidia.com/gpu.count": "8"},
                                     "annotations": {"kubegpu.io/gpu-resources": "nvidia.com/gpu"}}}
    assert _admits(p, _req(NODE_SA, "UPDATE", "nodes", labelled, node))
    assert not _admits(p, _req(NODE_SA, "UPDATE", "nodes", labelled, node, node="node-b"))
    tainted = {**node, "spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}}
    assert not _admits(p, _req(NODE_SA, "UPDATE", "nodes", tainted, node))
    role = {**node, "metadata": {"name": "node-a", "labels": {"a": "1", "node-role.kubernetes.io/control-plane": ""}}}
    assert not _admits(p, _req(NODE_SA, "UPDATE", "nodes", role, node))
    assert _admits(p, _req(NODE_SA, "UPDATE", "nodes", tainted, node, sub="status"))  # status: name only
    dev = {"apiVersion": "kubegpu.io/v1alpha1", "kind": "Device", "metadata": {"name": "node-a"}}
    assert _admits(p, _req(NODE_SA, "CREATE", "devices", dev, None))
    assert not _admits(p, _req(NODE_SA, "CREATE", "devices", {**dev, "metadata": {"name": "node-b"}}, None))
    no_name = _req(NODE_SA, "UPDATE", "pods", ack, old)
    no_name["userInfo"] = {"username": NODE_SA}
    assert not _admits(p, no_name)  # a token without the node name: refused
    assert _admits(p, _req("system:serviceaccount:x:y", "UPDATE", "nodes", tainted, node))  # others: not this policy


def test_only_kubegpu_writes_the_records() -> None:
    p = _policy("kubegpu-record-writers")
    rec = {"kubegpu.io/device-allocated": "r", "kubegpu.io/device-allocated-signature": "s"}
    assert not _admits(p, _req("alice", "CREATE", "pods", _pod("", **rec), None))
    assert _admits(p, _req("alice", "CREATE", "pods", _pod(""), None))
    assert _admits(p, _req("alice", "UPDATE", "pods", _pod("n", **rec, team="x"), _pod("n", **rec)))  # unchanged
    assert not _admits(p, _req("alice", "UPDATE", "pods", _pod("n", **{**rec, "kubegpu.io/device-allocated": "f"}),
                               _pod("n", **rec)))
    assert not _admits(p, _req("alice", "UPDATE", "pods", _pod("n"), _pod("n", **rec)))  # removal too
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p", "annotations": rec}}
    assert _admits(p, _req(EXT_SA, "CREATE", "pods", binding, None, sub="binding"))
    assert not _admits(p, _req(NODE_SA, "CREATE", "pods", binding, None, sub="binding"))
    ack = {"kubegpu.io/device-assigned": "a", "kubegpu.io/device-assigned-signature": "s"}
    assert _admits(p, _req(NODE_SA, "UPDATE", "pods", _pod("n", **rec, **ack), _pod("n", **rec)))
    assert not _admits(p, _req(EXT_SA, "UPDATE", "pods", _pod("n", **rec, **ack), _pod("n", **rec)))


def test_share_pods_are_created_only_for_kubegpus_scheduler_to_place() -> None:
    """What the webhook refuses and steers, held while it is down: a pod asking a GPU share is created only
    without a node and for kubegpu's scheduler; pods without a share are not this policy's."""
    p = _policy("kubegpu-share-placement")

    def pod(limits: dict[str, str], *, init: bool = False, **spec: str) -> dict:
        c = {"name": "c", "image": "x", "resources": {"limits": limits}}
        body: dict = {"containers": [c], **spec}
        if init:  # the share asked by an init container, the app container asking nothing
            body = {"containers": [{"name": "main", "image": "x"}], "initContainers": [c], **spec}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "a"}, "spec": body}

    share = {"kubegpu.io/gpu-core": "25", "kubegpu.io/gpu-memory-ratio": "25", "kubegpu.io/gpu.shared": "1"}
    placed = pod(share, schedulerName="kubegpu-scheduler")
    assert _admits(p, _req("alice", "CREATE", "pods", placed, None))
    assert not _admits(p, _req("alice", "CREATE", "pods", pod(share, schedulerName="default-scheduler"), None))
    assert not _admits(p, _req("alice", "CREATE", "pods", pod(share), None))  # no scheduler name at all
    assert not _admits(p, _req("alice", "CREATE", "pods", pod(share, schedulerName="kubegpu-scheduler",
                                                              nodeName="node-a"), None))
    assert not _admits(p, _req("alice", "CREATE", "pods", pod({"kubegpu.io/gpu.shared": "1"}, init=True,
                                                              schedulerName="volcano"), None))
    untranslated = pod({"kubegpu.io/gpu-core": "50"}, schedulerName="default-scheduler")  # the webhook was down
    assert not _admits(p, _req("alice", "CREATE", "pods", untranslated, None))
    # Whole GPUs (served without a record when free) and plain pods: any scheduler, any node.
    assert _admits(p, _req("alice", "CREATE", "pods", pod({"nvidia.com/gpu": "1"}, nodeName="node-a",
                                                          schedulerName="volcano"), None))
    assert _admits(p, _req("alice", "CREATE", "pods", pod({"cpu": "1"}, nodeName="node-a"), None))
    names = {o["metadata"]["name"] for o in render(values_from_dict({"scheduler": {"schedulerName": ""}}))
             if o["kind"] == "ValidatingAdmissionPolicy"}
    assert "kubegpu-share-placement" not in names  # no scheduler of kubegpu's to name


def test_the_record_key_reaches_the_signers_in_full_mode_only() -> None:
    def key_env(mode: str) -> dict[str, dict]:
        out = {}
        for o in render(values_from_dict({"mode": mode})):
            if o["kind"] in ("Deployment", "DaemonSet"):
                for c in o["spec"]["template"]["spec"]["containers"]:
                    for e in c.get("env", []):
                        if e["name"] == "KUBEGPU_RECORD_KEY":
                            out[c["name"]] = e["valueFrom"]["secretKeyRef"]
        return out

    full = key_env("full")
    assert set(full) == {"node", "extender"}
    # Required: a full install never runs with unsigned records (the pods wait for the Secret instead).
    assert all(ref == {"name": "kubegpu-record-key", "key": "key", "optional": False} for ref in full.values())
    assert key_env("node-only") == {}
