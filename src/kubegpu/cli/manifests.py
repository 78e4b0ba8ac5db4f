"""``kubegpu manifests``: render every Kubernetes object kubegpu needs from one values file."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kubegpu.cli.main import app

FORMATS = ("yaml", "json")


@app.command("manifests")
def manifests(
    values: Path | None = typer.Option(None, "--values", "-f", metavar="FILE",
                                       help="YAML values file; NVIDIA's device-plugin chart values are taken as "
                                       "they are (docs/install.md: what maps to what, what is refused)."),
    mode: str | None = typer.Option(None, metavar="MODE",
                                    help="Override the values' mode: node-only (drop-in for NVIDIA's "
                                    "device plugin) or full (node + scheduler extender + webhook)."),
    output: str | None = typer.Option(None, "--output", "-o", metavar="FORMAT",
                                      help="yaml (default) or json (a v1 List), as kubectl's -o. A file name "
                                      "here is still written to, deprecated: use --output-file."),
    output_file: Path | None = typer.Option(None, "--output-file", metavar="FILE",
                                            help="Write here instead of stdout."),
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
    dra_shared_gpus: str | None = typer.Option(None, "--dra-shared-gpus", metavar="GPUS",
                                               help="With --dra: GPUs that take shares beside whole claims "
                                               "(all, none or indexes like 0,2-3; default all)."),
) -> None:
    """Render the install manifests (namespace, CRD, RBAC, DaemonSet, scheduler, webhook, ...) as multi-doc YAML.

    With no values file this prints the default install, the same as deploy/kubegpu.yaml. Notes on stderr
    say what the render needs before it runs (with its namespace and names).

    Prerequisites: on every GPU node the NVIDIA driver and the NVIDIA Container Toolkit (with the NVIDIA
    runtime as the default or as a RuntimeClass named in runtimeClassName); for the full mode also
    cert-manager (or webhook.certManager: false with webhook.caBundle from `kubegpu webhook-certs`), and the
    record-signing key Secret, whose kubectl command the notes print.
    """
    from kubegpu.install.render import notes, render, resolved, to_yaml
    from kubegpu.install.values import DRA_MIN_KUBE, ValuesError, read_values
    from kubegpu.install.values import kube_version as release

    def fail(message: str) -> typer.Exit:
        typer.echo(f"error: {message}", err=True)
        return typer.Exit(2)

    fmt, output_file = _output(output, output_file)
    if fmt is None:
        raise fail(f"-o {output}: manifests prints Kubernetes objects; give -o yaml or -o json")
    needs_dra = [name for name, given in (("--dra-extended-resource", dra_extended_resource),
                                          ("--dra-all-nodes", dra_all_nodes),
                                          ("--dra-shared-gpus", dra_shared_gpus is not None)) if given]
    if needs_dra and not dra:
        raise fail(f"{', '.join(needs_dra)} {'needs' if len(needs_dra) == 1 else 'need'} --dra (they choose how "
                   "the DRA driver serves GPUs); add --dra or leave them out")
    try:
        v, chart_notes = read_values(values)
        if mode is not None:
            if mode not in ("node-only", "full"):
                raise ValuesError(f"mode: {mode!r} is not one of node-only, full")
            v.mode = mode  # type: ignore[assignment]
        if kube_version is not None:
            v.kube_version = kube_version
        if dra and release(v) < DRA_MIN_KUBE:
            source = "--kube-version" if kube_version is not None else "the values' kubeVersion"
            raise ValuesError(
                f"--dra: {source} {v.kube_version} is below {DRA_MIN_KUBE[0]}.{DRA_MIN_KUBE[1]}: kubegpu's DRA "
                "driver and its DeviceClasses use resource.k8s.io/v1, which Kubernetes serves from 1.34 "
                "(earlier releases have only beta or alpha versions, off by default); render without --dra "
                "(device plugins) or for 1.34 or later")
        objs = render(v)
        for note in chart_notes + notes(v):
            typer.echo(f"note: {note}", err=True)
    except ValuesError as exc:
        raise fail(str(exc)) from None
    if dra:
        from kubegpu.install.dra import apply_dra

        try:
            objs = apply_dra(objs, resolved(v), extended_resource=dra_extended_resource, all_nodes=dra_all_nodes,
                             shared_gpus=dra_shared_gpus or "all")
        except ValueError as exc:
            raise fail(str(exc)) from None
    if fmt == "json":
        text = json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}, indent=4) + "\n"
    else:
        text = to_yaml(objs)
    if output_file is None:
        typer.echo(text, nl=False)
    else:
        output_file.write_text(text)
        typer.echo(f"wrote {output_file}", err=True)


def _output(output: str | None, output_file: Path | None) -> tuple[str | None, Path | None]:
    """(format, file) from ``-o`` and ``--output-file``. ``-o FILE`` (the old spelling) still writes the file;
    ``-o wide`` and the like name no format manifests can print (None)."""
    if output is None or output in FORMATS:
        return output or "yaml", output_file
    if output in ("wide", "name") or output.startswith(("jsonpath", "go-template", "custom-columns")):
        return None, output_file
    typer.echo(f"warning: -o {output}: -o FILE is deprecated (-o is the output format, as in kubectl); "
               f"use --output-file {output}", err=True)
    return "yaml", output_file or Path(output)
