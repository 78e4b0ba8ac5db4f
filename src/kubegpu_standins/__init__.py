"""In-process stand-ins for the Kubernetes parts that cannot run here (kubelet device manager,
API server). They enforce what the real ones do, for the tests and for ``kubegpu demo``;
no kubegpu role imports them."""
