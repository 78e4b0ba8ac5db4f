"""``kubegpu node``'s entry: one argparse command line made from the node config's option table (every flag,
its environment variable in ``--help``), and a node daemon process that loads neither typer nor rich,
pydantic, click or numpy, nor grpcio (its gRPC is grpclib's)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import kubegpu.cli.node as node_cli
from kubegpu.cli.main import app
from kubegpu.cli.node_entry import NodeArgs, UsageError, parse_node_args
from kubegpu.node.config import OPTIONS, ConfigError, load_config


def test_every_config_option_is_a_flag_under_the_name_given() -> None:
    # The parser is made from the option table: each flag and alias of every option parses, and reaches the
    # config loader under the name given (so giving an alias and its setting together stays the loader's error).
    for o in OPTIONS:
        for name in (o.flag, *o.aliases):
            value = [] if o.kind == "bool" else ["v"]
            args = parse_node_args([f"--{name}", *value], {})
            assert dict(args.config_flags) == {name: "true" if o.kind == "bool" else "v"}, name
    args = parse_node_args(["--fail-on-init-error=false", "--mig-strategy", "mixed", "--driver-root", "/a",
                            "--nvidia-driver-root=/b", "--config-file", "f.yaml", "--standalone"], {})
    assert dict(args.config_flags) == {"fail-on-init-error": "false", "mig-strategy": "mixed", "driver-root": "/a",
                                       "nvidia-driver-root": "/b", "config-file": "f.yaml"}
    assert args.standalone
    with pytest.raises(ConfigError, match="same setting"):
        load_config(args.config_flags, {})


def test_the_commands_own_options_and_their_environment() -> None:
    env = {"NODE_NAME": "env-node", "KUBECONFIG": "/env/kc", "KUBEGPU_KUBELET_PLUGIN": "dra"}
    assert parse_node_args([], env) == NodeArgs(node_name="env-node", kubeconfig="/env/kc", kubelet_plugin="dra")
    assert parse_node_args([], {"NODE_NAME": "", "KUBECONFIG": ""}) == NodeArgs()  # empty: as if unset
    got = parse_node_args(["--node-name", "a", "--node-name=b", "--run-for", "2.5", "--log-level", "DEBUG",
                           "--dry-run", "--json", "--inventory="], env)
    assert got == NodeArgs(node_name="b", kubeconfig="/env/kc", kubelet_plugin="dra", run_for=2.5,
                           log_level="debug", dry_run=True, as_json=True, inventory="")


@pytest.mark.parametrize(("argv", "message"), [
    (["--no-such-flag", "1"], "--no-such-flag: unknown flag"),
    (["--mig"], "--mig: unknown flag"),  # no abbreviations: a flag is its whole name
    (["stray"], "unexpected argument 'stray'"),
    (["--inventory"], "expected one argument"),
    (["--run-for", "soon"], "'soon' is not a number of seconds"),
    (["--run-for=-1"], "'-1' is not a number of seconds"),
    (["--log-level", "loud"], "invalid choice"),
    (["--kubelet-plugin", "vfio"], "expected device-plugin or dra"),
])
def test_a_command_line_it_cannot_take_is_refused_with_the_reason(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_node_args(argv, {})


def test_the_typer_command_forwards_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(node_cli, "main", lambda argv: seen.append(argv) or 3)
    result = CliRunner().invoke(app, ["node", "--help", "--mig-strategy=mixed", "-x", "stray"])
    assert result.exit_code == 3 and seen == [["--help", "--mig-strategy=mixed", "-x", "stray"]]


# grpcio too (its C core is large and resident): the node daemon serves and calls gRPC through grpclib.
HEAVY = ("typer", "rich", "pydantic", "click", "numpy", "kubegpu.cli.node", "kubegpu.placement.cluster", "grpc")


def start_kubegpu(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    """``kubegpu <args>`` as the console script runs it; stderr's last line lists the heavy modules loaded."""
    code = ("import atexit, sys\n"
            f"atexit.register(lambda: print(json.dumps(sorted(m for m in {HEAVY!r} "
            "if sys.modules.get(m) is not None)), file=sys.stderr))\n"
            "import json\n"
            "from kubegpu.cli.main import main\n"
            "sys.argv[0] = 'kubegpu'\n"
            "main()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=cwd)


def run_kubegpu(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    proc = start_kubegpu(args, tmp_path)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def loaded(result: subprocess.CompletedProcess[str]) -> list[str]:
    return list(json.loads(result.stderr.strip().splitlines()[-1]))


def test_node_daemon_process_loads_no_cli_framework(tmp_path: Path) -> None:
    # Served for half a second with no kubelet (it keeps retrying to register), then a clean stop.
    result = run_kubegpu(["node", "--standalone", "--inventory", "dgx1-v100", "--device-plugin-dir",
                          str(tmp_path / "dp"), "--cdi-spec-dir", str(tmp_path / "cdi"), "--metrics-address", "0",
                          "--run-for", "0.5", "--log-level", "warning"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert loaded(result) == []
    plans = run_kubegpu(["node", "--standalone", "--inventory", "t4x4", "--dry-run", "--json"], tmp_path)
    assert plans.returncode == 0, plans.stderr
    assert "nvidia.com/gpu" in [p["resource"] for p in json.loads(plans.stdout)]
    assert loaded(plans) == []


def test_node_daemon_in_a_cluster_talks_to_the_api_server(tmp_path: Path) -> None:
    """The daemon runs against the (stand-in) API server without the CLI framework or grpcio, and its writes
    land (the handoff's start-up publication)."""
    from kubegpu.model import annotations as A
    from kubegpu_standins.apiserver import ApiServer

    api = ApiServer().start()
    try:
        api.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        result = run_kubegpu(["node", "--inventory", "dgx1-v100", "--node-name", "n1", "--kubeconfig",
                              str(kubeconfig), "--device-plugin-dir", str(tmp_path / "dp"), "--cdi-spec-dir",
                              str(tmp_path / "cdi"), "--metrics-address", "0", "--run-for", "1.5",
                              "--log-level", "warning"], tmp_path)
        assert result.returncode == 0, result.stderr
        assert loaded(result) == []
        node = api.get_object("nodes", "n1")
        assert A.HANDOFF_SEEN in (node["metadata"].get("annotations") or {}), node["metadata"]
    finally:
        api.stop()


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kgc-", dir="/tmp"))  # unix socket paths: at most 107 bytes
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("cluster", [False, True], ids=["standalone", "cluster"])
def test_node_daemon_serves_a_grpcio_kubelet_without_grpcio(cluster: bool, sockdir: Path) -> None:
    """The daemon process (grpclib) registers with, streams to and answers the stand-in kubelet, which is grpcio
    as the real kubelet is grpc-go: another gRPC implementation. In a cluster it also reads that kubelet's
    PodResources (after an Allocate of a GPU no record names). grpcio is never imported by the daemon."""
    from kubegpu_standins.apiserver import ApiServer
    from kubegpu_standins.kubelet import StandinKubelet

    kubelet = StandinKubelet(sockdir / "dp")
    kubelet.start()
    listed = threading.Event()
    pod_resources = kubelet.pod_resources

    def counted() -> Any:
        listed.set()
        return pod_resources()

    kubelet.pod_resources = counted  # type: ignore[method-assign]
    kubelet.serve_pod_resources(sockdir / "pod-resources.sock")
    api = ApiServer().start() if cluster else None
    args = ["node", "--inventory", "t4x4", "--device-plugin-dir", str(sockdir / "dp"), "--cdi-spec-dir",
            str(sockdir / "cdi"), "--metrics-address", "0", "--run-for", "60", "--log-level", "warning"]
    if api is None:
        args.append("--standalone")
    else:
        api.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
        args += ["--node-name", "n1", "--kubeconfig", str(api.write_kubeconfig(sockdir / "kubeconfig")),
                 "--pod-resources-socket", str(sockdir / "pod-resources.sock")]
    proc = start_kubegpu(args, sockdir)
    try:
        assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=30), proc.stderr
        assert kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 4, 10)
        got = kubelet.allocate("nvidia.com/gpu", 2, pod="default/p", container="main")
        assert got.response.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(got.device_ids)
        assert got.preferred is not None  # GetPreferredAllocation answered too
        if cluster:
            assert listed.wait(10), "the daemon never read the kubelet's PodResources"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        # Its streams ended with it: the kubelet counts its devices gone.
        assert kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 0, 5)
    finally:
        proc.kill()
        kubelet.stop()
        if api is not None:
            api.stop()
    assert proc.returncode == 0, err
    assert loaded(subprocess.CompletedProcess(proc.args, 0, out, err)) == []


def test_node_help_explains_every_option_and_bad_input_is_refused(tmp_path: Path) -> None:
    helped = run_kubegpu(["node", "--help"], tmp_path)
    assert helped.returncode == 0 and "--kubelet-plugin KIND" in helped.stdout
    text = " ".join(helped.stdout.split())  # argparse wraps lines
    for o in OPTIONS:
        assert f"--{o.flag}" in text and all(env in text for env in o.envs), o.flag
    assert "--mig-strategy VALUE" in text and "[env MIG_STRATEGY]" in text
    assert loaded(helped) == []  # help is the daemon's own parser's: no CLI framework
    bad = run_kubegpu(["node", "--run-for", "soon"], tmp_path)
    assert bad.returncode == 2 and "not a number of seconds" in bad.stderr
    unknown = run_kubegpu(["node", "--standalone", "--inventory", "t4x4", "--dry-run", "--no-such-flag", "1"],
                          tmp_path)
    assert unknown.returncode == 2 and "--no-such-flag: unknown flag" in unknown.stderr
    wrong = run_kubegpu(["node", "--standalone", "--inventory", "t4x4", "--dry-run", "--mig-strategy", "odd"],
                        tmp_path)
    assert wrong.returncode == 2 and "configuration error: --mig-strategy" in wrong.stderr
    assert loaded(wrong) == []
