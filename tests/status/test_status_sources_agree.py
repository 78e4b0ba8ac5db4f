"""``kubegpu status`` shows one truth: the API server and the extender's debug API, read at the same moment
of the same cluster, give the same GPUs, health, models, holders and totals; unknown names are errors."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

from test_status_replicas_mig import cluster  # noqa: F401  (the fixture; tests/ is on sys.path by rootdir)
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.model.device_object import device_object
from kubegpu.scheduler.service import ServiceThread

SAME = ("allocated_gpu", "free_gpu", "stranded_gpu", "whole_free_gpus", "gpus", "healthy_gpus", "mig_devices",
        "mig_devices_free")


def _json(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(app, ["status", "-o", "json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _gpus(view: dict[str, Any]) -> dict[tuple[str, int], tuple[Any, ...]]:
    return {(n["name"], g["index"]): (
        g["model"], g["healthy"], g["core_used"], g["memory_used"], g["mig_enabled"], g["replica_only"],
        sorted((h["pod"], h["container"], h["core"]) for h in g["holders"]),
        [(m["profile"], m["healthy"], [h["pod"] for h in m["holders"]]) for m in g["mig"]],
    ) for n in view["nodes"] for g in n["gpus"]}


def test_api_server_and_extender_agree(cluster: tuple) -> None:  # noqa: F811
    server, kubeconfig, invs = cluster
    t4 = invs["t4-node"]
    # GPU 3 of the T4 node fails (the node daemon publishes it in its Device object).
    sick = dataclasses.replace(t4, gpus=(*t4.gpus[:3], t4.gpus[3].with_health(False)))
    # And a100-mig's time-sliced GPUs are marked replicated, as `kubegpu node` publishes them.
    a100 = invs["a100-mig"]
    sliced = dataclasses.replace(a100, gpus=tuple(dataclasses.replace(g, replicated=not g.mig_enabled)
                                                  for g in a100.gpus))
    kind = server.kind("devices", "kubegpu.io")
    for name, inv in (("t4-node", sick), ("a100-mig", sliced)):
        server.store.update(kind, "", name, lambda old, inv=inv: {**device_object(inv), "metadata": old["metadata"]})
    extender = ServiceThread(kubeconfig).start()
    try:
        from_api = _json("--kubeconfig", str(kubeconfig))
        for _ in range(100):  # the extender reads the records asynchronously after its first sync
            from_ext = _json("--kubeconfig", str(kubeconfig), "--extender", extender.url)
            if _gpus(from_ext) == _gpus(from_api):
                break
            threading.Event().wait(0.05)
    finally:
        extender.stop()
    assert _gpus(from_ext) == _gpus(from_api)
    assert _gpus(from_api)[("t4-node", 3)][1] is False
    assert {k: from_ext["totals"][k] for k in SAME} == {k: from_api["totals"][k] for k in SAME}
    assert from_api["totals"]["healthy_gpus"] == from_api["totals"]["gpus"] - 1


def test_unknown_node_is_an_error(cluster: tuple, tmp_path: Path) -> None:  # noqa: F811
    _, kubeconfig, _ = cluster
    result = CliRunner().invoke(app, ["status", "--kubeconfig", str(kubeconfig), "--node", "nosuch"])
    assert result.exit_code == 1
    assert "no node 'nosuch'" in result.stderr and "a100-mig" in result.stderr


def test_yaml_wide_and_what_the_extender_cannot_see(cluster: tuple) -> None:  # noqa: F811
    import yaml

    _, kubeconfig, invs = cluster
    as_json = _json("--kubeconfig", str(kubeconfig))
    as_yaml = CliRunner().invoke(app, ["status", "--kubeconfig", str(kubeconfig), "-o", "yaml"])
    assert as_yaml.exit_code == 0 and yaml.safe_load(as_yaml.stdout) == as_json
    assert as_json["source"] == "api-server" and as_json["notes"] == []
    wide = CliRunner().invoke(app, ["status", "--kubeconfig", str(kubeconfig), "-o", "wide", "--node", "t4-node"])
    assert wide.exit_code == 0 and "UUID" in wide.stdout and invs["t4-node"].gpus[0].uuid in wide.stdout
    extender = ServiceThread(kubeconfig).start()
    try:
        from_ext = _json("--extender", extender.url)
        table = CliRunner().invoke(app, ["status", "--extender", extender.url]).stdout
    finally:
        extender.stop()
    assert from_ext["source"] == "extender"
    assert any("replicas are counted by the kubelet" in n for n in from_ext["notes"])
    assert "note: time-slicing / MPS replicas are counted by the kubelet" in table
