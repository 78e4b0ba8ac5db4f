"""Loading: flags, environment and file layered into the one :class:`Config` (flag > env > file > default).

This is the only place a :class:`Config` is built. Settings NVIDIA's plugin has but kubegpu cannot honour
are refused here with a message that names them (:mod:`kubegpu.node.config.refused`), never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from kubegpu.node.config.model import (
    CONFIG_VERSION,
    Config,
    ConfigError,
    DraConfig,
    Flags,
    GfdFlags,
    Imex,
    KubegpuSettings,
    PluginFlags,
    ReplicaSharing,
    Resources,
    Sharing,
    XidPolicy,
)
from kubegpu.node.config.options import CONFIG_FILE_ENV, CONFIG_FILE_FLAG, OPTIONS, OPTIONS_BY_FLAG, OPTIONS_BY_KEY
from kubegpu.node.config.parse import (
    _mapping,
    _parse_value,
    _patterns,
    _replica_sharing,
    parse_resource_config,
)
from kubegpu.node.config.refused import check_refused
from kubegpu.node.config.select import CONFIG_DIR_FLAG
from kubegpu.node.mps.capability import selected_mode

_TOP_KEYS: Final = ("version", "flags", "resources", "sharing", "imex", "kubegpu")


def _walk(data: Mapping[str, Any], prefix: str, out: dict[str, tuple[Any, str]]) -> None:
    """Collect the scalar options of a section, rejecting unknown keys."""
    section_keys = {o.key[len(prefix) + 1:].split(".")[0] for o in OPTIONS if o.key.startswith(prefix + ".")}
    for key, value in data.items():
        path = f"{prefix}.{key}"
        if key not in section_keys:
            raise ConfigError(f"config.{path}: unknown key (allowed: {', '.join(sorted(section_keys))})")
        if path in OPTIONS_BY_KEY:
            if value is not None:
                out[path] = (value, f"config.{path}")
        elif isinstance(value, Mapping):
            _walk(value, path, out)
        elif value is not None:
            raise ConfigError(f"config.{path}: expected a mapping, got {type(value).__name__}")


def read_config_file(path: str | Path) -> Mapping[str, Any]:
    """The YAML (or JSON) document of a config file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror or exc}") from exc
    # Imported here, not with the module: a node without a config file never loads PyYAML (resident memory
    # the node daemon would carry for its whole life).
    import yaml

    from kubegpu.model import yaml_text

    try:
        data = yaml_text.load(text)
    except (yaml.YAMLError, yaml_text.TooDeep, RecursionError) as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {str(exc)[:300]}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path}: expected a mapping at the top, got {type(data).__name__}")
    return data


