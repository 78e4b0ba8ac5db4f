"""The admission webhook: validates every GPU request and rewrites it to the canonical resources.

``app`` is the HTTP application, ``review`` the AdmissionReview wire format,
``tls`` the reloading serving certificate, ``server`` the uvicorn wiring,
``certs`` a small CA for clusters (and tests) without cert-manager. The rules
themselves live in :mod:`kubegpu.model.normalise`, shared with ``kubegpu check``.
"""
