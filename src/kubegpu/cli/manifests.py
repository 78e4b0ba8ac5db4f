"""``kubegpu manifests``: render every Kubernetes object kubegpu needs from one values file."""

from __future__ import annotations

from pathlib import Path

import typer

from kubegpu.cli.main import app


@app.command("manifests")
def manifests(
    values: Path | None = typer.Option(None, "--values", "-f", metavar="FILE",
                                       help="YAML values file (keys mirror NVIDIA's "
                                       "device-plugin chart where they overlap: migStrategy, config.map, ...)."),
    mode: str | None = typer.Option(None, metavar="MODE",
                                    help="Override the values' mode: node-only (drop-in for NVIDIA's "
                                    "device plugin) or full (node + scheduler extender + webhook)."),
    output: Path | None = typer.Option(None, "--output", "-o", metavar="FILE", help="Write here instead of stdout."),
    kube_version: str | None = typer.Option(
        None, "--kube-version", metavar="1.X",
        help="The cluster's Kubernetes release, 1.24 to the newest (default: the newest, or the values' "
             "kubeVersion). Chooses the scheduler configuration version, matchConditions or their fallback, "
             "the admission policies and the kube-scheduler image."),
    dra: bool = typer.Option(False, "--dra", help="Add the DRA driver (Kubernetes 1.34+): DeviceClasses, "
                             "its DaemonSet on nodes labelled kubegpu.io/kubelet-plugin=dra, RBAC "
                             "(see kubegpu.install.dra)."),
    dra_extended_resource: bool = typer.Option(False, "--dra-extended-resource",
                                               help="With --dra: serve nvidia.com/gpu requests through DRA too."),
    dra_all_nodes: bool = typer.Option(False, "--dra-all-nodes", help="With --dra: every GPU node uses DRA "
                                       "(no device-plugin DaemonSet)."),
    dra_shared_gpus: str = typer.Option("all", "--dra-shared-gpus", metavar="GPUS",
                                        help="With --dra: GPUs that take shares beside whole claims "
                                        "(all, none or indexes like 0,2-3)."),
) -> None:
    """Render the install manifests (namespace, CRD, RBAC, DaemonSet, scheduler, webhook, ...) as multi-doc YAML.

    With no values file this prints the default install, the same as deploy/kubegpu.yaml.

    Prerequisites: on every GPU node the NVIDIA driver and the NVIDIA Container Toolkit (with the NVIDIA
    runtime as the default or as a RuntimeClass named in runtimeClassName); for the full mode also
    cert-manager (or webhook.certManager: false with webhook.caBundle from `kubegpu webhook-certs`), and the
    record-signing key: kubectl -n kubegpu-system create secret generic kubegpu-record-key
    --from-literal=key=$(head -c 32 /dev/urandom | base64).
    """
    from kubegpu.install.render import notes, render, to_yaml
    from kubegpu.install.values import ValuesError, load_values

    try:
        v = load_values(values)
        if mode is not None:
            if mode not in ("node-only", "full"):
                raise ValuesError(f"mode: {mode!r} is not one of node-only, full")
            v.mode = mode  # type: ignore[assignment]
        if kube_version is not None:
            v.kube_version = kube_version
        objs = render(v)
        for note in notes(v):
            typer.echo(f"note: {note}", err=True)
    except ValuesError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if dra:
        from kubegpu.install.dra import apply_dra

        try:
            objs = apply_dra(objs, v, extended_resource=dra_extended_resource, all_nodes=dra_all_nodes,
                             shared_gpus=dra_shared_gpus)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    text = to_yaml(objs)
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
        typer.echo(f"wrote {output}", err=True)
