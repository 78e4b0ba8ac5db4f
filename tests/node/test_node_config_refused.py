"""Every NVIDIA setting kubegpu cannot honour is refused, naming where it came from; NVIDIA's defaults load."""

from __future__ import annotations

import re

import pytest

from kubegpu.node.config import ConfigError, load_config
from kubegpu.node.config.refused import REFUSED

# (file key, a value NVIDIA would act on, the flag, the env var, NVIDIA's default)
CASES = [
    ("flags.deviceDiscoveryStrategy", "tegra", "device-discovery-strategy", "DEVICE_DISCOVERY_STRATEGY", "auto"),
    ("flags.deviceDiscoveryStrategy", "vfio", "device-discovery-strategy", "DEVICE_DISCOVERY_STRATEGY", "nvml"),
    ("flags.gfd.oneshot", True, "oneshot", "GFD_ONESHOT", False),
    ("flags.gfd.noTimestamp", True, "no-timestamp", "GFD_NO_TIMESTAMP", False),
    ("flags.gfd.sleepInterval", "30s", "sleep-interval", "GFD_SLEEP_INTERVAL", "60s"),
    ("flags.gfd.outputFile", "/tmp/gfd", "output-file", "GFD_OUTPUT_FILE",
     "/etc/kubernetes/node-feature-discovery/features.d/gfd"),
    ("flags.gfd.machineTypeFile", "/tmp/m", "machine-type-file", "GFD_MACHINE_TYPE_FILE",
     "/sys/class/dmi/id/product_name"),
    ("flags.useNodeFeatureAPI", True, "use-node-feature-api", "USE_NODE_FEATURE_API", False),
    ("imex.channelIDs", [0], "imex-channel-ids", "IMEX_CHANNEL_IDS", []),
    ("imex.required", True, "imex-required", "IMEX_REQUIRED", False),
    ("flags.restartOnDeviceUnhealthy", True, "restart-on-device-unhealthy", "RESTART_ON_DEVICE_UNHEALTHY", False),
]


def _file(key: str, value: object) -> dict:
    doc: dict = {}
    cur = doc
    parts = key.split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return doc


def _text(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def test_every_refused_key_has_a_case() -> None:
    assert {c[0] for c in CASES} == set(REFUSED)


@pytest.mark.parametrize(("key", "value", "flag", "env", "default"), CASES)
def test_refused_from_file_env_and_flag(key: str, value: object, flag: str, env: str, default: object) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(f"config.{key}: ") + ".* is not supported: "):
        load_config(file=_file(key, value))
    with pytest.raises(ConfigError, match=rf"^{env}: .* is not supported"):
        load_config(env={env: _text(value)})
    with pytest.raises(ConfigError, match=rf"^--{flag}: .* is not supported"):
        load_config(flags={flag: _text(value)})


@pytest.mark.parametrize(("key", "value", "flag", "env", "default"), CASES)
def test_nvidias_default_value_loads(key: str, value: object, flag: str, env: str, default: object) -> None:
    load_config(file=_file(key, default))
    if _text(default):
        load_config(env={env: _text(default)}, flags={flag: _text(default)})


def test_node_help_describes_every_option() -> None:
    from typer.testing import CliRunner

    from kubegpu.cli.main import app
    from kubegpu.node.config import OPTIONS

    # Compared without whitespace: the help is wrapped to the terminal, at spaces and after hyphens.
    text = "".join(CliRunner().invoke(app, ["node", "--help"]).output.split())

    def has(fragment: str) -> bool:
        return "".join(fragment.split()) in text

    for o in OPTIONS:
        value = "[BOOL]" if o.kind == "bool" else "VALUE"  # a flag alone, or a flag with a value
        names = ", ".join(f"--{n} {value}" for n in (o.flag, *o.aliases))
        assert o.help and has(f"{names} {o.help}"), o.key
        if o.key in REFUSED:
            assert has(f"{o.help}; accepted only at NVIDIA's default"), o.key
        elif o.kind == "bool":
            assert has(f"{o.help}; {'on by default (=false turns it off)' if o.default else 'off unless given'}")
        assert has(f"[env {', '.join(o.envs)}]"), o.key
    assert has("--config-dir DIR") and has("nvidia.com/device-plugin.config")
