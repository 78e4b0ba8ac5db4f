"""Per-node configuration: the node's ``nvidia.com/device-plugin.config`` label picks the config.map entry."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from lightkube.models.meta_v1 import ObjectMeta
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
