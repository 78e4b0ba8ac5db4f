"""From the node config (flags > env > file, ``node.config``) to the daemon's :class:`NodeOptions`.

The one place where the typed :class:`~kubegpu.node.config.Config` meets the daemon: the
resource expansion (``node.resources.expand``) bound to the config, the plugin settings, the
health rules (``DP_DISABLE_HEALTHCHECKS`` / ``DP_ENABLE_HEALTHCHECKS`` read as NVIDIA reads
them) and the kubegpu-only knobs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import Any

from kubegpu.node.config import Config, load_config
from kubegpu.node.daemon import NodeOptions
from kubegpu.node.deviceplugin.resources import expand, plugin_settings


def node_options(config: Config, **overrides: Any) -> NodeOptions:
    """The daemon's options for ``config``; ``overrides`` set NodeOptions fields directly (tests,
    the benchmark) and ``settings=`` may carry PluginSettings overrides as a dict."""
    settings_over = overrides.pop("settings", {})
    settings = plugin_settings(config)
    if settings_over:
        settings = dataclasses.replace(settings, **settings_over)
    values: dict[str, Any] = {
        "plugin_dir": config.kubegpu.device_plugin_dir,
        "expand": partial(expand, config=config),
        "settings": settings,
        "fail_on_init_error": config.flags.fail_on_init_error,
        "xid_policy": config.health,
        "recovery_interval_s": config.kubegpu.health_recovery_interval_s,
        "share_enforcement": config.kubegpu.share_enforcement,
        "mps_binary": config.kubegpu.mps_control_binary,
        "mps_server_uid": config.kubegpu.mps_server_uid,
        "pod_resources_socket": config.kubegpu.pod_resources_socket,
    }
    values.update(overrides)
    return NodeOptions(**values)


def load_node_options(flags: Mapping[str, Any], env: Mapping[str, str], **overrides: Any) -> NodeOptions:
    """Read the config (flag > env > file) and build the options; raises ConfigError."""
    return node_options(load_config(flags=flags, env=env), **overrides)
