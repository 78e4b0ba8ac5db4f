"""The ``admission.k8s.io/v1`` AdmissionReview wire format: read a request, write a response.

Strict on the envelope (a body that is not an AdmissionReview v1 with a
request uid is a 400, the API server never sends one), lenient on the object:
a malformed Pod inside a well-formed review is the request parser's business
and becomes a refusal, never an exception.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
MAX_BODY_BYTES = 8 * 2**20  # the API server caps objects at 3 MiB; a review holds one (and maybe oldObject)

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


class BadReview(ValueError):
    """A body that is not an AdmissionReview v1 request (answered with HTTP 400)."""


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    uid: str
    namespace: str
    operation: str
    kind: str  # the object's kind ("Pod")
    resource: str  # "pods"
    sub_resource: str
    object: Mapping[str, Any] | None
    dry_run: bool
    old_object: Mapping[str, Any] | None = None
    username: str = ""  # userInfo.username of whoever sent the request


def _str(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key)
    return value if isinstance(value, str) else ""


def read_review(body: bytes) -> AdmissionRequest:
    if len(body) > MAX_BODY_BYTES:
        raise BadReview(f"body of {len(body)} bytes is larger than {MAX_BODY_BYTES}")
    try:
        data = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise BadReview(f"body is not JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise BadReview("body is JSON nested too deeply") from None
    except UnicodeDecodeError:  # msgspec decodes strings as UTF-8 and raises this, not DecodeError
        raise BadReview("body is not JSON: a string is not valid UTF-8") from None
    if not isinstance(data, dict):
        raise BadReview("body is not a JSON object")
    if data.get("apiVersion") != API_VERSION or data.get("kind") != KIND:
        raise BadReview(f"expected apiVersion {API_VERSION} kind {KIND}, got "
                        f"{data.get('apiVersion')!r} {data.get('kind')!r}")
    req = data.get("request")
    if not isinstance(req, dict):
        raise BadReview("AdmissionReview has no request")
    uid = req.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("AdmissionReview request has no uid")
    kind = req.get("kind")
    resource = req.get("resource")
    obj = req.get("object")
    return AdmissionRequest(
        uid=uid,
        namespace=_str(req, "namespace"),
        operation=_str(req, "operation"),
        kind=_str(kind, "kind") if isinstance(kind, dict) else "",
        resource=_str(resource, "resource") if isinstance(resource, dict) else "",
        sub_resource=_str(req, "subResource"),
        object=obj if isinstance(obj, dict) else None,
        dry_run=req.get("dryRun") is True,
        old_object=old if isinstance(old := req.get("oldObject"), dict) else None,
        username=_str(user, "username") if isinstance(user := req.get("userInfo"), dict) else "",
    )


def write_response(uid: str, *, allowed: bool, message: str = "",
                   patch: Sequence[Mapping[str, Any]] = (), warnings: Sequence[str] = ()) -> bytes:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if not allowed:
        response["status"] = {"code": 403, "reason": "Forbidden", "message": message}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(_encoder.encode(list(patch))).decode()
    if warnings:
        response["warnings"] = list(warnings)
    return _encoder.encode({"apiVersion": API_VERSION, "kind": KIND, "response": response})


def encode_json(data: Any) -> bytes:
    return _encoder.encode(data)
