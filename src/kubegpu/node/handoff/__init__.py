"""The handoff, node side: serving each ``Allocate`` as the extender's record for exactly the GPUs the
kubelet chose (docs/handoff.md).

- :mod:`.entries`: a bound pod as records per container (pure);
- :mod:`.matching`: which record an Allocate serves, GetPreferredAllocation steering, conflicts (pure);
- :mod:`.callers`: which pods a call can be for, by the kubelet's own PodResources list (pure);
- :mod:`.resolver`: the stateful resolver: local view, consistent reads, acknowledgements;
- :mod:`.verify`: the PodResources check, grouped per container.
"""

from kubegpu.model.annotations import DEVICE_ASSIGNED
from kubegpu.node.handoff.matching import uuid_of
from kubegpu.node.handoff.resolver import HandoffMetrics, HandoffResolver, make_resolver
from kubegpu.node.handoff.verify import POD_RESOURCES_SOCKET, Verifier, list_pod_resources

__all__ = ["DEVICE_ASSIGNED", "POD_RESOURCES_SOCKET", "HandoffMetrics", "HandoffResolver", "Verifier",
           "list_pod_resources", "make_resolver", "uuid_of"]
