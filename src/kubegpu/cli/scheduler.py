"""``kubegpu scheduler``: run the kube-scheduler HTTP extender (filter, prioritize, bind).

Serves ``/filter``, ``/prioritize`` and ``/bind`` (also under ``/scheduler/``), the DeviceShare
debug API, ``/metrics`` and ``/healthz`` (503 until the watches of Nodes, Devices and Pods have
listed once) on ``--listen``, which is loopback by default: kube-scheduler runs beside it in the same
pod. ``--metrics-listen`` adds a listener with only ``/metrics`` and ``/healthz`` (and the debug API,
which names every GPU pod, only with ``--metrics-debug-api``). Exit codes: 0 clean stop, 2 bad
arguments or configuration (a certificate that does not load included).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import typer

from kubegpu.cli.main import app
from kubegpu.model.limits import DEFAULT_MAX_GPU_CONTAINERS
from kubegpu.placement.reservations import ReservationConfig
from kubegpu.scheduler.inflight import DEFAULT_FILTER_WAIT_S

_RESERVE = ReservationConfig()  # the reservation flags' defaults

EXIT_CONFIG = 2


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise typer.BadParameter(f"{value!r} is not HOST:PORT")
    return (host.strip("[]") or "127.0.0.1"), int(port)


def _policy(value: str) -> str:
    from kubegpu.placement import get_policy

    try:
        get_policy(value)
    except KeyError as e:
        raise typer.BadParameter(str(e).strip('"')) from None
    return value


def _cannot_listen(host: str, port: int) -> str:
    """Why ``host:port`` cannot be served ('' when it can): checked up front, so a taken port is one clear
    line rather than uvicorn's exit from inside the event loop."""
    try:
        with socket.create_server((host, port)):
            return ""
    except OSError as e:
        return e.strerror or str(e)


HANDOFF_WAIT_ENV = "KUBEGPU_HANDOFF_WAIT"  # "0", "false" or "no": no node daemon acknowledges bound pods
HANDOFF_WAIT_S_ENV = "KUBEGPU_HANDOFF_WAIT_S"  # seconds a bind waits for its node's handoff turn, in [0, 60]


def environment_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """The extender's settings that come from its environment (the manifests' and the stand-ins'), as
    :class:`~kubegpu.scheduler.service.ExtenderService` arguments: read here, at the role's entry, only."""
    from kubegpu.model.resources import declared_gpu_resources
    from kubegpu.model.signing import load_key
    from kubegpu.scheduler.bind import DEFAULT_HANDOFF_WAIT_S

    raw = environ.get(HANDOFF_WAIT_S_ENV, "")
    try:
        wait_s = float(raw) if raw else DEFAULT_HANDOFF_WAIT_S
    except ValueError:
        wait_s = -1.0
    if not 0 <= wait_s <= 60:
        logging.getLogger("kubegpu.scheduler").error("%s=%r is not a number of seconds in [0, 60]; using %g",
                                                     HANDOFF_WAIT_S_ENV, raw, DEFAULT_HANDOFF_WAIT_S)
        wait_s = DEFAULT_HANDOFF_WAIT_S
    return {"handoff_wait": environ.get(HANDOFF_WAIT_ENV, "1") not in ("0", "false", "no"),
            "handoff_wait_s": wait_s, "gpu_resources": declared_gpu_resources(environ),
            "record_key": load_key(environ)}


