"""Building a lightkube client from a kubeconfig file, the in-cluster service account, or the environment.

One precedence rule for every role: an explicit ``--kubeconfig`` wins; otherwise
the in-cluster service account; otherwise ``$KUBECONFIG`` or ``~/.kube/config``.
"""

from __future__ import annotations

from pathlib import Path

import httpx2
import msgspec
from lightkube import AsyncClient, Client
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.core.exceptions import ConfigError

FIELD_MANAGER = "kubegpu"


class ClientConfigError(RuntimeError):
    """No usable cluster configuration; the message says where it looked."""


def load_config(kubeconfig: str | Path | None = None, context: str | None = None) -> SingleConfig:
    try:
        if kubeconfig is not None:
            path = Path(kubeconfig)
            if not path.is_file():
                raise ClientConfigError(f"kubeconfig {str(path)!r} does not exist")
            cfg = KubeConfig.from_file(path)
        else:
            cfg = KubeConfig.from_env()
        single = cfg.get(context_name=context)
    except ConfigError as e:
        raise ClientConfigError(f"cannot load a cluster configuration: {e}") from None
    except (OSError, ValueError, KeyError) as e:
        raise ClientConfigError(f"cannot read kubeconfig {kubeconfig!s}: {e}") from None
    if single is None:
        raise ClientConfigError("no current context in the kubeconfig")
    return _without_tls_store(single)


def _without_tls_store(single: SingleConfig) -> SingleConfig:
    """A cluster served over plain HTTP (a local API server, the stand-ins) with no CA of its own.

    lightkube builds an SSL context for every client, and without a CA it loads the system's whole
    certificate store into it: memory the node daemon would hold for nothing (its budget is in
    ``docs/performance.md``), since plain HTTP never uses it. Marking the cluster as not verified skips
    the load and changes nothing else, since there is no TLS to verify. An ``https://`` server is left
    as it is.
    """
    cluster = single.cluster
    if not cluster.server.lower().startswith("http://") or cluster.insecure \
            or cluster.certificate_auth or cluster.certificate_auth_data:
        return single
    return single._replace(cluster=msgspec.structs.replace(cluster, insecure=True))


def _timeout(seconds: float) -> httpx2.Timeout:
    return httpx2.Timeout(seconds)


def make_client(kubeconfig: str | Path | None = None, *, context: str | None = None,
                timeout_s: float = 10.0, field_manager: str = FIELD_MANAGER) -> Client:
    """A synchronous client (node daemon, CLI)."""
    return Client(load_config(kubeconfig, context), timeout=_timeout(timeout_s), field_manager=field_manager)


def make_async_client(kubeconfig: str | Path | None = None, *, context: str | None = None,
                      timeout_s: float = 10.0, field_manager: str = FIELD_MANAGER) -> AsyncClient:
    """An asyncio client (the extender serves HTTP and watches in one event loop)."""
    return AsyncClient(load_config(kubeconfig, context), timeout=_timeout(timeout_s),
                       field_manager=field_manager)


def lightkube_http(client: AsyncClient) -> tuple[httpx2.AsyncClient, str | None]:
    """The httpx2 client a lightkube AsyncClient sends through (the kubeconfig's base URL, TLS and
    credentials, its connection pool) and the client's field manager, for a write too hot for lightkube's
    request building (:func:`kubegpu.kube.writes.abind_pod`). lightkube keeps both as private attributes;
    ``tests/kube/test_kube_binding_write.py`` fails if that changes."""
    generic = client._client
    http = generic._client
    if not isinstance(http, httpx2.AsyncClient):
        raise TypeError(f"lightkube's AsyncClient sends through {type(http).__name__}, not httpx2.AsyncClient")
    return http, generic._field_manager
