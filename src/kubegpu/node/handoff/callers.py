"""Which pods an identity-less kubelet call can be for, by the kubelet's own list of its pods.

The kubelet's ``GetPreferredAllocation`` and ``Allocate`` name devices, never a pod. But the kubelet adds a pod
to its pod manager before it admits it, and PodResources ``List`` enumerates that pod manager (kubelet
``HandlePodAdditions``: ``podManager.AddPod`` comes before ``canAdmitPod``, whose device manager makes the
calls; ``v1PodResourcesServer.List``: ``GetPods``, or ``GetActivePods`` from 1.34). So a ``List`` read while a
call is in progress names the pod the call is for, together with the pods the kubelet admitted or rejected
before; and it admits one pod at a time. Among the listed pods, the call's pod is one that still has a
container of the call's kind (resource, device count) without devices of that resource. When this node's view
knows every listed pod, it can name every pod the call can be for without asking the API server; a listed pod
the view does not have (its watch behind the kubelet's) could be any, and only a fresh read says what it asks.

Pure: no I/O, no locks (the resolver calls it under its lock with one ``List`` read during the call).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass

from kubegpu.node.handoff.entries import PodView

# namespace, pod, container, resource, device IDs: a row of the kubelet's PodResources List, and one row with
# container "" per pod listed (kubegpu.node.handoff.verify.list_pod_resources)
Row = tuple[str, str, str, str, list[str]]


@dataclass(frozen=True, slots=True)
class Callers:
    """Who a call of one kind can be for, by the kubelet's list and this node's view."""

    possible: tuple[str, ...]  # listed pods the view knows that may still make a call of the kind
    unknown: tuple[str, ...]  # listed pods the view does not have: they may be anything
    # Of the unknown, those the view saw end (deleted, or finished) before a call of the kind was served: the
    # kubelet takes a pod's addition before its deletion, so it may still admit such a pod.
    ended: tuple[str, ...] = ()


def open_kinds(pod: PodView, served: Container[tuple[str, str]]) -> frozenset[tuple[str, str, int]]:
    """(container, resource, device count) of ``pod``'s calls still to come as far as this node knows: not served
    by this process, named by no acknowledgement, the pod not running. Kept for a pod that ends, they are what
    it may still ask if the kubelet admits it before it sees the end."""
    if pod.running:
        return frozenset()
    return frozenset((c, res, n) for c, res, n, _init in pod.asks if (pod.uid, c) not in served and c not in pod.acks)


def lists(rows: Iterable[Row], pod_key: str) -> bool:
    """Whether the kubelet's list names ``pod_key`` (namespace/name)."""
    return any(f"{ns}/{name}" == pod_key for ns, name, *_ in rows)


def _asks(pod_key: str, kinds: Iterable[tuple[str, str, int]], done: Container[tuple[str, str]], resource: str,
          count: int) -> bool:
    """Whether one of ``kinds`` (container, resource, count) is a call of (``resource``, ``count``) whose
    container the kubelet holds no such devices for (``done``)."""
    return any(r == resource and n == count and (pod_key, c) not in done for c, r, n in kinds)


def held(rows: Iterable[Row], resource: str) -> set[tuple[str, str]]:
    """(pod, container) the kubelet holds ``resource`` devices for: their calls of that resource are done."""
    return {(f"{ns}/{name}", c) for ns, name, c, res, ids in rows if c and res == resource and ids}


def open_calls(pod: PodView, done: Container[tuple[str, str]], served: Container[tuple[str, str]],
               resource: str, count: int) -> bool:
    """Whether ``pod`` may still make a call of (``resource``, ``count``): a container of that kind that the
    kubelet holds no such devices for (``done``), this process did not serve and no acknowledgement names. A
    running pod's calls are done. Init containers never show in the kubelet's list, so theirs stay open until
    served, acknowledged or the pod runs."""
    return _asks(pod.key, open_kinds(pod, served), done, resource, count)


def callers(pods: Mapping[str, PodView], served: Container[tuple[str, str]], rows: Iterable[Row],
            resource: str, count: int,
            ended: Mapping[str, frozenset[tuple[str, str, int]]] | None = None) -> Callers:
    """The listed pods a call of (``resource``, ``count``) can be for, the listed pods the view lacks, and of
    those the ones it saw end with such a call open (``ended``: pod -> its :func:`open_kinds` at its end)."""
    rows = list(rows)
    listed = dict.fromkeys(f"{ns}/{name}" for ns, name, _c, _r, _ids in rows)
    done = held(rows, resource)
    possible, unknown, gone = [], [], []
    for key in listed:
        pod = pods.get(key)
        if pod is None:
            unknown.append(key)
            if _asks(key, (ended or {}).get(key, ()), done, resource, count):
                gone.append(key)
        elif open_calls(pod, done, served, resource, count):
            possible.append(key)
    return Callers(tuple(possible), tuple(unknown), tuple(gone))
