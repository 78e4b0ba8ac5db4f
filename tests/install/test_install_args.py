"""The flags the install passes: the webhook steers GPU pods to the profile the install names, and the
webhook and the extender cap GPU containers per pod at the same value (one values key), as each command
parses its rendered arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command

from kubegpu.cli.main import app
from kubegpu.install.render import render, scheduler_config
from kubegpu.install.values import ValuesError, values_from_dict


def _parsed(objs: list[dict], container: str, tmp_path: Path) -> dict[str, Any]:
    """The parameters ``kubegpu`` parses from the rendered container's args."""
    (args,) = [c["args"] for o in objs if o["kind"] == "Deployment"
               for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == container]
    for mounted in ("/tls/tls.crt", "/tls/tls.key"):
        (tmp_path / mounted.rsplit("/", 1)[1]).write_text("x")
        args = [a.replace(mounted, str(tmp_path / mounted.rsplit("/", 1)[1])) for a in args]
    root = get_command(app)
    cmd = root.get_command(root.context_class(root), args[0])  # type: ignore[attr-defined]
    assert cmd is not None
    return dict(cmd.make_context(args[0], list(args[1:])).params)


@pytest.mark.parametrize("raw", [{}, {"scheduler": {"schedulerName": "gpu-sched"}, "maxGpuContainers": 4}])
def test_webhook_and_extender_are_told_the_same_profile_and_cap(raw: dict, tmp_path: Path) -> None:
    v = values_from_dict(raw)
    objs = render(v)
    webhook, extender = _parsed(objs, "webhook", tmp_path), _parsed(objs, "extender", tmp_path)
    assert webhook["scheduler_name"] == v.scheduler.scheduler_name == scheduler_config(v)["profiles"][0][
        "schedulerName"]
    assert webhook["max_gpu_containers"] == extender["max_gpu_containers"] == v.max_gpu_containers
    assert v.max_gpu_containers == raw.get("maxGpuContainers", 32)


def test_per_gpu_metrics_reach_the_extender_only_when_asked(tmp_path: Path) -> None:
    assert _parsed(render(values_from_dict({})), "extender", tmp_path)["metrics_per_gpu"] is False
    asked = render(values_from_dict({"scheduler": {"metricsPerGpu": True}}))
    assert _parsed(asked, "extender", tmp_path)["metrics_per_gpu"] is True


def test_each_flag_is_passed_once(tmp_path: Path) -> None:
    objs = render(values_from_dict({"maxGpuContainers": 8}))
    (args,) = [c["args"] for o in objs if o["kind"] == "Deployment"
               for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == "webhook"]
    for flag in ("--scheduler-name", "--max-gpu-containers"):
        assert len([a for a in args if a.startswith(flag)]) == 1, args


def test_a_cap_that_refuses_every_gpu_pod_is_refused() -> None:
    with pytest.raises(ValuesError, match="maxGpuContainers"):
        values_from_dict({"maxGpuContainers": 0})


@pytest.mark.parametrize("namespace", ["kubegpu-system", "gpu"])
def test_the_webhooks_default_record_writers_are_the_accounts_the_install_runs(namespace: str) -> None:
    """Run without --record-writer, the webhook admits exactly the service accounts the extender and the node
    daemon run as in a default install (no retired account name an operator might create and forge with)."""
    from kubegpu.webhook.app import default_record_writers

    objs = render(values_from_dict({"namespace": namespace}))
    accounts = {o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]:
                o["spec"]["template"]["spec"]["serviceAccountName"]
                for o in objs if o["kind"] in ("Deployment", "DaemonSet")}
    running = {f"system:serviceaccount:{namespace}:{accounts[c]}" for c in ("scheduler", "node")}
    assert default_record_writers(namespace) == running
    (args,) = [c["args"] for o in objs if o["kind"] == "Deployment"
               for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == "webhook"]
    assert {a.split("=", 1)[1] for a in args if a.startswith("--record-writer=")} == running
