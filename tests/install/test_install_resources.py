"""One source for resource names: the MIG table and the values' renames drive the extender, webhook and CLI."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.install.render import render, scheduler_config
from kubegpu.install.values import ValuesError, values_from_dict
from kubegpu.inventory.fake import FakeBackend
from kubegpu.model import resources as R
from kubegpu.model.normalise import AdmissionPolicy, review_pod
from kubegpu.model.request import parse_pod
from kubegpu.node.config import load_config
from kubegpu.node.deviceplugin.resources import expand

# Extended resource names: a DNS-subdomain prefix and a qualified-name part (what the API server accepts).
RESOURCE_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
SEED_RENAMES = ("version: v1\nkubegpu:\n  resourceConfig: ['mig-3g.20gb:small:2', 'gpu:sharedgpu:4']\n"
                "  sharedSlots: 0\n")


def _managed(raw: dict[str, Any]) -> set[str]:
    ext, _binder = scheduler_config(values_from_dict(raw))["extenders"]
    return {m["name"] for m in ext["managedResources"]}


def test_the_table_covers_every_current_data_centre_gpu() -> None:
    names = R.mig_resources()
    for wanted in ("nvidia.com/mig-4g.20gb", "nvidia.com/mig-1g.5gb.me", "nvidia.com/mig-1g.6gb",
                   "nvidia.com/mig-2g.12gb.me", "nvidia.com/mig-4g.24gb", "nvidia.com/mig-7g.94gb",
                   "nvidia.com/mig-3g.47gb", "nvidia.com/mig-7g.141gb", "nvidia.com/mig-1g.18gb.me",
                   "nvidia.com/mig-7g.180gb", "nvidia.com/mig-1g.23gb-me", "nvidia.com/mig-1g.23gb.me.all",
                   "nvidia.com/mig-7g.144gb", "nvidia.com/mig-7g.96gb"):
        assert wanted in names
    for gpu, profiles in R.MIG_PROFILE_TABLE.items():
        assert profiles, gpu
        for p in profiles:
            assert R.MIG_PROFILE_RE.match(p), p
    for n in names:
        assert RESOURCE_RE.match(n), n
        assert R.is_mig_resource(n) and R.is_gpu_resource(n), n


def test_the_table_drives_the_extenders_managed_resources() -> None:
    managed = _managed({})
    assert set(R.mig_resources()) <= managed
    assert {"nvidia.com/gpu", R.GPU_CORE, R.GPU_MEMORY, R.GPU_MEMORY_RATIO, R.GPU_SLOTS} <= managed
    assert "nvidia.com/mig-1g.30gb" in _managed({"migProfiles": ["1g.30gb"]})
    with pytest.raises(ValuesError, match="migProfiles: '1g30'"):
        values_from_dict({"migProfiles": ["1g30"]})


def test_the_names_the_node_serves_for_mig_are_in_the_table() -> None:
    inv = FakeBackend("a100-mig").discover()
    served = {p.name for p in expand(inv, config=load_config(flags={"mig-strategy": "mixed"}))}
    mig = {n for n in served if n.startswith(R.NVIDIA_MIG_PREFIX)}
    assert mig and mig <= set(R.mig_resources())


def test_renamed_resources_from_the_values_reach_every_role() -> None:
    objs = render(values_from_dict({"config": {"map": {"default": SEED_RENAMES}}}))
    envs = {}
    for o in objs:
        if o["kind"] in ("Deployment", "DaemonSet"):
            for c in o["spec"]["template"]["spec"]["containers"]:
                envs[c["name"]] = {e["name"]: e.get("value") for e in c.get("env", [])}
    for role in ("node", "extender", "webhook"):
        assert envs[role][R.GPU_RESOURCES_ENV] == "nvidia.com/sharedgpu,nvidia.com/small", role
    assert R.GPU_RESOURCES_ENV not in envs["kube-scheduler"]
    assert {"nvidia.com/small", "nvidia.com/sharedgpu"} <= _managed({"config": {"map": {"default": SEED_RENAMES}}})
    assert "nvidia.com/small" in _managed({"gpuResources": ["nvidia.com/small"]})


def test_a_bad_config_map_entry_is_refused_at_render_time() -> None:
    with pytest.raises(ValuesError, match=r"config.map.default: .*migStrategy"):
        values_from_dict({"config": {"map": {"default": "version: v1\nflags:\n  migStrategy: both\n"}}})


def _small_pod() -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "a"},
            "spec": {"containers": [{"name": "c", "image": "cuda",
                                     "resources": {"limits": {"nvidia.com/small": "1"}}}]}}


def test_declared_names_are_gpu_resources_to_the_parser_webhook_and_check(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Any) -> None:
    monkeypatch.setenv(R.GPU_RESOURCES_ENV, "nvidia.com/small")  # read by the roles' entries only
    assert not parse_pod(_small_pod()).wants_gpu
    declared = R.declared_gpu_resources({R.GPU_RESOURCES_ENV: "nvidia.com/sharedgpu, nvidia.com/small"})
    assert declared == {"nvidia.com/sharedgpu", "nvidia.com/small"}
    assert parse_pod(_small_pod(), replica_resources=declared).wants_gpu
    review = review_pod(_small_pod(), AdmissionPolicy(replica_resources=declared))
    assert review.gpu_pod and review.allowed
    assert {"op": "add", "path": "/spec/tolerations",
            "value": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]} in review.patch
    pod = tmp_path / "pod.yaml"
    pod.write_text(yaml.safe_dump(_small_pod()))
    result = CliRunner().invoke(app, ["check", str(pod), "--json"],
                                env={R.GPU_RESOURCES_ENV: "nvidia.com/small"})
    assert result.exit_code == 0, result.output
    (obj,) = json.loads(result.stdout)["objects"]
    assert obj["gpu"] is True and obj["containers"][0]["resource"] == "nvidia.com/small"


def test_check_takes_the_names_from_the_values(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(R.GPU_RESOURCES_ENV, raising=False)
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"config": {"map": {"default": SEED_RENAMES}}}))
    pod = tmp_path / "pod.yaml"
    pod.write_text(yaml.safe_dump(_small_pod()))
    result = CliRunner().invoke(app, ["check", str(pod), "--json", "--values", str(values)])
    assert result.exit_code == 0, result.output
    (obj,) = json.loads(result.stdout)["objects"]
    assert obj["gpu"] is True and obj["containers"][0]["resource"] == "nvidia.com/small"
    bad = tmp_path / "bad.yaml"
    bad.write_text("config: {default: x, map: {a: 'version: v1'}}\n")
    result = CliRunner().invoke(app, ["check", str(pod), "--values", str(bad)])
    assert result.exit_code == 2 and "config.default: 'x' is not an entry" in " ".join(result.output.split())
