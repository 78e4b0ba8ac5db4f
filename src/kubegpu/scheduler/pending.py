"""The pods waiting for a node, as the API server's watch shows them: what bind reads instead of a GET.

Bind must work from the API server's pod, never from what a ``/filter`` body said about it (that body is
kube-scheduler's copy, and anyone who can reach the extender can write one). A GET at every bind would be
an HTTP round trip per pod placed, the largest part of bind's cost; so the extender's pod watch
(``scheduler.service``) covers every pod, not only bound ones, and keeps of each unbound pod what bind
reads; bind takes the version the API server last sent. What keeps that as good as a GET:

- **The version is a precondition.** Bind posts the Binding with the pod's UID *and* the
  resourceVersion it chose the GPUs for (the API server checks both in the write that binds). A pod
  changed since the watch's copy (an annotation edited: the webhook lets anything but the records change
  on UPDATE), or recreated under its name, is refused with a 409, and bind starts over from the API
  server's pod. So a pod is only ever bound with a choice made for the very version bound, whatever the
  watch's lag: the GET alone never had that guarantee (the pod could change between the GET and the
  Binding).
- **Only "yes" is answered from the copy.** Every refusal (too many GPU containers, the handoff wait run
  out, no fit, a UID other than the one kube-scheduler sent) is answered only after a GET, from the API
  server's pod (the handoff wait is not waited twice: both reads share one deadline).
- **A miss is a GET.** A pod the watch has not shown yet (created a moment ago), or did not keep (below),
  is read from the API server: no answer depends on the watch's timing, only its cost.

One watch serves both the accounting (bound pods) and this copy, so nothing depends on the order of
events between two watches: a pod's binding reaches both through the same event.

What is kept per pending pod (thousands may wait in a large cluster): the fields
:class:`~kubegpu.kube.slim.SlimPod` declares, with only the annotations bind's readers consult (every
``kubegpu.io/`` key, the legacy GPU affinity, the mirror-pod mark), and only for pods that ask for an
extended resource (kube-scheduler calls the extender only for those); any other pod keeps its identity
alone and is read with a GET if bind is ever asked about it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubegpu.kube.slim import SlimMeta, SlimPod, SlimSpec
from kubegpu.model.legacy import LEGACY_AFFINITY
from kubegpu.model.resources import KUBEGPU_PREFIX

MIRROR_POD = "kubernetes.io/config.mirror"  # a static pod's mirror (scheduler.accounting.follows_its_node)
READ_AT_BIND = frozenset({LEGACY_AFFINITY, MIRROR_POD})  # besides every kubegpu.io/ key


def read_at_bind(key: str) -> bool:
    """Whether an annotation is one bind's readers consult (``parse_pod``: the GPU model, the legacy
    affinity; ``pod_policies``; ``requires_nvlink``; ``follows_its_node``: the mirror mark)."""
    return key.startswith(KUBEGPU_PREFIX) or key in READ_AT_BIND


def asks_extended_resource(spec: SlimSpec | None) -> bool:
    """A container or init container names a domain-qualified resource (the only pods kube-scheduler
    sends an extender with ``managedResources``)."""
    if spec is None:
        return False
    for containers in (spec.containers, spec.initContainers):
        for c in containers or ():
            res = c.resources or {}
            for section in (res.get("limits"), res.get("requests")):
                if isinstance(section, dict) and any("/" in k for k in section):
                    return True
    return False


def kept_for_bind(pod: SlimPod) -> SlimPod:
    """What the watch of unbound pods keeps of one: its identity and version, and for a pod that asks for
    an extended resource what bind reads (see the module's docstring)."""
    meta = pod.metadata or SlimMeta()
    kept = SlimMeta(name=meta.name, namespace=meta.namespace, uid=meta.uid, resourceVersion=meta.resourceVersion)
    if not asks_extended_resource(pod.spec):
        return SlimPod(metadata=kept)
    if meta.annotations:
        kept.annotations = {k: v for k, v in meta.annotations.items() if read_at_bind(k)} or None
    kept.ownerReferences = meta.ownerReferences
    return SlimPod(apiVersion="v1", kind="Pod", metadata=kept, spec=pod.spec)


class PendingPods:
    """The lookup bind makes in the pod watch's cache (namespace/name -> what :func:`kept_for_bind` kept for
    an unbound pod; bound pods' entries are the accounting's tombstones and never match)."""

    def __init__(self, cache: Mapping[str, Any]) -> None:
        self._cache = cache

    def get(self, key: str, uid: str = "") -> dict[str, Any] | None:
        """The unbound pod ``namespace/name`` as the watch last showed it (a fresh dict), or None when the watch
        has not shown it unbound, did not keep it, or shows another UID than ``uid`` (only a GET can then say
        which is current)."""
        kept = self._cache.get(key)
        meta = kept.metadata if isinstance(kept, SlimPod) else None
        spec = kept.spec if isinstance(kept, SlimPod) else None
        if (meta is None or spec is None or spec.nodeName or spec.containers is None or not meta.resourceVersion
                or (uid and meta.uid != uid)):
            return None
        return kept.to_dict()  # type: ignore[union-attr]
