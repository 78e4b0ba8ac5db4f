"""Where GPUs come from: NVML on a real node, a topology file everywhere else.

Both backends implement :class:`kubegpu.inventory.base.InventoryBackend`, so the
node daemon never knows which one it talks to.
"""
