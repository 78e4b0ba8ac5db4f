"""Test seams on the node's handoff (:mod:`kubegpu.node.handoff`), kept out of the product: a pod watch that
lags the kubelet's (the stand-in cluster's ``watch_lag_s``, injected through ``make_resolver(watch_feed=…)``)
and how many records a resolver holds pending for a resource (what tests and benchmarks wait on).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from kubegpu.kube.informer import WatchEvent
from kubegpu.node.handoff import HandoffResolver
from kubegpu.node.handoff import matching as M
from kubegpu.node.handoff.resolver import WatchHandler


def lagging(delay_s: float, name: str) -> Callable[[WatchHandler], WatchHandler] | None:
    """A ``watch_feed`` that applies each event ``delay_s`` after it came, in the order they came, on one
    thread (a watch that lags still delivers in order); None when there is no lag."""
    if delay_s <= 0:
        return None

    def wrap(apply: WatchHandler) -> WatchHandler:
        queue: deque[tuple[float, WatchEvent]] = deque()
        ready = threading.Condition()

        def run() -> None:
            while True:
                with ready:
                    while not queue:
                        ready.wait()
                    due, ev = queue[0]
                    wait = due - time.monotonic()
                    if wait > 0:
                        ready.wait(wait)
                        continue
                    queue.popleft()
                apply(ev)

        threading.Thread(target=run, name=name, daemon=True).start()

        def feed(ev: WatchEvent) -> None:
            with ready:
                queue.append((time.monotonic() + delay_s, ev))
                ready.notify()
        return feed
    return wrap


def pending_count(resolver: HandoffResolver, resource: str, count: int) -> int:
    """How many records ``resolver`` holds pending for an Allocate of ``count`` devices of ``resource``."""
    with resolver._lock:
        return len(M.pending(resolver._pods.values(), resolver._served, resource, count))
