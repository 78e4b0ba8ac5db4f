"""``dra.claimTemplates``: the ResourceClaimTemplates ``manifests --dra`` renders for the sizes an operator
names, valid for the API server and for kubegpu's own claim check, and every bad entry named at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.install.dra import apply_dra
from kubegpu.install.render import render
from kubegpu.install.values import ValuesError, values_from_dict
from kubegpu.node.dra.claims import claim_problems
from kubegpu_standins.dra_validation import validate

TEMPLATES = [{"name": "gpu-quarter", "namespaces": ["team-a", "team-b"], "compute": 25, "memory": "20Gi"},
             {"name": "two-gpus", "namespaces": ["training"], "gpus": 2}]


def _templates(raw: dict[str, Any]) -> list[dict[str, Any]]:
    v = values_from_dict(raw)
    return [o for o in apply_dra(render(v), v) if o["kind"] == "ResourceClaimTemplate"]


def test_each_size_is_a_template_in_each_namespace_named() -> None:
    out = _templates({"dra": {"claimTemplates": TEMPLATES}})
    assert [(o["metadata"]["namespace"], o["metadata"]["name"]) for o in out] == [
        ("team-a", "gpu-quarter"), ("team-b", "gpu-quarter"), ("training", "two-gpus")]
    share = out[0]["spec"]["spec"]["devices"]["requests"]
    assert share == [{"name": "gpu", "exactly": {"deviceClassName": "shared-gpu.kubegpu.io",
                                                 "allocationMode": "ExactCount", "count": 1,
                                                 "capacity": {"requests": {"compute": "25", "memory": "20Gi"}}}}]
    assert out[2]["spec"]["spec"]["devices"]["requests"] == [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.kubegpu.io", "allocationMode": "ExactCount", "count": 2}}]
    for o in out:
        kubernetes_validate.validate(o, "1.34.0", strict=True)
        assert validate("ResourceClaimTemplate", o) == []  # as the API server validates it
        assert claim_problems(o) == []  # as the webhook and `kubegpu check` check it
        assert o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kubegpu-manifests"


def test_no_templates_by_default() -> None:
    assert _templates({}) == []


@pytest.mark.parametrize(("entry", "problem"), [
    ({"name": "big", "namespaces": ["a"], "compute": 150, "memory": "8Gi"},
     "dra.claimTemplates[0]: capacity.requests.compute 150 must be a whole percent from 1 to 100"),
    ({"name": "tiny", "namespaces": ["a"], "compute": 10, "memory": "100Mi"},
     "dra.claimTemplates[0]: capacity.requests.memory 100Mi is below a share's minimum"),
    ({"name": "half", "namespaces": ["a"], "compute": 50},
     "dra.claimTemplates[0]: a share names both compute (percent of one GPU) and memory"),
    ({"name": "mixed", "namespaces": ["a"], "gpus": 1, "compute": 50, "memory": "8Gi"},
     "dra.claimTemplates[0]: give gpus (whole GPUs) or compute and memory (one share of a GPU), not both"),
    ({"name": "empty", "namespaces": ["a"]}, "not neither"),
    ({"name": "none", "namespaces": ["a"], "gpus": 0}, "dra.claimTemplates[0].gpus: 0 must be at least 1"),
    ({"name": "Bad_Name", "namespaces": ["a"], "gpus": 1}, "dra.claimTemplates[0].name: 'Bad_Name' is not"),
    ({"name": "x", "namespaces": ["Team A"], "gpus": 1}, "dra.claimTemplates[0].namespaces: 'Team A' is not"),
    ({"name": "x", "namespaces": [], "gpus": 1}, "dra.claimTemplates[0].namespaces: name at least one"),
    ({"name": "x", "namespaces": ["a", "a"], "gpus": 1}, "a/x is also dra.claimTemplates[0]"),
    ({"namespaces": ["a"], "gpus": 1}, "dra.claimTemplates[0]: object missing required field `name`"),
    ({"name": "x", "namespaces": ["a"], "gpus": 1, "count": 2}, "dra.claimTemplates[0]: object contains unknown "
                                                                "field `count`"),
])
def test_a_bad_entry_is_refused_naming_its_key(entry: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValuesError) as refused:
        values_from_dict({"dra": {"claimTemplates": [entry]}})
    assert any(problem in p for p in refused.value.problems), refused.value.problems


def test_every_bad_entry_is_named_at_once() -> None:
    with pytest.raises(ValuesError) as refused:
        values_from_dict({"dra": {"claimTemplates": [{"name": "a", "namespaces": ["n"], "gpus": 0},
                                                     {"name": "b", "namespaces": ["n"], "compute": 200,
                                                      "memory": "8Gi"}]}})
    assert [p.split(":")[0] for p in refused.value.problems] == ["dra.claimTemplates[0].gpus",
                                                                 "dra.claimTemplates[1]"]


def test_manifests_renders_them_from_the_values_file(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"dra": {"claimTemplates": TEMPLATES}}))
    r = CliRunner().invoke(app, ["manifests", "--dra", "-f", str(values)])
    assert r.exit_code == 0, r.output
    docs = [d for d in yaml.safe_load_all(r.stdout) if d and d.get("kind") == "ResourceClaimTemplate"]
    assert {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs} == {
        ("team-a", "gpu-quarter"), ("team-b", "gpu-quarter"), ("training", "two-gpus")}
