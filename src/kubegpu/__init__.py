"""kubegpu: GPU scheduling for Kubernetes.

Roles (node daemon, scheduler extender, admission webhook, simulator, CLI) share
one pure core: :mod:`kubegpu.model` (what is asked for and what exists) and
:mod:`kubegpu.placement` (where it goes).
"""

__version__ = "0.1.0"
