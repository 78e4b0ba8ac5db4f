"""The node's device health: the shared table every kubelet path reads (:mod:`.state`), the narrow reader
interface the device-plugin servers take (:class:`~kubegpu.node.health.state.HealthReader`), and the
monitor thread that turns driver events into health changes (:mod:`.monitor`).
"""
