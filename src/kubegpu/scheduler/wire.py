"""The scheduler-extender v1 wire format (``k8s.io/kube-scheduler/extender/v1``), decoded and encoded with msgspec.

The Go types carry no JSON tags, so the keys are the capitalised field names.
Nested Kubernetes objects (the Pod, the Nodes) stay plain dicts in their own
lowerCamel JSON. Decoding never raises anything but :class:`WireError`, whose
message is what the HTTP 400 answer says.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kubegpu.scheduler.reasons import readable

MAX_NAME = 253  # a DNS subdomain, the longest name Kubernetes gives a pod, a namespace or a node


class WireError(ValueError):
    """A request body that is not a valid extender message."""


class NodeList(msgspec.Struct, omit_defaults=False):
    items: list[dict[str, Any]] = []
    metadata: dict[str, Any] = {}


class ExtenderArgs(msgspec.Struct):
    Pod: dict[str, Any] | None = None
    Nodes: NodeList | None = None
    NodeNames: list[str] | None = None


class ExtenderBindingArgs(msgspec.Struct):
    PodName: str = ""
    PodNamespace: str = ""
    PodUID: str = ""
    Node: str = ""


class ExtenderFilterResult(msgspec.Struct):
    Nodes: NodeList | None
    NodeNames: list[str] | None
    FailedNodes: dict[str, str]
    FailedAndUnresolvableNodes: dict[str, str]
    Error: str = ""

    def __post_init__(self) -> None:
        # kube-scheduler formats these into Events: worded for that (scheduler/reasons.py). Thousands of
        # nodes per filter, few distinct reasons: map the cached rewording in C, no per-node Python frame.
        self.FailedNodes = dict(zip(self.FailedNodes, map(readable, self.FailedNodes.values()), strict=True))
        self.FailedAndUnresolvableNodes = dict(zip(self.FailedAndUnresolvableNodes,
                                                   map(readable, self.FailedAndUnresolvableNodes.values()),
                                                   strict=True))
        self.Error = readable(self.Error) if self.Error else ""


class HostPriority(msgspec.Struct):
    Host: str
    Score: int


class ExtenderBindingResult(msgspec.Struct):
    Error: str = ""


_args = msgspec.json.Decoder(ExtenderArgs)
_bind = msgspec.json.Decoder(ExtenderBindingArgs)
encode = msgspec.json.Encoder().encode


def decode_args(body: bytes) -> ExtenderArgs:
    try:
        args = _args.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"not an ExtenderArgs JSON object: {str(e)[:200]}") from None
    except RecursionError:
        raise WireError("not an ExtenderArgs JSON object: nested too deeply") from None
    except UnicodeDecodeError:  # msgspec decodes strings as UTF-8 and raises this, not DecodeError
        raise WireError("not an ExtenderArgs JSON object: a string is not valid UTF-8") from None
    if args.Pod is None:
        raise WireError("ExtenderArgs without a Pod")
    if args.NodeNames is None and args.Nodes is None:
        raise WireError("ExtenderArgs with neither NodeNames nor Nodes")
    if args.Nodes is not None:
        for i, item in enumerate(args.Nodes.items):
            meta = item.get("metadata")
            if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
                raise WireError(f"Nodes.items[{i}] has no metadata.name")
    names = node_names(args)
    if names and max(map(len, names)) > MAX_NAME:  # thousands of names: the loop in C
        raise WireError(f"a node name longer than {MAX_NAME} characters")
    return args


def node_names(args: ExtenderArgs) -> list[str]:
    if args.NodeNames is not None:
        return args.NodeNames
    assert args.Nodes is not None
    return [item["metadata"]["name"] for item in args.Nodes.items]


def decode_binding(body: bytes) -> ExtenderBindingArgs:
    try:
        args = _bind.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"not an ExtenderBindingArgs JSON object: {str(e)[:200]}") from None
    except RecursionError:
        raise WireError("not an ExtenderBindingArgs JSON object: nested too deeply") from None
    except UnicodeDecodeError:  # msgspec decodes strings as UTF-8 and raises this, not DecodeError
        raise WireError("not an ExtenderBindingArgs JSON object: a string is not valid UTF-8") from None
    missing = [k for k in ("PodName", "PodNamespace", "Node") if not getattr(args, k)]
    if missing:
        raise WireError(f"ExtenderBindingArgs without {', '.join(missing)}")
    long = [k for k in ("PodName", "PodNamespace", "Node", "PodUID") if len(getattr(args, k)) > MAX_NAME]
    if long:  # no Kubernetes name is this long; never echo it into logs and errors
        raise WireError(f"ExtenderBindingArgs {', '.join(long)} longer than {MAX_NAME} characters")
    return args