def load_config(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                file: str | Path | Mapping[str, Any] | None = None) -> Config:
    """Build the one :class:`Config` from command-line flags, environment and file.

    ``flags`` holds only the flags the user set, keyed by flag name without dashes
    (``mig-strategy``); values may be strings as typed or already-typed values. ``env`` is
    usually ``os.environ``. ``file`` is a path or an already-parsed document; without it the
    ``config-file`` flag, then ``CONFIG_FILE``, name the file. Precedence: flag > env > file >
    default. Raises :class:`ConfigError`.
    """
    flags = dict(flags or {})
    env = env or {}
    for name in flags:
        if name not in OPTIONS_BY_FLAG and name not in (CONFIG_FILE_FLAG, CONFIG_DIR_FLAG):
            raise ConfigError(f"--{name}: unknown flag")
    for opt in OPTIONS:
        given = [n for n in (opt.flag, *opt.aliases) if flags.get(n) is not None]
        if len(given) > 1:
            raise ConfigError(f"--{given[0]} and --{given[1]} are the same setting; give one")
    source = ""
    if file is None:
        file = flags.get(CONFIG_FILE_FLAG) or env.get(CONFIG_FILE_ENV) or None
    if isinstance(file, str | Path):
        source = str(file)
        doc = read_config_file(file)
    else:
        doc = file or {}
    doc = _mapping(doc, "config", _TOP_KEYS)

    version = doc.get("version", CONFIG_VERSION)
    if version != CONFIG_VERSION:
        raise ConfigError(f"config.version: {version!r} is not supported (only {CONFIG_VERSION})")

    # Layer the scalar options: file, then env, then flags.
    chosen: dict[str, tuple[Any, str]] = {}
    for section in ("flags", "kubegpu", "imex"):
        value = doc.get(section)
        if value is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"config.{section}: expected a mapping, got {type(value).__name__}")
            _walk(value, section, chosen)
    for opt in OPTIONS:
        for name in opt.envs:  # the first one set wins, as urfave/cli reads EnvVars
            if env.get(name, "") != "":
                chosen[opt.key] = (env[name], name)
                break
        for name in (opt.flag, *opt.aliases):
            if flags.get(name) is not None:
                chosen[opt.key] = (flags[name], f"--{name}")
                break
    values = {o.key: o.default for o in OPTIONS}
    for key, (raw, where) in chosen.items():
        values[key] = _parse_value(OPTIONS_BY_KEY[key], raw, where)
    check_refused(values, chosen)

    resources_doc = _mapping(doc.get("resources"), "config.resources", ("gpus", "migs"))
    resources = Resources(gpus=_patterns(resources_doc.get("gpus"), "config.resources.gpus"),
                          migs=_patterns(resources_doc.get("migs"), "config.resources.migs"))
    sharing_doc = _mapping(doc.get("sharing"), "config.sharing", ("timeSlicing", "mps"))
    sharing = Sharing(
        time_slicing=_replica_sharing(sharing_doc.get("timeSlicing"), "config.sharing.timeSlicing", mps=False),
        mps=_replica_sharing(sharing_doc.get("mps"), "config.sharing.mps", mps=True),
    )
    short = parse_resource_config(values["kubegpu.resourceConfig"],
                                  chosen.get("kubegpu.resourceConfig", ("", "--resource-config"))[1])
    if short:
        if sharing.mps.resources:
            raise ConfigError(
                "--resource-config: cannot be combined with sharing.mps (it configures time-slicing)")
        taken = {r.name for r in sharing.time_slicing.resources}
        for r in short:
            if r.name in taken:
                raise ConfigError(f"--resource-config: {r.name} is already in sharing.timeSlicing.resources")
        ts = sharing.time_slicing
        sharing = Sharing(time_slicing=ReplicaSharing(ts.rename_by_default, ts.fail_requests_greater_than_one,
                                                      ts.resources + short), mps=sharing.mps)

    # Replicas of whole GPUs and fine-grained share slots on the same GPUs would each account the GPU
    # as theirs and overcommit it: with replica sharing of nvidia.com/gpu the slots default to 0.
    replicated = sharing.replication("nvidia.com/gpu")
    if replicated is not None and values["kubegpu.sharedSlots"] > 0:
        if "kubegpu.sharedSlots" in chosen:
            raise ConfigError(
                f"{chosen['kubegpu.sharedSlots'][1]}: {values['kubegpu.sharedSlots']} share slots on GPUs that "
                f"nvidia.com/gpu replicas ({replicated.replicas} per GPU) also share would overcommit them; "
                "set it to 0 or remove the replica sharing")
        values["kubegpu.sharedSlots"] = 0

    imex = Imex(channel_ids=tuple(values["imex.channelIDs"]), required=values["imex.required"])

    v = values
    return Config(
        version=CONFIG_VERSION,
        flags=Flags(
            mig_strategy=v["flags.migStrategy"],
            fail_on_init_error=v["flags.failOnInitError"],
            restart_on_device_unhealthy=v["flags.restartOnDeviceUnhealthy"],
            mps_root=v["flags.mpsRoot"],
            nvidia_driver_root=v["flags.nvidiaDriverRoot"],
            nvidia_dev_root=v["flags.nvidiaDevRoot"],
            gdrcopy_enabled=v["flags.gdrcopyEnabled"],
            gds_enabled=v["flags.gdsEnabled"],
            mofed_enabled=v["flags.mofedEnabled"],
            use_node_feature_api=v["flags.useNodeFeatureAPI"],
            device_discovery_strategy=v["flags.deviceDiscoveryStrategy"],
            plugin=PluginFlags(
                pass_device_specs=v["flags.plugin.passDeviceSpecs"],
                device_list_strategy=tuple(v["flags.plugin.deviceListStrategy"]),
                device_id_strategy=v["flags.plugin.deviceIDStrategy"],
                cdi_annotation_prefix=v["flags.plugin.cdiAnnotationPrefix"],
                nvidia_ctk_path=v["flags.plugin.nvidiaCTKPath"],
                container_driver_root=v["flags.plugin.containerDriverRoot"],
                cdi_feature_flags=tuple(v["flags.plugin.cdiFeatureFlags"]),
            ),
            gfd=GfdFlags(
                oneshot=v["flags.gfd.oneshot"],
                no_timestamp=v["flags.gfd.noTimestamp"],
                sleep_interval_s=v["flags.gfd.sleepInterval"],
                output_file=v["flags.gfd.outputFile"],
                machine_type_file=v["flags.gfd.machineTypeFile"],
            ),
        ),
        resources=resources,
        sharing=sharing,
        imex=imex,
        kubegpu=KubegpuSettings(
            shared_slots=v["kubegpu.sharedSlots"],
            replica_choice=v["kubegpu.replicaChoice"],
            health_recovery_interval_s=v["kubegpu.healthRecoveryInterval"],
            cdi_spec_dir=v["kubegpu.cdiSpecDir"],
            device_plugin_dir=v["kubegpu.devicePluginDir"],
            metrics_address=v["kubegpu.metricsAddress"],
            resource_config=tuple(v["kubegpu.resourceConfig"]),
            pod_resources_socket=v["kubegpu.podResourcesSocket"],
            share_enforcement=selected_mode(v["kubegpu.shareEnforcement"]),
            mps_server_uid=v["kubegpu.mpsServerUid"],
            mps_control_binary=v["kubegpu.mpsControlBinary"],
            dra=DraConfig(shared_gpus=v["kubegpu.dra.sharedGpus"], plugins_dir=v["kubegpu.dra.pluginsDir"],
                          registry_dir=v["kubegpu.dra.registryDir"], state_dir=v["kubegpu.dra.stateDir"],
                          resync_s=v["kubegpu.dra.resync"]),
        ),
        health=XidPolicy.from_env(env),
        config_file=source,
    )
