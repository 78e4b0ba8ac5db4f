"""The process environment the node daemon runs with on a node, in one place: both DaemonSets
(``kubegpu.install.render.node_objects`` for the device plugins, ``kubegpu.install.dra.daemonset``
for DRA) set it, and ``bench/node.py`` and ``bench/dra.py`` start the daemon with it, so what the
benchmarks measure is what a node gets.

``MALLOC_ARENA_MAX=2``: glibc gives each thread that allocates its own malloc arena (up to eight
per core), and each arena keeps its own free memory. The daemon's threads (gRPC workers, the
lifecycle loop, the health monitor, the metrics server) run Python under one interpreter lock, so
separate arenas buy no parallelism, only resident memory, which grows after kubelet restarts (new
servers, new worker threads; docs/performance.md). Two arenas keep the main thread's allocations apart
from the workers'.
"""

from __future__ import annotations

from typing import Final

NODE_ENV: Final[dict[str, str]] = {"MALLOC_ARENA_MAX": "2"}


def env_entries() -> list[dict[str, str]]:
    """``NODE_ENV`` as a container's ``env`` list."""
    return [{"name": k, "value": v} for k, v in NODE_ENV.items()]
