"""The webhook's install (``kubegpu manifests``, from ``kubegpu/install/base/webhook``): schema-valid objects
that fit together, the failure policy and timeouts chosen,
flags the command accepts, and matchConditions that never hide a pod the webhook would act on."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.install.render import webhook_objects
from kubegpu.install.values import Values
from kubegpu.model.normalise import review_pod

CASES = yaml.safe_load((Path(__file__).parent / "admission_cases.yaml").read_text())


def objects() -> list[dict[str, Any]]:
    return webhook_objects(Values())


def by_kind(kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objects() if o["kind"] == kind]
    return obj


def test_core_objects_validate_against_the_kubernetes_schema() -> None:
    checked = 0
    for obj in objects():
        if obj["apiVersion"].startswith("cert-manager.io/"):
            continue
        kubernetes_validate.validate(obj, "1.33", strict=True)
        checked += 1
    assert checked == 6  # ServiceAccount, Deployment, PDB, Service, two configurations


@pytest.mark.parametrize("kind", ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"])
def test_configurations(kind: str) -> None:
    cfg = by_kind(kind)
    (hook,) = cfg["webhooks"]
    assert hook["admissionReviewVersions"] == ["v1"] and hook["sideEffects"] == "None"
    assert hook["failurePolicy"] == "Fail" and hook["timeoutSeconds"] == 5
    service = by_kind("Service")
    ref = hook["clientConfig"]["service"]
    assert (ref["name"], ref["namespace"]) == (service["metadata"]["name"], service["metadata"]["namespace"])
    assert ref["port"] == service["spec"]["ports"][0]["port"]
    assert ref["path"] == ("/mutate" if kind.startswith("Mutating") else "/validate")
    if kind.startswith("Mutating"):
        assert hook["reinvocationPolicy"] == "IfNeeded"
    excluded = [e for e in hook["namespaceSelector"]["matchExpressions"]
                if e["key"] == "kubernetes.io/metadata.name"]
    assert set(excluded[0]["values"]) >= {"kube-system", service["metadata"]["namespace"]}
    assert "objectSelector" not in hook
    cert = by_kind("Certificate")
    assert cfg["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        f"{cert['metadata']['namespace']}/{cert['metadata']['name']}"


def test_deployment_serves_the_certificate_secret_with_flags_the_command_has() -> None:
    deployment, cert = by_kind("Deployment"), by_kind("Certificate")
    spec = deployment["spec"]["template"]["spec"]
    assert spec["volumes"][0]["secret"]["secretName"] == cert["spec"]["secretName"]
    (container,) = spec["containers"]
    assert container["args"][0] == "webhook"
    help_text = CliRunner().invoke(app, ["webhook", "--help"], env={"COLUMNS": "200"}).output
    for arg in container["args"][1:]:
        assert arg.split("=")[0] in help_text
    svc = by_kind("Service")
    assert svc["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["replicas"] >= 2


def match_condition(kind: str) -> Any:
    (hook,) = by_kind(kind)["webhooks"]
    # The pod-content condition (the other one leaves kubegpu's own accounts to the admission policy).
    cond = next(c for c in hook["matchConditions"] if c["name"] == "concerns-gpus")
    env = celpy.Environment()
    return env.program(env.compile(cond["expression"]))


def case_pod(case: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": case["id"], "namespace": "team-a"}
    if "annotations" in case:
        meta["annotations"] = case["annotations"]
    spec: dict[str, Any] = {"containers": copy.deepcopy(case["containers"])}
    for key in ("initContainers", "tolerations"):
        if key in case:
            spec[key] = copy.deepcopy(case[key])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


@pytest.mark.parametrize("kind", ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"])
def test_match_conditions_send_every_pod_the_webhook_acts_on(kind: str) -> None:
    program = match_condition(kind)
    sent = skipped = 0
    for case in CASES:
        pod = case_pod(case)
        review = review_pod(pod)
        acts = bool(review.patch) or not review.allowed
        activation = {"object": celpy.json_to_cel(pod),
                      "request": celpy.json_to_cel({"subResource": "", "operation": "CREATE"})}
        matched = bool(program.evaluate(activation))
        if acts:
            assert matched, case["id"]
        sent += matched
        skipped += not matched
    assert sent and skipped  # plain pods are not sent at all

