"""``kubegpu webhook``: run the TLS admission webhook; ``kubegpu webhook-certs``: make its key pair."""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path

import typer

from kubegpu.cli.console import make_console
from kubegpu.cli.main import app
from kubegpu.model.limits import DEFAULT_MAX_GPU_CONTAINERS

_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _own_namespace(given: str) -> str:
    if given:
        return given
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return _SA_NAMESPACE.read_text().strip()
    except OSError:
        return "kubegpu-system"


@app.command("webhook", short_help="Serve the admission webhook for GPU pods.")
def webhook(
    listen: str = typer.Option("0.0.0.0:8443", "--listen", metavar="HOST:PORT", help="HOST:PORT to serve HTTPS on."),
    tls_cert: Path = typer.Option(..., "--tls-cert", metavar="FILE", exists=True, dir_okay=False,
                                  help="Serving certificate (PEM); reloaded when the file changes."),
    tls_key: Path = typer.Option(..., "--tls-key", metavar="FILE", exists=True, dir_okay=False,
                                 help="Serving key (PEM); reloaded when the file changes."),
    namespace: str = typer.Option("", "--namespace", metavar="NAME",
                                  help="The webhook's own namespace, always excluded "
                                       "(default: $POD_NAMESPACE, then the service account's)."),
    exclude_namespace: list[str] = typer.Option(
        ["kube-system"], "--exclude-namespace", metavar="NAME",
        help="Namespaces admitted untouched; repeatable. Exclusion by namespace *label* is done by the "
             "namespaceSelector of the webhook configurations (kubegpu manifests)."),
    toleration: bool = typer.Option(True, "--toleration/--no-toleration",
                                    help="Add a toleration for the GPU taint to GPU pods."),
    gpu_taint_key: str = typer.Option("nvidia.com/gpu", "--gpu-taint-key", metavar="KEY",
                                      help="Key of the NoSchedule taint on GPU nodes."),
    void_env: bool = typer.Option(True, "--void-env/--no-void-env",
                                  help="Set NVIDIA_VISIBLE_DEVICES=void on containers that ask for no GPU."),
    void_all_pods: bool = typer.Option(False, "--void-all-pods",
                                       help="Also on pods that do not tolerate the GPU taint (for clusters "
                                            "whose GPU nodes are not tainted; patches every pod)."),
    replica_resource: list[str] = typer.Option(
        [], "--replica-resource", metavar="NAME",
        help="Renamed replica resource without 'gpu' in its name; repeatable."),
    scheduler_name: str = typer.Option("kubegpu-scheduler", "--scheduler-name", metavar="NAME",
                                       help="Full mode: GPU pods left to the default scheduler get this "
                                            "spec.schedulerName (kubegpu's profile); '' leaves them alone."),
    record_writer: list[str] = typer.Option(
        [], "--record-writer", metavar="USER",
        help="A user (userInfo.username) that may set or change the kubegpu.io/device-allocated and "
             "device-assigned annotations; repeatable (default, per record, in the webhook's namespace: "
             "the kubegpu-scheduler-extender service account for device-allocated, kubegpu-node for "
             "device-assigned)."),
    max_gpu_containers: int = typer.Option(DEFAULT_MAX_GPU_CONTAINERS, "--max-gpu-containers", min=1, metavar="N",
                                           help="Refuse pods with more GPU containers (keep equal to the "
                                                "scheduler extender's)."),
    cert_poll_seconds: float = typer.Option(2.0, "--cert-poll-seconds", min=0.05, metavar="SECONDS",
                                            help="How often to look for a rotated certificate."),
    log_level: str = typer.Option("info", "--log-level", metavar="LEVEL", help="debug, info, warning, error."),
) -> None:
    """Serve the mutating (/mutate) and validating (/validate) admission webhook for GPU pods.

    Also serves /metrics (Prometheus) and /healthz on the same port.
    """
    from kubegpu.httpserve import CertificateError
    from kubegpu.model.normalise import AdmissionPolicy
    from kubegpu.model.resources import declared_gpu_resources
    from kubegpu.webhook.app import WebhookSettings
    from kubegpu.webhook.server import WebhookServer, parse_listen

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        host, port = parse_listen(listen)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    own = _own_namespace(namespace)
    settings = WebhookSettings(
        policy=AdmissionPolicy(add_toleration=toleration, taint_key=gpu_taint_key, void_env=void_env,
                               void_all_pods=void_all_pods,
                               replica_resources=frozenset(replica_resource) | declared_gpu_resources(os.environ)),
        own_namespace=own,
        exclude_namespaces=frozenset(exclude_namespace),
        record_writers=frozenset(record_writer) if record_writer else None,
        scheduler_name=scheduler_name,
        max_gpu_containers=max_gpu_containers,
    )
    try:
        server = WebhookServer(settings, str(tls_cert), str(tls_key), host=host, port=port,
                               cert_poll_s=cert_poll_seconds, log_level=log_level.lower())
    except CertificateError as exc:
        typer.echo(f"kubegpu webhook: {exc}", err=True)
        raise typer.Exit(2) from None
    except OSError as exc:
        typer.echo(f"kubegpu webhook: cannot listen on {listen}: {exc.strerror or exc}", err=True)
        raise typer.Exit(2) from None
    logging.getLogger("kubegpu.webhook").info(
        "serving https://%s:%d (namespace %s excluded, plus %s)", host, server.port, own,
        ", ".join(sorted(exclude_namespace)) or "none")
    server.run()


@app.command("webhook-certs", short_help="Make the webhook's CA and serving certificate.")
def webhook_certs(
    out: Path = typer.Option(Path("."), "--out", metavar="DIR", file_okay=False,
                             help="Directory for ca.crt, tls.crt, tls.key."),
    service: str = typer.Option("kubegpu-webhook", "--service", metavar="NAME", help="The webhook's Service name."),
    namespace: str = typer.Option("kubegpu-system", "--namespace", metavar="NAME", help="The webhook's namespace."),
    days: int = typer.Option(365, "--days", min=1, metavar="DAYS", help="Validity of the serving certificate."),
) -> None:
    """Make a CA and a serving certificate for the webhook Service (for clusters without cert-manager);
    prints the caBundle to put in the webhook configurations."""
    from kubegpu.webhook.certs import generate_ca, issue_serving_cert, service_names

    out.mkdir(parents=True, exist_ok=True)
    ca = generate_ca()
    (out / "ca.crt").write_bytes(ca.cert_pem)
    serving = issue_serving_cert(ca, service_names(service, namespace), days=days)
    serving.write(out / "tls.crt", out / "tls.key")
    bundle = base64.b64encode(ca.cert_pem).decode()
    make_console(stderr=True).print(
        f"wrote {out}/ca.crt, tls.crt, tls.key (tls.key readable by you only). Next steps:\n"
        f"  1. kubectl create namespace {namespace} (if needed), then\n"
        f"     kubectl -n {namespace} create secret tls {service}-tls --cert={out}/tls.crt --key={out}/tls.key\n"
        "  2. in the values file: webhook: {certManager: false, caBundle: <the line on stdout>}, then\n"
        "     kubegpu manifests -f values.yaml | kubectl apply -f -\n"
        f"  3. delete {out}/tls.key once the Secret exists; before {days} days pass, run this again and\n"
        "     replace the Secret and the caBundle.\n"
        "caBundle:", markup=False, highlight=False)
    print(bundle)
