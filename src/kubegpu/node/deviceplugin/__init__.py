"""The kubelet device-plugin path: one gRPC server per resource (:mod:`.server`), the resources and device
IDs it advertises (:mod:`.resources`, :mod:`.plugin_model`), Allocate (:mod:`.allocate`, rendering the
container's :class:`~kubegpu.node.container_edits.ContainerEdits`), GetPreferredAllocation
(:mod:`.preferred`), the CDI spec for the CDI strategies (:mod:`.cdi`) and the seam to the scheduler's
recorded choice (:mod:`.resolver`). Nothing is imported here, so the DRA daemon loads none of it.
"""
