"""``kubegpu scheduler``: the kube-scheduler HTTP extender (filter, prioritize, bind) with per-GPU placement.

:mod:`.wire` is the extender v1 JSON; :mod:`.state` the cluster view and its
accounting; :mod:`.app` the ASGI app (verbs, debug API, metrics); :mod:`.service`
wires the informers, the app and the server together.
"""
