"""``kubegpu node``'s lean entry (issue 23): it reads the command's options exactly as the typer command
does, hands what it does not take to typer, and a node daemon process loads neither typer nor rich,
pydantic, click or numpy, nor grpcio (its gRPC is grpclib's)."""

from __future__ import annotations

import json
import os
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
import typer
from typer.testing import CliRunner

import kubegpu.cli.node as node_cli
from kubegpu.cli.main import app
from kubegpu.cli.node_entry import ENVS, FLAGS, VALUES, NodeArgs, parse_node_argv

ARGVS: list[list[str]] = [
    [],
    ["--standalone", "--inventory", "dgx1-v100", "--shared-slots", "100", "--metrics-address", "0"],
    ["--mig-strategy", "mixed", "--standalone", "--pass-device-specs", "--inventory=t4x4", "--x=y", "value"],
    ["--node-name", "a", "--node-name=b", "--run-for", "2.5", "--log-level", "debug", "--dry-run", "--json"],
    ["--kubelet-plugin", "dra", "--dra-shared-gpus", "4-7", "--kubeconfig", "/k", "--inventory", ""],
    ["--inventory=", "--run-for=3", "--standalone", "--standalone", "--config-file", "f.yaml"],
    ["stray", "--fail-on-init-error=false"],
]
ENVIRONS: list[dict[str, str]] = [
    {},
    {"NODE_NAME": "env-node", "KUBECONFIG": "/env/kc", "KUBEGPU_KUBELET_PLUGIN": "dra"},
    {"NODE_NAME": "", "KUBECONFIG": ""},  # empty: as if unset (click's rule)
]
# What the lean reader leaves to typer: help, option ends, short options, missing or odd values.
TYPER_ONLY: list[list[str]] = [
    ["--help"], ["--standalone", "--help"], ["--", "--standalone"], ["-h"], ["-"], ["--inventory"],
    ["--inventory", "--standalone"], ["--standalone=true"], ["--run-for", "x"], ["--run-for", "1e3"],
    ["--run-for=-1"], ["--log-level", "-v"],
]


def typer_args(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> NodeArgs:
    """The NodeArgs the typer command hands to run_node for ``kubegpu node <argv>`` under ``env``."""
    seen: list[NodeArgs] = []

    def record(args: NodeArgs, backend: Any) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(node_cli, "run_node", record)
    for var in ENVS.values():
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(app, ["node", *argv], env=env)
    assert result.exit_code == 0, result.output
    (args,) = seen
    return args


@pytest.mark.parametrize("env", ENVIRONS, ids=["no-env", "env", "empty-env"])
@pytest.mark.parametrize("argv", ARGVS, ids=[str(i) for i in range(len(ARGVS))])
def test_lean_reader_reads_what_the_typer_command_reads(argv: list[str], env: dict[str, str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_node_argv(argv, env) == typer_args(argv, env, monkeypatch)


@pytest.mark.parametrize("argv", TYPER_ONLY, ids=[" ".join(a) for a in TYPER_ONLY])
def test_what_the_lean_reader_cannot_take_as_it_is_goes_to_typer(argv: list[str]) -> None:
    assert parse_node_argv(argv, {}) is None


def test_option_tables_are_the_typer_commands_options() -> None:
    command = typer.main.get_command(app).commands["node"]  # type: ignore[attr-defined]
    declared = {p.opts[0]: p for p in command.params if p.opts and p.opts[0] != "--help"}
    assert set(declared) == set(FLAGS) | set(VALUES)
    for opt, p in declared.items():
        assert p.is_flag == (opt in FLAGS), opt
        field = FLAGS.get(opt) or VALUES[opt]
        assert p.name == field or (p.name, field) == ("as_json", "as_json"), opt
        assert p.envvar == ENVS.get(field), opt
        assert p.default == getattr(NodeArgs(), field), opt


# grpcio too (issue 23: its C core is ~10 MB resident): the node daemon serves and calls gRPC through grpclib.
HEAVY = ("typer", "rich", "pydantic", "click", "numpy", "kubegpu.cli.node", "kubegpu.placement.cluster", "grpc")


def start_kubegpu(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    """``kubegpu <args>`` as the console script runs it; stderr's last line lists the heavy modules loaded."""
    code = ("import atexit, sys\n"
            f"atexit.register(lambda: print(json.dumps(sorted(m for m in {HEAVY!r} "
            "if sys.modules.get(m) is not None)), file=sys.stderr))\n"
            "import json\n"
            "from kubegpu.cli.main import app\n"
            "sys.exit(app())\n")
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


def test_node_help_and_bad_input_still_get_typers_answers(tmp_path: Path) -> None:
    helped = run_kubegpu(["node", "--help"], tmp_path)
    assert helped.returncode == 0 and "--kubelet-plugin KIND" in helped.stdout
    assert "--mig-strategy VALUE" in helped.stdout  # the node config's options, in the epilog
    bad = run_kubegpu(["node", "--run-for", "soon"], tmp_path)
    assert bad.returncode == 2 and "Invalid value for '--run-for'" in bad.stderr
    unknown = run_kubegpu(["node", "--standalone", "--inventory", "t4x4", "--dry-run", "--no-such-flag", "1"],
                          tmp_path)
    assert unknown.returncode == 2 and "configuration error:" in unknown.stderr
    assert "typer" not in loaded(unknown)  # a config error is the daemon's answer, not typer's
