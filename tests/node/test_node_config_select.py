"""Per-node configuration: the node's ``nvidia.com/device-plugin.config`` label picks the config.map entry."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from lightkube.models.meta_v1 import ObjectMeta
from polling import until
from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.kube.client import make_client
from kubegpu.kube.resources import Node
from kubegpu.node.config import ConfigError
from kubegpu.node.config.select import CONFIG_LABEL, select_config_file, with_node_config
from kubegpu_standins.apiserver import ApiServer

PLAIN = "version: v1\n"
SHARED = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
          "      replicas: 4\n")


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    d = tmp_path / "config"
    d.mkdir()
    (d / "default").write_text(PLAIN)
    (d / "shared").write_text(SHARED)
    return d


def test_the_label_names_the_entry(config_dir: Path) -> None:
    assert select_config_file(str(config_dir), "shared") == str(config_dir / "shared")
    assert select_config_file(str(config_dir), None) is None
    flags = with_node_config({"config-dir": str(config_dir)}, {}, "shared")
    assert flags == {"config-file": str(config_dir / "shared")}
    assert with_node_config({}, {"CONFIG_DIR": str(config_dir)}, None) == {}


@pytest.mark.parametrize("label", ["missing", "../default", ".hidden"])
def test_a_label_naming_no_entry_is_an_error_that_lists_them(config_dir: Path, label: str) -> None:
    with pytest.raises(ConfigError, match=rf"{CONFIG_LABEL}=.*no such entry \(entries: default, shared\)"):
        select_config_file(str(config_dir), label)
    with pytest.raises(ConfigError, match="no config directory"):
        select_config_file("", "shared")


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[Path, object]]:
    server = ApiServer(history=100).start()
    try:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        yield kubeconfig, make_client(kubeconfig)
    finally:
        server.stop()


def _dry_run(kubeconfig: Path, config_dir: Path) -> list[dict]:
    result = CliRunner().invoke(
        app, ["node", "--inventory", "t4x4", "--dry-run", "--json", "--kubeconfig", str(kubeconfig),
              "--node-name", "n1"],
        env={"CONFIG_DIR": str(config_dir), "CONFIG_FILE": str(config_dir / "default")})
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_daemon_reads_its_nodes_label(api: tuple, config_dir: Path) -> None:
    kubeconfig, client = api
    client.create(Node(metadata=ObjectMeta(name="n1", labels={CONFIG_LABEL: "shared"})))
    plans = {p["resource"]: p for p in _dry_run(kubeconfig, config_dir)}
    assert plans["nvidia.com/gpu"]["replicas"] == 4 and plans["nvidia.com/gpu"]["sharing"] == "time-slicing"
    # Without the label: the default entry (CONFIG_FILE), no replicas.
    client.patch(Node, "n1", {"metadata": {"labels": {CONFIG_LABEL: None}}})
    plans = {p["resource"]: p for p in _dry_run(kubeconfig, config_dir)}
    assert plans["nvidia.com/gpu"]["sharing"] == "none"


def test_a_bad_label_stops_the_daemon_with_the_reason(api: tuple, config_dir: Path) -> None:
    kubeconfig, client = api
    client.create(Node(metadata=ObjectMeta(name="n1", labels={CONFIG_LABEL: "a100-large"})))
    result = CliRunner().invoke(
        app, ["node", "--inventory", "t4x4", "--dry-run", "--kubeconfig", str(kubeconfig), "--node-name", "n1"],
        env={"CONFIG_DIR": str(config_dir), "CONFIG_FILE": str(config_dir / "default")})
    assert result.exit_code == 2
    assert "'a100-large': config.map has no such entry" in result.output


def _gpu_labels(api: ApiServer) -> dict[str, str]:
    labels = api.get_object("nodes", "n1")["metadata"].get("labels") or {}
    return {k: labels[k] for k in ("nvidia.com/gpu.replicas", "nvidia.com/gpu.sharing-strategy",
                                   "nvidia.com/gpu.product") if k in labels}


def test_the_gfd_labels_follow_the_entry_the_label_selects_and_a_reload(tmp_path: Path, config_dir: Path) -> None:
    """The node daemon publishes the GFD labels of the config it serves: the entry its node label selects
    (time-slicing, 4 replicas: `-SHARED` product), and after the label changes and the config is reloaded,
    the new entry's."""
    server = ApiServer(history=100).start()
    proc: subprocess.Popen[bytes] | None = None
    try:
        server.put_object({"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": "n1", "labels": {CONFIG_LABEL: "shared"}}})
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        log = tmp_path / "node.log"
        env = {**os.environ, "CONFIG_DIR": str(config_dir), "CONFIG_FILE": str(config_dir / "default"),
               "KUBERNETES_SERVICE_HOST": ""}
        proc = subprocess.Popen(
            [sys.executable, "-c", "from kubegpu.cli.main import main; main()", "node", "--inventory", "t4x4",
             "--node-name", "n1", "--kubeconfig", str(kubeconfig), "--device-plugin-dir", str(tmp_path / "dp"),
             "--cdi-spec-dir", str(tmp_path / "cdi"), "--pod-resources-socket", str(tmp_path / "pr.sock"),
             "--metrics-address", "0", "--run-for", "120"],
            stdout=subprocess.DEVNULL, stderr=log.open("wb"), env=env)
        shared = {"nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy": "time-slicing",
                  "nvidia.com/gpu.product": "Tesla-T4-SHARED"}
        assert until(lambda: _gpu_labels(server) == shared, 60), (_gpu_labels(server), log.read_text()[-3000:])
        make_client(kubeconfig).patch(Node, "n1", {"metadata": {"labels": {CONFIG_LABEL: None}}})
        proc.send_signal(signal.SIGHUP)  # what the label watch does when it sees the change
        plain = {"nvidia.com/gpu.replicas": "1", "nvidia.com/gpu.sharing-strategy": "none",
                 "nvidia.com/gpu.product": "Tesla-T4"}
        assert until(lambda: _gpu_labels(server) == plain, 60), (_gpu_labels(server), log.read_text()[-3000:])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)
        server.stop()
