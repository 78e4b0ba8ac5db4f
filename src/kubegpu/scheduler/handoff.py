"""The handoff queue: which pods each node is being handed, and which binds wait for their turn there.

The kubelet's GetPreferredAllocation and Allocate calls carry no pod identity, so with two bound pods of the
same kind (kubelet resource and device count) waiting on a node, the node could serve one pod's record to the
other's call. The extender keeps one such pod at a time per kind and node (docs/handoff.md): a pod bound and
not yet served by its node waits here, and bind lets the next pod of its kind through only once it is served.
This module holds that queue and nothing else: what each GPU holds is :mod:`.accounting`'s, which tells the
queue when a pod starts and stops waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kubegpu.model.records import Shape, ambiguous
from kubegpu.model.versions import version_number as _rv

log = logging.getLogger(__name__)

Kind = tuple[str, int]  # kubelet resource, device count: what the kubelet's calls for a container look like
_ENDED = " (ended)"  # the suffix of a pod's key under which it waits once ended (keep_waiting_until_seen)


class HandoffQueue:
    """Per node, the pods bound there and not yet served by its node daemon, with the shapes they wait with;
    indexed by kind, so a question about one pod reads only the nodes where its own kinds wait."""

    def __init__(self, *, enabled: bool = True) -> None:
        # Off only where no kubegpu node serves the records (simulations, extender-only tests): there a
        # bound pod is never acknowledged and would hold its kind forever.
        self.enabled = enabled
        # node -> pod -> the shapes of its containers bound but not yet served by the node
        self.pending: dict[str, dict[str, frozenset[Shape]]] = {}
        # kind -> node -> the first pod (in the node's waiting order) with a container of that kind waiting there
        self.pending_kinds: dict[Kind, dict[str, str]] = {}
        # Beside it: the reason given on each such node (built once per change), and the nodes each pod waits
        # on (to find the rare pod that would otherwise wait on itself).
        self._kind_reasons: dict[Kind, dict[str, str]] = {}
        self._waits_on: dict[str, set[str]] = {}
        # node -> the resourceVersion up to which its node daemon's view is complete (A.HANDOFF_SEEN), for nodes
        # that publish it; and node -> pod that ended while waiting there -> the version of its end. Such a pod
        # keeps its kind waiting (under a key of its own) until its node has seen the end: before that, the
        # node's view may still show it waiting and serve its record to the next pod's call.
        self.node_seen: dict[str, int] = {}
        self.ended: dict[str, dict[str, int]] = {}
        # node -> why its node daemon does not serve its GPUs now (restarting, or its kubelet has none of our
        # devices healthy): a bind there waits until it serves again (scheduler/nodes.py NodeDaemons).
        self.not_serving: dict[str, str] = {}
        # node -> binds waiting in the extender for their turn there (prioritize sends a pod to the shortest queue)
        self.waiting_binds: dict[str, int] = {}
        # Set (and replaced) at every change that can let a waiting bind through: waiters wake on it.
        self._changed: asyncio.Event | None = None

    # ---- who waits ---------------------------------------------------------------------------------
    def wait(self, node: str, key: str, shapes: frozenset[Shape]) -> None:
        """``key`` on ``node`` waits for the node's handoff with these shapes (replacing what it waited with;
        an empty set keeps its place in the node's order and blocks nothing)."""
        per = self.pending.setdefault(node, {})
        old = per.get(key)
        if old == shapes:
            return
        per[key] = shapes
        self._waits_on.setdefault(key, set()).add(node)
        self._reindex(node, shapes if old is None else old | shapes)
        self._notify()

    def served(self, node: str, key: str) -> bool:
        """``key`` no longer waits on ``node`` (served, released or gone). Whether it was waiting."""
        per = self.pending.get(node)
        old = per.pop(key, None) if per is not None else None
        if old is None:
            return False
        if (nodes := self._waits_on.get(key)) is not None:
            nodes.discard(node)
            if not nodes:
                del self._waits_on[key]
        self._reindex(node, old)
        self._notify()
        return True

    def keep_waiting_until_seen(self, key: str, version: int) -> None:
        """``key`` ended (deleted, or failed by its kubelet) at ``version`` while waiting: on each node that
        publishes how far its view has got and has not got that far, its kinds keep waiting until it has."""
        for node in list(self._waits_on.get(key, ())):
            shapes = self.pending.get(node, {}).get(key)
            seen = self.node_seen.get(node)
            if not shapes or seen is None or seen >= version:
                continue
            ended = key + _ENDED
            self.wait(node, ended, shapes)
            per = self.ended.setdefault(node, {})
            per[ended] = max(version, per.get(ended, -1))
            log.debug("pod %s ended at %d while waiting on %s, whose daemon has seen up to %d: its kinds wait "
                      "until it has seen that", key, version, node, seen)

    def node_progress(self, node: str, value: str | None) -> None:
        """``node``'s A.HANDOFF_SEEN (None: not published, or the node is gone): the pods that ended while
        waiting there, now seen ended by its daemon, stop holding their kinds."""
        seen = _rv(value) if value is not None else -1
        if seen < 0:
            self.node_seen.pop(node, None)  # a daemon that does not publish: nothing to wait for
        else:
            self.node_seen[node] = seen
        per = self.ended.get(node)
        if not per:
            return
        for ended in [k for k, version in per.items() if seen < 0 or version <= seen]:
            del per[ended]
            self.served(node, ended)
        if not per:
            del self.ended[node]

    def node_daemon(self, node: str, why: str | None) -> None:
        """``node``'s daemon does not serve its GPUs now (``why``), or serves them (None): binds held for the
        node are let through only once it serves, so the kubelet has healthy devices when it admits them."""
        if why is None:
            if self.not_serving.pop(node, None) is not None:
                log.info("node %s: its kubegpu node daemon serves again", node)
                self._notify()
        elif self.not_serving.get(node) != why:
            if node not in self.not_serving:
                log.info("node %s: nothing placed on its GPUs: %s", node, why)
            self.not_serving[node] = why

    def _reindex(self, node: str, shapes: frozenset[Shape]) -> None:
        """Who waits first on ``node`` for each kind of ``shapes``, after a change of the node's waiting pods."""
        per = self.pending.get(node, {})
        for kind in {(res, count) for res, count, _ in shapes}:
            first = next((k for k, waiting in per.items() if any(w[:2] == kind for w in waiting)), None)
            nodes = self.pending_kinds.get(kind)
            if first is not None:
                if nodes is None:
                    nodes = self.pending_kinds[kind] = {}
                    self._kind_reasons[kind] = {}
                if nodes.get(node) != first:
                    nodes[node] = first
                    self._kind_reasons[kind][node] = _reason(first, kind[1], kind[0])
            elif nodes is not None:
                nodes.pop(node, None)
                self._kind_reasons[kind].pop(node, None)
                if not nodes:
                    del self.pending_kinds[kind], self._kind_reasons[kind]

    # ---- whose turn --------------------------------------------------------------------------------
    def blocked(self, key: str, shapes: frozenset[Shape]) -> dict[str, str]:
        """Nodes where another pod is bound, not yet served by the node, and asks the same (resource,
        device count) as one of ``shapes`` (pod ``key``'s), with why. Bind checks it and holds in one step,
        so asynchronous binds cannot slip past it. Costs the waiting pods of the nodes indexed under the
        pod's own kinds, not every waiting pod."""
        if not self.pending_kinds or not self.enabled:
            return {}
        kinds = {(res, count) for res, count, _ in shapes}
        lists = [(kind, nodes) for kind in kinds if (nodes := self.pending_kinds.get(kind))]
        if not lists:
            return {}
        out: dict[str, str] = {}
        if len(lists) == 1:
            # One kind waits anywhere (always so for a pod with one GPU container): the index names who
            # waits first on each node, and any waiting pod that matches the pod matches on that kind.
            (kind, firsts), = lists
            out = dict(self._kind_reasons[kind])
            for node in self._waits_on.get(key, ()):  # where the pod itself waits (a recreated name): skip it
                if firsts.get(node) == key:
                    del out[node]
                    if (reason := self._blocked_on(node, key, shapes)) is not None:
                        out[node] = reason
            return out
        for node in dict.fromkeys(n for _, nodes in lists for n in nodes):
            if (reason := self._blocked_on(node, key, shapes)) is not None:
                out[node] = reason
        return out

    def _blocked_on(self, node: str, key: str, shapes: frozenset[Shape]) -> str | None:
        """Why a pod ``key`` asking ``shapes`` waits on ``node``: the first other waiting pod there whose
        kubelet calls would look the same, or None."""
        for other, waiting in self.pending[node].items():
            same = ambiguous(waiting, shapes) if other != key else None
            if same is not None:
                res, count, _ = same
                return _reason(other, count, res)
        return None

    def _why_waits(self, node: str, key: str, shapes: frozenset[Shape]) -> str | None:
        return self.not_serving.get(node) or self.blocked(key, shapes).get(node)

    async def turn(self, node: str, key: str, shapes: frozenset[Shape], deadline: float) -> str | None:
        """Wait (until ``deadline``, on the loop's clock) until ``node``'s daemon serves and no other pod of
        ``key``'s kinds waits on ``node``: None once it is its turn, else why not. The caller holds right after,
        with no await in between, so two binds of a kind can never both pass. Counted in :attr:`waiting_binds`
        while it waits."""
        why = self._why_waits(node, key, shapes)
        if why is None:
            return None
        loop = asyncio.get_running_loop()
        self.waiting_binds[node] = self.waiting_binds.get(node, 0) + 1
        try:
            while why is not None:
                left = deadline - loop.time()
                if left <= 0:
                    return why
                if self._changed is None:
                    self._changed = asyncio.Event()
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), left)
                why = self._why_waits(node, key, shapes)
            return None
        finally:
            left_waiting = self.waiting_binds.get(node, 1) - 1
            if left_waiting > 0:
                self.waiting_binds[node] = left_waiting
            else:
                self.waiting_binds.pop(node, None)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None


def _reason(other: str, count: int, resource: str) -> str:
    if other.endswith(_ENDED):
        return (f"pod {other[:-len(_ENDED)]} ended before its node's daemon served it, and the daemon has not "
                f"seen it end yet: until it has, a call for {count} {resource} there could be served that pod's "
                "record, so the next such pod waits")
    return (f"pod {other} is being handed to the kubelet with {count} {resource}; the kubelet's calls carry "
            "no pod, so one such pod at a time per node")
