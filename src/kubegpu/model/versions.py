"""resourceVersions as numbers, in one place.

Kubernetes calls a resourceVersion opaque, but every API server backed by etcd writes the store's revision
there, one counter for the whole cluster. The handoff orders what two readers have seen by it: a node daemon
publishes how far its view of its pods has got and the extender compares that with the version of a pod's
end (``kubegpu.io/handoff-seen-version``, docs/handoff.md); the node's resolver ignores a lagging watch's
events older than a LIST it has made.
"""

from __future__ import annotations


def version_number(value: object) -> int:
    """A resourceVersion as a number; an unparsable one is -1 (older than any)."""
    try:
        return int(str(value))
    except ValueError:
        return -1
