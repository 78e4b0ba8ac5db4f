"""``kubegpu demo``: the whole system on one machine, with no cluster and no GPU.

The stand-in API server, kubelets and kube-scheduler (``kubegpu_standins``) host the real
roles: ``kubegpu node`` daemons on fake topologies, the ``kubegpu scheduler`` extender and the
``kubegpu webhook``, each a process of its own, all talking over their real protocols on
127.0.0.1 and unix sockets. :mod:`kubegpu.demo.scenario` drives a fixed story through them
and :mod:`kubegpu.demo.verify` checks the end state.
"""
