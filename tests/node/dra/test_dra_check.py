"""``kubegpu check`` on DRA manifests: pods with resourceClaims pass, claims naming kubegpu's classes are checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from dra_harness import fixture, strip_server
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.node.dra.claims import claim_problems


def _tpl(request: dict) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "t"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}}}


def test_recorded_claims_pass() -> None:
    for f in ("s1-resourceclaimtemplate.json", "s4-claim-slice-1.json", "s5-claim-taint-tolerate.json",
              "s6-claim.json", "s3-claim-mig-1g.json"):
        assert claim_problems(strip_server(fixture(f))) == [], f


@pytest.mark.parametrize(("request_", "message"), [
    ({"deviceClassName": "shared-gpu.kubegpu.io", "capacity": {"requests": {"compute": "150", "memory": "8Gi"}}},
     "could never be allocated"),
    ({"deviceClassName": "shared-gpu.kubegpu.io", "capacity": {"requests": {"compute": "30", "memory": "seven"}}},
     "is not a quantity"),
    ({"deviceClassName": "shared-gpu.kubegpu.io", "capacity": {"requests": {"compute": "30", "memory": "8Gi",
                                                                            "sm": "3"}}}, "only compute and memory"),
    # A capacity not named defaults to the whole GPU's (the GPU serves whole claims too).
    ({"deviceClassName": "shared-gpu.kubegpu.io", "capacity": {"requests": {"compute": "30"}}},
     "would take all of the GPU's memory"),
    ({"deviceClassName": "shared-gpu.kubegpu.io"}, "takes a whole GPU"),
    ({"deviceClassName": "gpu.kubegpu.io", "capacity": {"requests": {"compute": "30"}}}, "needs shared-gpu"),
    ({"deviceClassName": "gpus.kubegpu.io"}, "is not one kubegpu installs"),
    ({"deviceClassName": "mig-9g.99gb.kubegpu.io"}, "is not one kubegpu installs"),
    ({"deviceClassName": "gpu.kubegpu.io", "count": 0}, "at least 1"),
])
def test_claims_that_could_never_be_served_are_refused(request_: dict, message: str) -> None:
    problems = claim_problems(_tpl(request_))
    assert len(problems) == 1 and message in problems[0]


def test_other_drivers_are_left_alone() -> None:
    assert claim_problems(_tpl({"deviceClassName": "gpu.nvidia.com", "count": 0})) == []


def test_cli(tmp_path: Path) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
                    "containers": [{"name": "c", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}]}}
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump_all([pod, _tpl({"deviceClassName": "gpu.kubegpu.io", "count": 2})]))
    r = CliRunner().invoke(app, ["check", str(good)])
    assert r.exit_code == 0, r.output
    assert "DRA gpu: 2 x gpu.kubegpu.io" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_tpl({"deviceClassName": "shared-gpu.kubegpu.io",
                                        "capacity": {"requests": {"compute": "150", "memory": "8Gi"}}})))
    r = CliRunner().invoke(app, ["check", "--json", str(bad)])
    assert r.exit_code == 1
    out = json.loads(r.stdout)
    [obj] = out["objects"]
    assert obj["kind"] == "ResourceClaimTemplate" and not obj["allowed"]
    assert "could never be allocated" in obj["refusals"][0]["message"]
