"""What keeps the node daemon at its memory target beyond its framework-free entry (tests/cli/
test_cli_node_entry.py): the preferred-allocation path loads no numpy, and both DaemonSets run the
daemon with the runtime environment the benchmarks measure."""

from __future__ import annotations

import os
import subprocess
import sys

from kubegpu.install.dra import apply_dra
from kubegpu.install.render import render
from kubegpu.install.values import Values
from kubegpu.node.runtime_env import NODE_ENV


def fresh_python(code: str) -> str:
    """What ``code`` prints in a fresh interpreter (what a module loads shows only in a new process)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_whole_gpu_preference_loads_no_numpy() -> None:
    code = ("import sys\n"
            "from kubegpu.inventory.fake import FakeBackend\n"
            "from kubegpu.node.deviceplugin import preferred\n"
            "from kubegpu.node.deviceplugin.resources import whole_device\n"
            "gpus = FakeBackend('dgx1-v100').discover().gpus\n"
            "known = {g.uuid: whole_device(g) for g in gpus}\n"
            "print(len(preferred.whole_gpus(gpus, sorted(known), [], 2, known)))\n"
            "print('numpy' in sys.modules)\n")
    assert fresh_python(code).split() == ["2", "False"]


def test_both_daemonsets_run_the_daemon_with_the_node_runtime_env() -> None:
    v = Values()
    objs = apply_dra(render(v), v)
    daemonsets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "DaemonSet"}
    nodes = [o for name, o in daemonsets.items() if "node" in name or "dra" in name]
    assert len(nodes) == 2, sorted(daemonsets)
    for ds in nodes:
        (container,) = ds["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {k: env.get(k) for k in NODE_ENV} == NODE_ENV, ds["metadata"]["name"]


def test_the_nvml_daemon_loads_no_fake_backend_and_no_yaml_without_a_config_file() -> None:
    # On a GPU node the daemon imports the NVML backend, never the fake one (nor its topology files,
    # PyYAML, importlib.resources); PyYAML comes with a config file only, decimal with a quantity parsed.
    code = ("import sys\n"
            "import kubegpu.inventory.nvml, kubegpu.node.daemon, kubegpu.cli.node_entry\n"
            "from kubegpu.node.config import load_config\n"
            "load_config({}, {})\n"
            "print(sorted(m for m in ('yaml', 'kubegpu.inventory.fake', 'kubegpu.inventory.topology',\n"
            "                         'importlib.resources', 'decimal') if m in sys.modules))\n")
    assert fresh_python(code).strip() == "[]"


def test_the_dra_daemon_loads_no_device_plugin_allocate() -> None:
    # The DRA driver shares the container variables' names with the device plugins, not their Allocate
    # (nor its protobuf messages).
    code = ("import sys\n"
            "import kubegpu.node.dra.cli, kubegpu.node.dra.daemon\n"
            "print(sorted(m for m in ('kubegpu.node.deviceplugin.allocate', 'kubegpu.node.proto.deviceplugin_pb2')\n"
            "             if m in sys.modules))\n")
    assert fresh_python(code).strip() == "[]"
