"""Who wrote a record: an HMAC over the extender's ``kubegpu.io/device-allocated`` (and the node's
acknowledgement), keyed with a secret that only kubegpu's extender and node daemons hold.

Anyone with pod create/update rights can write annotations; the webhook refuses such writes, but a
cluster may run it with ``failurePolicy: Ignore`` or not at all. So the node daemon serves a record
only when its signature checks: ``HMAC-SHA256(key, "<kind>\\0<pod uid>\\0<node>\\0<value>")``. The
pod UID and the node name are inside the MAC, so a signed record copied onto another pod, or a pod
recreated under the same name, does not verify. The key comes from a Secret mounted in both
Deployments (``KUBEGPU_RECORD_KEY_FILE``, a path) or, for tests and demos, ``KUBEGPU_RECORD_KEY``.
With no key configured nothing is signed and the node accepts unsigned records (it says so once
at start): that is node-only compatibility, not a secure mode (docs/handoff.md).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from pathlib import Path

from kubegpu.model import annotations as A

KEY_FILE_ENV = "KUBEGPU_RECORD_KEY_FILE"
KEY_ENV = "KUBEGPU_RECORD_KEY"
RECORD_SIGNATURE = "kubegpu.io/device-allocated-signature"
ACK_SIGNATURE = "kubegpu.io/device-assigned-signature"
MIN_KEY_BYTES = 16


class RecordKeyError(ValueError):
    """The configured key cannot be read or is too short; the message says which."""


def load_key(env: Mapping[str, str]) -> bytes | None:
    """The record key from a role's environment (file first), or None when none is configured; each role's
    entry passes its own environment, so nothing below it reads the process's."""
    path = env.get(KEY_FILE_ENV, "")
    if path:
        try:
            key = Path(path).read_bytes().strip()
        except OSError as e:
            raise RecordKeyError(f"cannot read the record key from {path}: {e.strerror or e}") from None
    else:
        key = env.get(KEY_ENV, "").strip().encode()
        if not key:
            return None
    if len(key) < MIN_KEY_BYTES:
        raise RecordKeyError(f"the record key must be at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return key


def _mac(key: bytes, kind: str, uid: str, node: str, value: str) -> str:
    msg = b"\0".join(x.encode() for x in (kind, uid, node, value))
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def sign(key: bytes, uid: str, node: str, value: str, kind: str = "record") -> str:
    return _mac(key, kind, uid, node, value)


def verify(key: bytes, uid: str, node: str, value: str, signature: str, kind: str = "record") -> bool:
    if not isinstance(signature, str) or len(signature) != 64:
        return False
    return hmac.compare_digest(_mac(key, kind, uid, node, value), signature)


def record_annotations(value: str, uid: str, node: str, key: bytes | None) -> dict[str, str]:
    """The annotations the extender puts in the Binding: the record, and its signature when keyed."""
    out = {A.DEVICE_ALLOCATED: value}
    if key is not None:
        out[RECORD_SIGNATURE] = sign(key, uid, node, value)
    return out
