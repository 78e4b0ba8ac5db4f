"""The legacy ``scheduler.alpha.kubernetes.io/affinity`` GPU-model choice, translated at admission and shown
by ``kubegpu check`` (the seed example ``legacy-alpha-affinity.yaml``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonpatch
import pytest
import yaml
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.inventory.topology import load_topology
from kubegpu.model.legacy import LEGACY_AFFINITY, LegacyAffinityError, label_value, translate
from kubegpu.model.normalise import review_pod
from kubegpu.model.request import parse_pod
from kubegpu.node.config import load_config
from kubegpu.node.publish.labels import gpu_labels, is_valid_label_value

SEED = Path(__file__).resolve().parents[1] / "fixtures" / "seed-examples" / "legacy-alpha-affinity.yaml"
KEY = "alpha.kubernetes.io/nvidia-gpu-name"


def _seed() -> dict:
    return yaml.safe_load(SEED.read_text())


def _legacy_pod(legacy: object, **spec: object) -> dict:
    pod = _seed()
    pod["metadata"]["annotations"][LEGACY_AFFINITY] = legacy if isinstance(legacy, str) else json.dumps(legacy)
    pod["spec"].update(spec)
    return pod


def _term(*exprs: dict) -> dict:
    return {"matchExpressions": list(exprs)}


def _aff(*terms: dict) -> dict:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


def test_the_seed_is_translated_into_the_model_constraint_and_spec_affinity() -> None:
    pod = _seed()
    review = review_pod(pod)
    assert review.allowed and review.gpu_pod
    patched = jsonpatch.apply_patch(copy.deepcopy(pod), list(review.patch))
    assert patched["metadata"]["annotations"]["kubegpu.io/gpu-model"] == "Tesla K80|Tesla P100"
    (term,) = patched["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": KEY, "operator": "In", "values": ["Tesla-K80", "Tesla-P100"]}]
    assert parse_pod(patched).allowed_models == frozenset({"Tesla K80", "Tesla P100"})
    assert any("GPU models Tesla K80, Tesla P100" in w for w in review.warnings)
    # Idempotent: a second review (reinvocation) adds nothing more.
    assert not [op for op in review_pod(patched).patch if op["path"] in ("/spec/affinity",
                                                                         "/metadata/annotations/kubegpu.io~1gpu-model")]


def test_the_extender_sees_the_constraint_even_without_the_webhook() -> None:
    assert parse_pod(_seed()).allowed_models == frozenset({"Tesla K80", "Tesla P100"})


def test_the_node_publishes_the_label_the_translation_selects() -> None:
    labels = gpu_labels(load_topology("dgx1-v100").inventory, load_config())
    assert labels[KEY] == label_value(load_topology("dgx1-v100").inventory.gpus[0].model)
    assert is_valid_label_value(labels[KEY]) and " " not in labels[KEY]
    assert label_value("Tesla K80") == "Tesla-K80" and label_value("NVIDIA A100-SXM4-80GB (rev 2)") == \
        "NVIDIA-A100-SXM4-80GB-rev-2"


@pytest.mark.parametrize(("terms", "models"), [
    ((_term({"key": KEY, "operator": "In", "values": ["A"]}), _term({"key": KEY, "operator": "In",
                                                                      "values": ["B"]})), {"A", "B"}),
    ((_term({"key": KEY, "operator": "In", "values": ["A", "B"]},
            {"key": KEY, "operator": "In", "values": ["B", "C"]}),), {"B"}),
    ((_term({"key": KEY, "operator": "In", "values": ["A"]}), _term({"key": "zone", "operator": "In",
                                                                      "values": ["z"]})), None),
    ((_term({"key": KEY, "operator": "NotIn", "values": ["A"]}),), None),
])
def test_terms_are_ored_and_expressions_anded(terms: tuple, models: set | None) -> None:
    t = translate(json.dumps(_aff(*terms)))
    assert t.models == (frozenset(models) if models is not None else None)


def test_an_existing_spec_affinity_is_kept_and_said_so() -> None:
    mine = _aff(_term({"key": "zone", "operator": "In", "values": ["z"]}))
    review = review_pod(_legacy_pod(_aff(_term({"key": KEY, "operator": "In", "values": ["Tesla K80"]})),
                                    affinity=mine))
    assert review.allowed and not [op for op in review.patch if op["path"] == "/spec/affinity"]
    assert any("spec.affinity is set" in w for w in review.warnings)
    assert {"op": "add", "path": "/metadata/annotations/kubegpu.io~1gpu-model", "value": "Tesla K80"} in review.patch


@pytest.mark.parametrize(("value", "reason"), [
    ("{not json", "is not valid JSON"),
    ("[1]", "must be an Affinity object"),
    (json.dumps({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": 5}}}),
     "nodeSelectorTerms must be a list"),
    (json.dumps(_aff(_term({"key": KEY, "operator": "In", "values": ["A"]},
                           {"key": KEY, "operator": "In", "values": ["B"]}))), "allow no GPU model"),
    ("[" * 100000, "must be a JSON object of at most 64 KiB"),
])
def test_untranslatable_annotations_are_refused_with_the_reason(value: str, reason: str) -> None:
    review = review_pod(_legacy_pod(value))
    assert not review.allowed
    (refusal,) = review.refusals
    assert reason in str(refusal) and LEGACY_AFFINITY in str(refusal)
    if reason != "allow no GPU model":
        with pytest.raises(LegacyAffinityError):
            translate(value)


def test_check_shows_the_translation() -> None:
    result = CliRunner().invoke(app, ["check", str(SEED)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "GPU models Tesla K80, Tesla P100" in text and "kubegpu.io/gpu-model" in text
    as_json = CliRunner().invoke(app, ["check", str(SEED), "--json"])
    (obj,) = json.loads(as_json.stdout)["objects"]
    assert {"op": "add", "path": "/metadata/annotations/kubegpu.io~1gpu-model",
            "value": "Tesla K80|Tesla P100"} in obj["patch"]
