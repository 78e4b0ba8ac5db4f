"""The node config loads NVIDIA's file, flags and env with flag > env > file > default, and names every error."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kubegpu.node.config import (
    OPTIONS,
    Config,
    ConfigError,
    ReplicaDevices,
    load_config,
    parse_duration,
    parse_resource_config,
)
from kubegpu.node.config.argv import shown_default

NVIDIA_EXAMPLE = """
version: v1
flags:
  migStrategy: "none"
  failOnInitError: true
  nvidiaDriverRoot: "/"
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: "envvar"
    deviceIDStrategy: "uuid"
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: false
    resources:
    - name: nvidia.com/gpu
      replicas: 10
"""


def write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "config.yaml"
    f.write_text(textwrap.dedent(text))
    return f


def test_defaults_match_nvidia() -> None:
    c = load_config()
    assert c == Config()
    assert c.flags.mig_strategy == "none" and c.flags.fail_on_init_error is True
    assert c.flags.nvidia_driver_root == "/" and c.flags.dev_root == "/"
    assert c.flags.plugin.device_list_strategy == ("envvar",)
    assert c.flags.plugin.device_id_strategy == "uuid" and c.flags.plugin.pass_device_specs is False
    assert c.flags.plugin.cdi_annotation_prefix == "cdi.k8s.io/"
    assert c.sharing.strategy == "none"
    assert c.kubegpu.shared_slots == 100 and c.kubegpu.replica_choice == "distributed"
    assert c.kubegpu.cdi_spec_dir == "/var/run/cdi"
    assert c.kubegpu.kubelet_socket == "/var/lib/kubelet/device-plugins/kubelet.sock"


def test_nvidia_documented_file_loads_unchanged(tmp_path: Path) -> None:
    c = load_config(file=write(tmp_path, NVIDIA_EXAMPLE))
    assert c.sharing.strategy == "time-slicing"
    (r,) = c.sharing.time_slicing.resources
    assert (r.name, r.replicas, r.rename, r.devices) == ("nvidia.com/gpu", 10, "", ReplicaDevices())
    assert c.config_file.endswith("config.yaml")


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    f = write(tmp_path, """
        version: v1
        flags:
          migStrategy: single
          restartOnDeviceUnhealthy: null
          plugin: {deviceIDStrategy: index, passDeviceSpecs: true}
          gdsEnabled: true
        kubegpu: {sharedSlots: 10}
    """)
    file_only = load_config(file=f)
    assert file_only.flags.mig_strategy == "single" and file_only.kubegpu.shared_slots == 10
    env = {"MIG_STRATEGY": "mixed", "DEVICE_ID_STRATEGY": "uuid", "KUBEGPU_SHARED_SLOTS": "20"}
    with_env = load_config(env=env, file=f)
    assert with_env.flags.mig_strategy == "mixed"
    assert with_env.flags.plugin.device_id_strategy == "uuid"
    assert with_env.kubegpu.shared_slots == 20
    assert with_env.flags.plugin.pass_device_specs is True  # file, untouched by env
    assert with_env.flags.gds_enabled is True
    with_flags = load_config(flags={"mig-strategy": "none", "shared-slots": 30}, env=env, file=f)
    assert with_flags.flags.mig_strategy == "none" and with_flags.kubegpu.shared_slots == 30
    assert with_flags.flags.plugin.device_id_strategy == "uuid"  # env still beats file
    assert load_config().flags.gds_enabled is False  # default


def test_config_file_named_by_flag_or_env(tmp_path: Path) -> None:
    f = write(tmp_path, "version: v1\nflags: {migStrategy: mixed}\n")
    assert load_config(env={"CONFIG_FILE": str(f)}).flags.mig_strategy == "mixed"
    assert load_config(flags={"config-file": str(f)}, env={"CONFIG_FILE": "/nope"}).flags.mig_strategy == "mixed"


def test_nvidia_aliases_and_second_variables() -> None:
    by_alias = load_config(flags={"nvidia-ctk-path": "/opt/ctk", "container-driver-root": "/drv",
                                  "driver-root": "/run/nvidia/driver"})
    assert by_alias.flags.plugin.nvidia_ctk_path == "/opt/ctk"
    assert by_alias.flags.plugin.container_driver_root == "/drv"
    assert by_alias.flags.nvidia_driver_root == "/run/nvidia/driver" and by_alias.flags.dev_root == "/run/nvidia/driver"
    env = load_config(env={"NVIDIA_CTK_PATH": "/old", "NVIDIA_CDI_HOOK_PATH": "/new",
                           "CONTAINER_DRIVER_ROOT": "/c", "IMEX_CHANNEL_IDS": "", "IMEX_REQUIRED": "false",
                           "GFD_USE_NODE_FEATURE_API": "false", "CDI_FEATURE_FLAGS": "a,b"})
    assert env.flags.plugin.nvidia_ctk_path == "/new"  # NVIDIA reads NVIDIA_CDI_HOOK_PATH first
    assert env.flags.plugin.container_driver_root == "/c"
    assert env.imex.channel_ids == () and not env.imex.required
    assert not env.flags.use_node_feature_api and env.flags.plugin.cdi_feature_flags == ("a", "b")
    # IMEX channels are not injected by kubegpu: asking for them is refused, naming the setting.
    with pytest.raises(ConfigError, match=r"IMEX_CHANNEL_IDS: '0,3' is not supported"):
        load_config(env={"IMEX_CHANNEL_IDS": "0,3"})
    with pytest.raises(ConfigError, match=r"config.imex.required: True is not supported"):
        load_config(file={"imex": {"required": True}})
    with pytest.raises(ConfigError, match="--nvidia-cdi-hook-path and --nvidia-ctk-path are the same setting"):
        load_config(flags={"nvidia-cdi-hook-path": "/a", "nvidia-ctk-path": "/b"})
    with pytest.raises(ConfigError, match="IMEX_CHANNEL_IDS: 'x' is not a channel number"):
        load_config(env={"IMEX_CHANNEL_IDS": "1,x"})


def test_env_and_flag_value_forms() -> None:
    c = load_config(env={"FAIL_ON_INIT_ERROR": "false", "DEVICE_LIST_STRATEGY": "volume-mounts,cdi-annotations",
                         "PASS_DEVICE_SPECS": "1", "KUBEGPU_HEALTH_RECOVERY_INTERVAL": "1m30s"})
    assert c.flags.fail_on_init_error is False and c.flags.plugin.pass_device_specs is True
    assert c.flags.plugin.device_list_strategy == ("volume-mounts", "cdi-annotations")
    assert c.kubegpu.health_recovery_interval_s == 90.0
    c = load_config(flags={"device-list-strategy": ["cdi-cri"], "fail-on-init-error": True,
                           "health-recovery-interval": "250ms"})
    assert c.flags.plugin.device_list_strategy == ("cdi-cri",) and c.kubegpu.health_recovery_interval_s == 0.25


def test_device_list_strategy_as_string_or_list_in_file() -> None:
    one = load_config(file={"flags": {"plugin": {"deviceListStrategy": "cdi-cri"}}})
    two = load_config(file={"flags": {"plugin": {"deviceListStrategy": ["envvar", "cdi-annotations"]}}})
    assert one.flags.plugin.device_list_strategy == ("cdi-cri",)
    assert two.flags.plugin.device_list_strategy == ("envvar", "cdi-annotations")


def test_sharing_devices_forms_and_rename() -> None:
    c = load_config(file={"sharing": {"mps": {"renameByDefault": True, "failRequestsGreaterThanOne": True,
                                              "resources": [
                                                  {"name": "gpu", "replicas": 4, "devices": 2},
                                                  {"name": "nvidia.com/mig-1g.10gb", "replicas": 2,
                                                   "devices": [0, "1:0",
                                                               "GPU-8a5b4f2e-1c3d-4e5f-9a0b-1c2d3e4f5a6b"]},
                                              ]}}})
    assert c.sharing.strategy == "mps"
    a, b = c.sharing.mps.resources
    assert a.devices == ReplicaDevices(all=False, count=2)
    assert b.devices.ids == ("0", "1:0", "GPU-8a5b4f2e-1c3d-4e5f-9a0b-1c2d3e4f5a6b")
    assert c.sharing.active.served_name(a) == "nvidia.com/gpu.shared"
    assert c.sharing.mps.fail_requests_greater_than_one


def test_mps_wins_over_time_slicing_and_fails_requests_above_one_by_default() -> None:
    both = load_config(file={"sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": 4}]},
                                         "mps": {"resources": [{"name": "gpu", "replicas": 2}]}}})
    assert both.sharing.strategy == "mps" and both.sharing.active.resources[0].replicas == 2
    assert both.sharing.replication("nvidia.com/gpu").replicas == 2  # type: ignore[union-attr]
    assert both.sharing.mps.fail_requests_greater_than_one is True
    assert both.sharing.time_slicing.fail_requests_greater_than_one is False
    explicit = load_config(file={"sharing": {"mps": {"failRequestsGreaterThanOne": False,
                                                     "resources": [{"name": "gpu", "replicas": 2}]}}})
    assert explicit.sharing.mps.fail_requests_greater_than_one is False


def test_resource_patterns_and_kubegpu_section() -> None:
    c = load_config(file={"resources": {"gpus": [{"pattern": "*A100*", "name": "a100"}],
                                        "migs": [{"pattern": "1g.*", "name": "example.com/small"}]},
                          "kubegpu": {"replicaChoice": "packed", "cdiSpecDir": "/etc/cdi",
                                      "healthRecoveryInterval": 5, "metricsAddress": "127.0.0.1:0"}})
    assert c.resources.gpus[0].name == "nvidia.com/a100"
    assert c.resources.migs[0].name == "example.com/small"
    assert c.kubegpu.replica_choice == "packed" and c.kubegpu.cdi_spec_dir == "/etc/cdi"
    assert c.kubegpu.health_recovery_interval_s == 5.0 and c.kubegpu.metrics_address == "127.0.0.1:0"


def test_resource_config_short_form_becomes_time_slicing_renames() -> None:
    c = load_config(flags={"resource-config": "gpu:sharedgpu:4,mig-3g.20gb:small:2"})
    a, b = c.sharing.time_slicing.resources
    assert (a.name, a.rename, a.replicas) == ("nvidia.com/gpu", "nvidia.com/sharedgpu", 4)
    assert (b.name, b.rename, b.replicas) == ("nvidia.com/mig-3g.20gb", "nvidia.com/small", 2)
    assert c.kubegpu.resource_config == ("gpu:sharedgpu:4", "mig-3g.20gb:small:2")
    env = load_config(env={"RESOURCE_CONFIG": "mig-3g.20gb:gpu:1"})
    assert env.sharing.time_slicing.resources[0].rename == "nvidia.com/gpu"


def test_health_env() -> None:
    def critical(env: dict[str, str], xid: int) -> bool:
        return not load_config(env=env).health.is_ignored(xid)

    assert critical({}, 48) and not critical({}, 13)
    h = {"DP_DISABLE_HEALTHCHECKS": "48, 63"}
    assert not critical(h, 48) and not critical(h, 63) and critical(h, 79)
    off = {"DP_DISABLE_HEALTHCHECKS": "all", "DP_ENABLE_HEALTHCHECKS": "79"}
    assert not critical(off, 48) and critical(off, 79)
    assert critical({"DP_ENABLE_HEALTHCHECKS": "13"}, 13)
    assert load_config(env={"DP_DISABLE_HEALTHCHECKS": "xids"}).health.checks_off
    # NVIDIA logs and skips a malformed entry rather than failing the plugin.
    assert load_config(env={"DP_ENABLE_HEALTHCHECKS": "x,13"}).health.enabled == frozenset({13})


def test_durations() -> None:
    assert parse_duration("1h30m", "d") == 5400.0 and parse_duration("500ms", "d") == 0.5
    assert parse_duration(7, "d") == 7.0 and parse_duration("12", "d") == 12.0
    for bad in ("soon", "5 minutes", "", "-3s", True):
        with pytest.raises(ConfigError, match="d: "):
            parse_duration(bad, "d")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"file": {"flags": {"migStrategy": "foo"}}},
         "config.flags.migStrategy: 'foo' is not one of none, single, mixed"),
        ({"env": {"MIG_STRATEGY": "foo"}}, "MIG_STRATEGY: 'foo' is not one of none, single, mixed"),
        ({"flags": {"mig-strategy": "foo"}}, "--mig-strategy: 'foo' is not one of none, single, mixed"),
        ({"file": {"flags": {"migStrategi": "none"}}}, "config.flags.migStrategi: unknown key"),
        ({"file": {"flags": {"plugin": {"deviceListStrategy": ["envvar", "tape"]}}}},
         "config.flags.plugin.deviceListStrategy: 'tape' is not one of envvar, volume-mounts"),
        ({"file": {"flags": {"plugin": {"deviceListStrategy": []}}}},
         "config.flags.plugin.deviceListStrategy: empty"),
        ({"file": {"flags": {"plugin": {"deviceIDStrategy": "serial"}}}},
         "config.flags.plugin.deviceIDStrategy: 'serial' is not one of uuid, index"),
        ({"file": {"flags": {"plugin": {"colour": "red"}}}}, "config.flags.plugin.colour: unknown key"),
        ({"file": {"flags": {"failOnInitError": "maybe"}}},
         "config.flags.failOnInitError: 'maybe' is not a boolean"),
        ({"env": {"FAIL_ON_INIT_ERROR": "yes"}}, "FAIL_ON_INIT_ERROR: 'yes' is not a boolean"),
        ({"file": {"flags": "none"}}, "config.flags: expected a mapping"),
        ({"file": {"flags": {"plugin": "x"}}}, "config.flags.plugin: expected a mapping"),
        ({"file": {"version": "v2"}}, "config.version: 'v2' is not supported"),
        ({"file": {"versions": "v1"}}, "config.versions: unknown key"),
        ({"file": {"kubegpu": {"sharedSlots": -1}}}, "config.kubegpu.sharedSlots: -1 is not between 0 and"),
        ({"file": {"kubegpu": {"sharedSlots": "many"}}}, "config.kubegpu.sharedSlots: 'many' is not an integer"),
        ({"file": {"kubegpu": {"replicaChoice": "random"}}},
         "config.kubegpu.replicaChoice: 'random' is not one of distributed, packed"),
        ({"file": {"kubegpu": {"healthRecoveryInterval": "later"}}},
         "config.kubegpu.healthRecoveryInterval: 'later' is not a duration"),
        ({"flags": {"frobnicate": True}}, "--frobnicate: unknown flag"),
        ({"file": {"sharing": {"timeSlicing": {}}}}, None),
        ({"file": {"sharing": {"timeSlicing": {"renameByDefault": True}}}},
         "config.sharing.timeSlicing.resources: no resources specified"),
        ({"file": {"sharing": {"timeSlicing": {"resources": [{"name": "gpu"}]}}}},
         "config.sharing.timeSlicing.resources[0].replicas: no replicas specified"),
        ({"file": {"sharing": {"timeSlicing": {"resources": [{"replicas": 2}]}}}},
         "config.sharing.timeSlicing.resources[0].name: no resource name specified"),
        ({"file": {"sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": 0}]}}}},
         "config.sharing.timeSlicing.resources[0].replicas: number of replicas must be >= 2"),
        ({"file": {"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 1}]}}}},
         "config.sharing.mps.resources[0].replicas: number of replicas must be >= 2, got 1"),
        ({"file": {"sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2, "devices": "some"}]}}}},
         "devices set as 'some' but the only valid string input is 'all'"),
        ({"file": {"sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2, "devices": 0}]}}}},
         "a count of devices must be > 0"),
        ({"file": {"sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2,
                                                              "devices": ["GPU-bad"]}]}}}},
         "config.sharing.timeSlicing.resources[0].devices[0]: 'GPU-bad' is not a GPU index"),
        ({"file": {"sharing": {"timeSlicing": {"strategy": "packed", "resources": [{"name": "gpu", "replicas": 2}]}}}},
         "config.sharing.timeSlicing.strategy: unknown time-slicing strategy 'packed'"),
        ({"file": {"sharing": {"timeSlicing": {"resources": [{"name": "g p u", "replicas": 2}]}}}},
         "config.sharing.timeSlicing.resources[0].name: 'g p u' is not a valid extended resource name"),
        ({"file": {"resources": {"gpus": [{"pattern": "", "name": "gpu"}]}}},
         "config.resources.gpus[0].pattern"),
        ({"flags": {"resource-config": "gpu:sharedgpu"}}, "--resource-config: 'gpu:sharedgpu' is not <resource>"),
        ({"flags": {"resource-config": "gpu:sharedgpu:0"}}, "replicas '0' is not a whole number from 1"),
        ({"env": {"RESOURCE_CONFIG": "gpu:a:2,gpu:b:2"}}, "a resource is configured twice"),
        ({"file": {"sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2}]}}},
          "flags": {"resource-config": "gpu:x:2"}}, "nvidia.com/gpu is already in sharing.timeSlicing"),
        ({"file": {"imex": {"channelIDs": ["a"]}}}, "config.imex.channelIDs"),
    ],
)
def test_every_error_names_its_key(kwargs: dict, message: str | None) -> None:
    if message is None:
        assert load_config(**kwargs).sharing.strategy == "none"
        return
    with pytest.raises(ConfigError) as err:
        load_config(**kwargs)
    assert message in str(err.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(file=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("flags: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(file=bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top"):
        load_config(file=bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(file=empty).flags.mig_strategy == "none"


def test_short_form_parser_alone() -> None:
    (r,) = parse_resource_config(["example.com/gpu:example.com/half:2"])
    assert (r.name, r.rename, r.replicas) == ("example.com/gpu", "example.com/half", 2)


def test_every_option_has_flag_env_and_help() -> None:
    flags = [n for o in OPTIONS for n in (o.flag, *o.aliases)]
    envs = [e for o in OPTIONS for e in o.envs]
    assert len(set(flags)) == len(flags) and len(set(envs)) == len(envs)
    for required in ("MIG_STRATEGY", "FAIL_ON_INIT_ERROR", "NVIDIA_DRIVER_ROOT", "PASS_DEVICE_SPECS",
                     "DEVICE_LIST_STRATEGY", "DEVICE_ID_STRATEGY", "MPS_ROOT", "CDI_ANNOTATION_PREFIX",
                     "NVIDIA_CTK_PATH", "CONTAINER_DRIVER_ROOT", "GDS_ENABLED", "MOFED_ENABLED"):
        assert required in envs
    assert all(o.help for o in OPTIONS)
    # Every default, as --help shows it, loads back through its own flag.
    for o in OPTIONS:
        shown = shown_default(o)
        if shown != "none":
            load_config(flags={o.flag: shown})


def test_pod_resources_socket_flag_env_and_default() -> None:
    assert load_config({}, {}, None).kubegpu.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert load_config({}, {"KUBEGPU_POD_RESOURCES_SOCKET": "/e.sock"}, None).kubegpu.pod_resources_socket == "/e.sock"
    cfg = load_config({"pod-resources-socket": "/f.sock"}, {"KUBEGPU_POD_RESOURCES_SOCKET": "/e.sock"}, None)
    assert cfg.kubegpu.pod_resources_socket == "/f.sock"


def test_replicated_gpus_offer_no_share_slots() -> None:
    sharing = {"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}}
    assert load_config({}, {}, sharing).kubegpu.shared_slots == 0
    assert load_config({"resource-config": "gpu:sharedgpu:4"}, {}, None).kubegpu.shared_slots == 0
    assert load_config({"resource-config": "gpu:sharedgpu:4", "shared-slots": "0"}, {}, None).kubegpu.shared_slots == 0
    with pytest.raises(ConfigError, match=r"--shared-slots: 50 share slots .* would overcommit"):
        load_config({"shared-slots": "50"}, {}, sharing)
    assert load_config({}, {}, None).kubegpu.shared_slots == 100