@app.command("scheduler", short_help="Run the scheduler extender beside kube-scheduler.")
def scheduler(
    kubeconfig: Path | None = typer.Option(None, "--kubeconfig", metavar="FILE",
                                           help="kubeconfig file (default: in-cluster, "
                                           "then $KUBECONFIG, then ~/.kube/config)"),
    listen: str = typer.Option("127.0.0.1:8888", "--listen", metavar="HOST:PORT",
                               help="HOST:PORT to serve the extender on "
                               "(loopback by default: kube-scheduler calls it from the same pod)"),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", metavar="FILE",
                                         help="serve HTTPS with this certificate (PEM)"),
    tls_key: Path | None = typer.Option(None, "--tls-key", metavar="FILE", help="private key of --tls-cert (PEM)"),
    node_policy: str = typer.Option("kubegpu", "--node-policy", callback=_policy, metavar="POLICY",
                                    help="cluster default node-level policy (pods override with the "
                                         "kubegpu.io/node-policy annotation): random, dotprod, clustering, "
                                         "packing, bestfit, fgd, spread, kubegpu"),
    gpu_policy: str = typer.Option("kubegpu", "--gpu-policy", callback=_policy, metavar="POLICY",
                                   help="cluster default GPU-level policy (annotation kubegpu.io/gpu-policy)"),
    metrics_listen: str = typer.Option("", "--metrics-listen", metavar="HOST:PORT",
                                       help="HOST:PORT for /metrics and /healthz on their own listener "
                                       "(they are always on --listen too); the debug API only with "
                                       "--metrics-debug-api"),
    metrics_debug_api: bool = typer.Option(False, "--metrics-debug-api",
                                           help="also serve the DeviceShare debug API (every GPU pod's "
                                                "namespace, name and GPUs) on --metrics-listen"),
    metrics_per_gpu: bool = typer.Option(False, "--metrics-per-gpu",
                                         help="also export each GPU's allocated compute and memory (two series "
                                              "per GPU; every scrape holds the extender ~0.5 s at 40,000 GPUs): "
                                              "for small clusters; `kubegpu status` shows each GPU when asked"),
    max_gpu_containers: int = typer.Option(DEFAULT_MAX_GPU_CONTAINERS, "--max-gpu-containers", min=1, metavar="N",
                                           help="pods with more GPU containers are refused (each needs an "
                                                "exact fit per node); keep equal to the webhook's"),
    filter_budget_ms: float = typer.Option(500.0, "--filter-budget-ms", min=10.0, metavar="MS",
                                           help="time one filter may spend fitting multi-container pods "
                                                "node by node; nodes not reached fail with that reason"),
    resync: float = typer.Option(1800.0, "--resync-seconds", min=1.0, metavar="SECONDS",
                                 help="relist when one watch has run this long without ending: gone silent "
                                      "(the API server ends a healthy one every 4 minutes and it resumes where "
                                      "it was; an expired watch relists at once)"),
    reservation_min_gpus: int = typer.Option(_RESERVE.min_gpus, "--reservation-min-gpus", min=1, metavar="N",
                                             help="a pending pod asking N or more whole GPUs is wide: once it has "
                                                  "waited --reservation-wait, GPUs are held for it on one node"),
    reservation_wait: float = typer.Option(_RESERVE.wait_seconds, "--reservation-wait", min=0.0, metavar="SECONDS",
                                           help="how long a wide pod waits before it gets a reservation"),
    reservation_max_share: float = typer.Option(_RESERVE.max_share, "--reservation-max-share", min=0.0, max=1.0,
                                                metavar="FRACTION",
                                                help="reservations hold at most this share of the cluster's GPUs "
                                                     "(the oldest wide pod is always served)"),
    no_reservations: bool = typer.Option(False, "--no-reservations",
                                         help="hold no GPUs for waiting wide pods (place as they come)"),
    filter_wait: float = typer.Option(DEFAULT_FILTER_WAIT_S, "--filter-wait-seconds", min=0.0, max=5.0,
                                      metavar="SECONDS",
                                      help="how long a filter may wait for the binds of pods it just passed that "
                                           "could take the same room (kube-scheduler binds asynchronously); 0 "
                                           "answers at once and may pass a node a bind then finds taken. Keep it "
                                           "well under the filter extender's httpTimeout (10 s as rendered)"),
    log_level: str = typer.Option("info", "--log-level", metavar="LEVEL", help="debug, info, warning or error"),
) -> None:
    """Run the scheduler extender beside kube-scheduler."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one line per API call is noise
    host, port = _listen(listen)
    metrics = _listen(metrics_listen) if metrics_listen else None
    if (tls_cert is None) != (tls_key is None):
        typer.echo("--tls-cert and --tls-key go together", err=True)
        raise typer.Exit(EXIT_CONFIG)
    for f in (tls_cert, tls_key):
        if f is not None and not f.is_file():
            typer.echo(f"{f} does not exist", err=True)
            raise typer.Exit(EXIT_CONFIG)
    for where in (listen, metrics_listen):
        if where and (why := _cannot_listen(*_listen(where))):
            typer.echo(f"kubegpu scheduler: cannot listen on {where}: {why}", err=True)
            raise typer.Exit(EXIT_CONFIG)
    from kubegpu.httpserve import CertificateError, server_context
    from kubegpu.kube.client import ClientConfigError, make_async_client
    from kubegpu.scheduler.limits import Limits
    from kubegpu.scheduler.service import ExtenderService

    if tls_cert is not None and tls_key is not None:
        try:
            server_context(tls_cert, tls_key)
        except CertificateError as e:
            typer.echo(f"kubegpu scheduler: {e}", err=True)
            raise typer.Exit(EXIT_CONFIG) from None
    limits = Limits(max_gpu_containers=max_gpu_containers, filter_budget_s=filter_budget_ms / 1000)
    reservations = ReservationConfig(reservation_min_gpus, reservation_wait, reservation_max_share,
                                     enabled=not no_reservations)

    async def main() -> None:
        try:
            client = make_async_client(kubeconfig)
        except ClientConfigError as e:
            typer.echo(f"kubegpu scheduler: {e}", err=True)
            raise typer.Exit(EXIT_CONFIG) from None
        service = ExtenderService(client, node_policy, gpu_policy, resync_s=resync, limits=limits,
                                  per_gpu_metrics=metrics_per_gpu, reservations=reservations,
                                  filter_wait_s=filter_wait, **environment_settings(os.environ))
        logging.getLogger("kubegpu.scheduler").info(
            "extender on %s://%s:%d (node policy %s, GPU policy %s)", "https" if tls_cert else "http", host, port,
            node_policy, gpu_policy)
        await service.serve(host, port, tls_cert=tls_cert, tls_key=tls_key, metrics_listen=metrics,
                            debug_on_metrics=metrics_debug_api)

    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop
        except ImportError:  # optional: the stock event loop works, a little slower
            run = asyncio.run
        else:
            run = uvloop.run
        run(main())
