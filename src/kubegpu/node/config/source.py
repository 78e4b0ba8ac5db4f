"""The node's one configuration, loaded whole: flags, environment and the file the node's label selects.

Everything the node derives from its configuration (the resources it serves, the GFD labels it publishes,
the DRA driver's settings) comes from one :class:`~kubegpu.node.config.Config` loaded here, so no part can
read a different file than another: with NVIDIA's per-node selection, the ``config.map`` entry the node's
``nvidia.com/device-plugin.config`` label names replaces the default file for all of them. A reload loads
the whole configuration again (the label may have changed) and every part takes the new one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kubegpu.node.config.load import load_config
from kubegpu.node.config.model import Config
from kubegpu.node.config.select import CONFIG_LABEL, with_node_config

log = logging.getLogger("kubegpu.node.config")


class NodeConfigLabel:
    """The node's ``nvidia.com/device-plugin.config`` label, read from its Node (never without an API server).

    ``watch`` polls it and asks for a reload when it changes, as NVIDIA's config-manager restarts the plugin.
    ``kubeconfig``: None without an API server, "" for in-cluster credentials, else a kubeconfig path."""

    POLL_S = 30.0

    def __init__(self, kubeconfig: str | None, node_name: str) -> None:
        self.kubeconfig = kubeconfig
        self.node_name = node_name
        self.value: str | None = None
        self._client: Any = None

    @property
    def enabled(self) -> bool:
        return self.kubeconfig is not None and bool(self.node_name)

    def _fetch(self) -> str | None:
        from kubegpu.kube.client import make_client
        from kubegpu.kube.resources import Node

        if self._client is None:
            self._client = make_client(self.kubeconfig or None)
        node = self._client.get(Node, self.node_name)
        return (node.metadata.labels or {}).get(CONFIG_LABEL)

    def read(self) -> str | None:
        """The label now (the last value read when the API server cannot be reached)."""
        if not self.enabled:
            return None
        try:
            self.value = self._fetch()
        except Exception as exc:  # the API server is briefly away: keep the last known selection
            log.warning("cannot read this node's config label (%s); keeping %r", exc, self.value)
        return self.value

    def watch(self, stop: threading.Event, reload: Callable[[], None]) -> None:
        """Call ``reload`` whenever the label changes, until ``stop``."""
        if not self.enabled:
            return

        def loop() -> None:
            while not stop.wait(self.POLL_S):
                before = self.value
                try:
                    now = self._fetch()
                except Exception:
                    continue
                if now != before:
                    log.info("node label %s changed %r -> %r: reloading", CONFIG_LABEL, before, now)
                    reload()

        threading.Thread(target=loop, name="config-label", daemon=True).start()


class ConfigSource:
    """Loads the node's configuration: ``flags`` (as given on the command line) over ``env`` over the file,
    where the file is the entry ``label()`` selects (the default file without a label). Raises ConfigError."""

    def __init__(self, flags: Mapping[str, Any], env: Mapping[str, str],
                 label: Callable[[], str | None] = lambda: None) -> None:
        self.flags = dict(flags)
        self.env = env
        self.label = label

    def load(self) -> Config:
        return load_config(flags=with_node_config(self.flags, self.env, self.label()), env=self.env)
