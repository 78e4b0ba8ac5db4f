"""Generated gRPC stubs for the kubelet device-plugin (v1beta1) and PodResources (v1) APIs.

The ``.proto`` sources are ours, written from contracts.md; ``generate.py`` rebuilds the stubs.
"""
