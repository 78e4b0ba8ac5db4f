"""kubegpu as a DRA driver (``gpu.kubegpu.io``): the kubelet plugin, ResourceSlices and claim preparation.

With Dynamic Resource Allocation (``resource.k8s.io/v1``, Kubernetes 1.34+) the scheduler writes
its choice into each ResourceClaim's ``status.allocation`` and the kubelet calls the driver's
``NodePrepareResources`` with the claim's identity; nothing has to be matched by guesswork as
with the device plugins. The modules:

- :mod:`.names` the driver's names (driver, CDI kind, attribute and taint keys);
- :mod:`.slices` pure: a node inventory + health -> the pool's ResourceSlice bodies;
- :mod:`.prepare` NodePrepareResources / NodeUnprepareResources, CDI specs per claim, the checkpoint;
- :mod:`.kube` the API edge: reading claims, publishing and republishing slices;
- :mod:`.plugin` the gRPC services on unix sockets (registration, DRA v1 + v1beta1, health);
- :mod:`.daemon` wires them for ``kubegpu node --kubelet-plugin dra``.
"""
