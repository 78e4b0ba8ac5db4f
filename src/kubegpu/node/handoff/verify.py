"""Checking the handoff against the kubelet's own word: PodResources ``List``.

The real kubelet lists one ``ContainerDevices`` entry per device (the same resource name
repeated) and app containers only, so entries are grouped per container and resource before
anything is compared. A container whose kubelet devices name other GPUs than it was served (or,
never served by this node, than its record) is a divergence: the resolver raises a Warning Event
on the pod, counts it, and rewrites the acknowledgement with what the kubelet holds so the
accounting follows the kubelet. A pod the extender did not place that holds whole GPUs is
acknowledged too, so the extender stops placing shares there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kubegpu.model import resources as R
from kubegpu.model.records import Ack
from kubegpu.node import rpc
from kubegpu.node.handoff.entries import PodView
from kubegpu.node.handoff.matching import fits, is_handoff_resource, short, uuid_of

if TYPE_CHECKING:
    from kubegpu.node.handoff.resolver import HandoffResolver

log = logging.getLogger(__name__)

POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"

Holding = tuple[str, str, str, str, list[str]]  # namespace, pod, container, resource, device IDs


def group(rows: Iterable[Holding]) -> dict[tuple[str, str], dict[str, list[str]]]:
    """(namespace/pod, container) -> resource -> every device ID the kubelet lists for it."""
    out: dict[tuple[str, str], dict[str, list[str]]] = {}
    for ns, pod, container, resource, ids in rows:
        per = out.setdefault((f"{ns}/{pod}", container), {})
        per.setdefault(resource, []).extend(ids)
    return out


@dataclass(frozen=True, slots=True)
class Divergence:
    pod_key: str
    uid: str
    container: str
    resource: str
    kubelet_ids: tuple[str, ...]
    message: str
    # The container was served exactly its own record's amounts on the GPUs the kubelet holds: two
    # identical waiting records were taken in another order than the kubelet admitted them. Nothing
    # ran on a wrong GPU or with wrong limits; only the acknowledgement names the other pod's GPUs.
    swap: bool = False
    # The kubelet's devices are exactly what this node served as another container's record ((uid,
    # container)): the container was told that record's amounts, which its acknowledgement must carry.
    served_as: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Bypass:
    """Whole GPUs the kubelet gave a container of a pod without a record."""

    pod_key: str
    uid: str
    container: str
    resource: str
    kubelet_ids: tuple[str, ...]


def served_gpus(ack: Ack) -> set[str]:
    if ack.grants:
        return {g.mig_uuid or g.uuid for g in ack.grants}
    return {uuid_of(d) for d in ack.devices}


def compare(pods: Mapping[str, PodView], served: Mapping[tuple[str, str], Ack],
            grouped: Mapping[tuple[str, str], Mapping[str, list[str]]],
            given: Mapping[tuple[str, frozenset[str]], tuple[str, str, Ack]] | None = None,
            ) -> tuple[list[Divergence], list[Bypass], list[Bypass]]:
    """Divergences, whole GPUs held by pods without a record, and containers holding exactly their record
    that no acknowledgement names yet (served by an earlier process of this daemon whose write never landed:
    acknowledged now, so the extender's accounting and wait follow)."""
    divergent: list[Divergence] = []
    bypass: list[Bypass] = []
    unacked: list[Bypass] = []
    # GPUs -> the amounts served there as some container's record (to tell a reorder from a divergence)
    given_on: dict[frozenset[str], set[tuple[int, int, int]]] = {}
    for pv in pods.values():
        for _c, a in {**pv.acks, **{c: a for (uid, c), a in served.items() if uid == pv.uid}}.items():
            given_on.setdefault(frozenset(served_gpus(a)), set()).update(
                (g.core, g.memory_bytes, g.memory_ratio) for g in a.grants)
    served_ids = {(a.resource, frozenset(a.devices)): k for k, a in served.items()}
    served_ids.update({k: (uid, c) for k, (uid, c, _a) in (given or {}).items()})
    by_uid = {pv.uid: pv.key for pv in pods.values()}
    for (pod_key, container), per in grouped.items():
        p = pods.get(pod_key)
        if p is None:
            continue
        for resource, ids in per.items():
            if not is_handoff_resource(resource) or not ids:
                continue
            kgpus = [uuid_of(i) for i in ids]
            other = served_ids.get((resource, frozenset(ids)))
            if other is not None and other[0] != p.uid and (p.uid, container) not in served:
                who = f"{by_uid.get(other[0], 'a pod now gone')} container {other[1]}"
                divergent.append(Divergence(
                    pod_key, p.uid, container, resource, tuple(ids),
                    f"container {container}: the kubelet holds {resource} {','.join(short(i) for i in ids)}, "
                    f"which this node served as the record of {who}", served_as=other))
                continue
            entry = next((e for e in p.entries if e.container == container and e.resource == resource), None)
            if entry is None:
                if p.whole_bypass and resource == R.NVIDIA_GPU:
                    bypass.append(Bypass(pod_key, p.uid, container, resource, tuple(ids)))
                continue
            ack = served.get((p.uid, container)) or p.acks.get(container)
            held = ",".join(short(i) for i in ids)
            own = {(g.core, g.memory_bytes, g.memory_ratio) for g in entry.grants}  # a swap gives these elsewhere
            if ack is not None:
                got = served_gpus(ack)
                if got != set(kgpus):
                    divergent.append(Divergence(
                        pod_key, p.uid, container, resource, tuple(ids),
                        f"container {container}: the kubelet holds {resource} {held}, but it was served "
                        f"GPU(s) {','.join(sorted(short(g) for g in got))}",
                        swap=given_on.get(frozenset(kgpus)) == own))
            elif not fits(entry, kgpus):
                divergent.append(Divergence(
                    pod_key, p.uid, container, resource, tuple(ids),
                    f"container {container}: the kubelet holds {resource} {held}, but its record names "
                    f"GPU(s) {','.join(short(u) for u in entry.uuids)}",
                    swap=given_on.get(frozenset(kgpus)) == own))
            else:
                unacked.append(Bypass(pod_key, p.uid, container, resource, tuple(ids)))
    return divergent, bypass, unacked


def list_pod_resources(socket_path: str = POD_RESOURCES_SOCKET, timeout_s: float = 5.0) -> list[Holding]:
    """(namespace, pod, container, resource, device IDs) for every entry the kubelet lists, and one
    ``(namespace, pod, "", "", [])`` row per pod listed (a pod that failed admission has no devices).
    Raises :class:`rpc.CallFailed` when the kubelet does not answer. Not from the gRPC loop's thread."""
    from kubegpu.node.proto import podresources_grpc as prgrpc
    from kubegpu.node.proto import podresources_pb2 as prpb

    resp = rpc.unix_call(socket_path, lambda ch: prgrpc.PodResourcesListerStub(ch).List(
        prpb.ListPodResourcesRequest()), timeout_s)
    out: list[Holding] = []
    for p in resp.pod_resources:
        out.append((p.namespace, p.name, "", "", []))  # listed: admitted, or failed admission
        for c in p.containers:
            for d in c.devices:
                out.append((p.namespace, p.name, c.name, d.resource_name, list(d.device_ids)))
    return out


class Verifier:
    """Checks the handoff against PodResources every ``interval_s`` (a daemon thread, stoppable)."""

    def __init__(self, resolver: HandoffResolver, socket_path: str = POD_RESOURCES_SOCKET,
                 interval_s: float = 30.0) -> None:
        self.resolver, self.socket_path, self.interval_s = resolver, socket_path, interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def poke(self) -> None:
        """Check soon: an Allocate was just served (the kubelet records it as the call returns)."""
        self._wake.set()

    def check(self) -> list[str]:
        try:
            holdings = list_pod_resources(self.socket_path)
        except rpc.CallFailed as e:
            log.debug("PodResources unavailable at %s: %s", self.socket_path, e)
            return []
        return self.resolver.verify(holdings)

    def start(self) -> Verifier:
        def loop() -> None:
            while not self._stop.is_set():
                if self._wake.wait(self.interval_s):
                    self._wake.clear()
                    if self._stop.wait(0.05):  # let the kubelet finish the admission
                        return
                if self._stop.is_set():
                    return
                try:
                    self.check()
                except Exception:  # never let one bad answer end verification
                    log.exception("handoff verification failed; retrying in %.0fs", self.interval_s)

        self._thread = threading.Thread(target=loop, name="handoff-verifier", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
