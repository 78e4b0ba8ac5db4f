"""The seed's legacy GPU-model affinity through the webhook over HTTPS: translated into the model constraint."""

from __future__ import annotations

import copy
from pathlib import Path

import httpx
import yaml
from test_webhook_https import apply_patch, post

from kubegpu.model.request import parse_pod

SEED = Path(__file__).resolve().parents[1] / "fixtures" / "seed-examples" / "legacy-alpha-affinity.yaml"


def test_legacy_affinity_seed_through_the_webhook(client: httpx.Client) -> None:
    pod = yaml.safe_load(SEED.read_text())
    pod["metadata"]["namespace"] = "team-a"
    response = post(client, "/mutate", copy.deepcopy(pod), uid="legacy-1")
    assert response["allowed"] is True, response
    patched = apply_patch(copy.deepcopy(pod), response)
    assert patched["metadata"]["annotations"]["kubegpu.io/gpu-model"] == "Tesla K80|Tesla P100"
    expr = patched["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"][0]
    assert expr["values"] == ["Tesla-K80", "Tesla-P100"]
    assert parse_pod(patched).allowed_models == frozenset({"Tesla K80", "Tesla P100"})
    assert post(client, "/validate", patched, uid="legacy-2")["allowed"] is True
