"""What the node daemon publishes to the API server: the node's ``Device`` object (its codec is
:mod:`kubegpu.model.device_object`) and capacity (:mod:`.capacity`), through a publisher (:mod:`.publisher`).
"""
