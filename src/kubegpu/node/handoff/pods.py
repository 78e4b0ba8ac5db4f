"""A pod as the node's handoff reads it: decoded straight into the few fields it consults, and what the
watch keeps of each pod once the resolver has its own view.

The resolver watches and lists every pod bound to its node, GPU or not (a node runs up to 110). Decoded
into lightkube's full ``Pod`` model, a workload's pod is many kilobytes of Python objects (containers' env,
probes, mounts, status, managed fields) the handoff never reads, decoded again at every consistent read,
and the informer's cache of them grows the daemon's memory with the node's pods (``bench/node.py --cluster
--node-pods 110``, docs/performance.md). :class:`HandoffPod` is the extender's
:class:`~kubegpu.kube.slim.SlimPod` (what ``model.request.parse_pod`` and ``model.records.read_pod``
consult: identity, version, annotations, containers' resources, node, phase) plus the creation time
that ranks the node's waiting records (:func:`kubegpu.node.handoff.entries.pod_view`); its ``to_dict``
gives those fields as the full model's ``to_dict`` does. The watch's cache keeps a :func:`tombstone`.
"""

from __future__ import annotations

from kubegpu.kube.slim import SlimMeta, SlimPod


class HandoffMeta(SlimMeta, omit_defaults=True):
    creationTimestamp: str | None = None  # as the API server writes it (RFC 3339, UTC)


class HandoffPod(SlimPod, omit_defaults=True):
    """A v1.Pod with the handoff's fields only; ``client.list/watch/patch(HandoffPod, ...)`` as with ``Pod``."""

    metadata: HandoffMeta | None = None


def tombstone(pod: HandoffPod) -> HandoffPod:
    """What the watch's cache keeps of a pod: its identity and version, node, phase and containers'
    resources, without its annotations (the records, and whatever else is there: often the client's
    last-applied configuration). The resolver keeps its own view
    (:class:`~kubegpu.node.handoff.entries.PodView`); of a pod the informer finds gone at a relist it reads
    those fields only (whether it was a GPU pod here that may have ended unserved, and which to forget)."""
    meta = pod.metadata or HandoffMeta()
    return HandoffPod(metadata=HandoffMeta(name=meta.name, namespace=meta.namespace, uid=meta.uid,
                                           resourceVersion=meta.resourceVersion),
                      spec=pod.spec, status=pod.status)
