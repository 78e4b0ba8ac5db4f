"""A stand-in for the kubelet's DRA manager (v1.36, as recorded in fixtures ``dra-v1.36``), over real gRPC.

What it enforces, as the real one does:

- **plugin watcher**: a socket appearing in ``<root>/plugins_registry`` is dialled: ``GetInfo``
  (type must be ``DRAPlugin``), the first supported entry of ``supported_versions`` is chosen
  (``v1.DRAPlugin`` or ``v1beta1.DRAPlugin``), ``NotifyRegistrationStatus`` reports the outcome,
  then ``NodeWatchResources`` is opened (on every registration). A replaced socket (new inode)
  unregisters and registers again.
- **slices**: on start it deletes every ResourceSlice of its node (``spec.nodeName=<node>``); when
  a registered plugin's connection drops, or its registration socket is removed, and it does not
  come back within ``wipe_delay_s`` (30 s upstream) it deletes that driver's slices of the node.
- **prepare before container start**: a pod's claims (from ``spec.resourceClaims``, the pod's
  ``resourceClaimStatuses`` and its extended-resource claim) must be allocated and reserved for
  the pod; those not prepared yet in this run go to one ``NodePrepareResources`` call per driver
  (name, namespace, UID only). A claim already prepared for another pod is not sent again (a
  shared claim: one call at the first pod). A failure (RPC error or per-claim ``error``) leaves
  the pod Pending and is retried every ``retry_s`` (~13 s upstream).
- **unprepare after the pod ends**: when the last pod using a claim is gone, one
  ``NodeUnprepareResources`` call per driver.
- **checkpoint**: ``<root>/dra_manager_state``, ``{"Data": <DRACheckpoint v1 JSON>, "Checksum": crc32}``
  exactly in the recorded format. After a restart the prepared flag is gone (not checkpointed),
  so claims are prepared again when their pods sync (recorded: the plugin must be idempotent).
- **PodResources view**: :meth:`pod_resources` gives the ``dynamic_resources`` of each container.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import grpc

from kubegpu.node.dra.proto import (
    dra_health_pb2,
    dra_health_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_pb2,
    pluginregistration_pb2_grpc,
)
from kubegpu_standins.apiserver import ApiServer, ApiStatusError

log = logging.getLogger(__name__)

KUBELET_VERSIONS: Final = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
GROUP: Final = "resource.k8s.io"


@dataclass
class Call:
    """One RPC the stand-in made (for assertions): method, version, request and response or error."""

    method: str
    version: str
    claims: list[tuple[str, str, str]]
    response: Any = None
    error: str = ""
    at: float = field(default_factory=time.monotonic)


@dataclass
class _Plugin:
    name: str
    socket: str
    inode: tuple[int, int] | None
    endpoint: str
    version: str
    channel: grpc.Channel
    health_thread: threading.Thread | None = None
    connected: bool = True
    disconnected_at: float | None = None
    health: dict[tuple[str, str], str] = field(default_factory=dict)
    health_messages: int = 0


class DraKubelet:
    def __init__(self, api: ApiServer, root: str | os.PathLike[str], node_name: str, *,
                 retry_s: float = 13.0, wipe_delay_s: float = 30.0, poll_s: float = 0.05,
                 versions: tuple[str, ...] = KUBELET_VERSIONS) -> None:
        self.api = api
        self.root = Path(root)
        self.node = node_name
        self.retry_s = retry_s
        self.wipe_delay_s = wipe_delay_s
        self.poll_s = poll_s
        self.versions = versions
        self.registry = self.root / "plugins_registry"
        self.plugins_dir = self.root / "plugins"
        self.checkpoint_path = self.root / "dra_manager_state"
        self.plugins: dict[str, _Plugin] = {}
        self.calls: list[Call] = []
        self.events: list[str] = []  # log lines, as the kubelet's (registered, deleted slices, ...)
        self.claims: dict[str, dict[str, Any]] = {}  # uid -> checkpoint entry (ClaimInfoState)
        self.prepared_now: set[str] = set()  # prepared in this run (not checkpointed, as upstream)
        self.pods: dict[str, dict[str, Any]] = {}  # pod uid -> pod, for pods waiting or running
        self.running: set[str] = set()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._wake = threading.Event()
        self._sync_lock = threading.Lock()
        self._pending_wipes: dict[str, float] = {}  # driver -> when it was unregistered
        self._next_try: dict[str, float] = {}  # pod uid -> when to retry its prepare

    # ----- lifecycle ---------------------------------------------------------------------------

    def start(self) -> DraKubelet:
        self.registry.mkdir(parents=True, exist_ok=True)
        self.plugins_dir.mkdir(parents=True, exist_ok=True)
        self.claims = self._load_checkpoint()
        self._stop.clear()
        self._delete_slices(f"spec.nodeName={self.node}")
        for target, name in ((self._watch_plugins, "dra-kubelet-watcher"), (self._sync_loop, "dra-kubelet-sync")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Stop as a killed kubelet would: connections dropped, checkpoint kept on disk."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []
        with self._lock:
            for p in self.plugins.values():
                p.channel.close()
            self.plugins.clear()

    # ----- slices ------------------------------------------------------------------------------

    def _delete_slices(self, selector: str) -> None:
        from kubegpu_standins.apiserver import field_matcher

        kind = self.api.kind("resourceslices", GROUP)
        _, items = self.api.store.list(kind, None, field_matcher(selector))
        for it in items:
            with contextlib.suppress(ApiStatusError):
                self.api.store.delete(kind, "", it["metadata"]["name"])
        self.events.append(f"Deleted ResourceSlices fieldSelector={selector!r} count={len(items)}")

    # ----- plugin watcher ----------------------------------------------------------------------

    def _watch_plugins(self) -> None:
        while not self._stop.is_set():
            try:
                self._scan()
                self._check_connections()
            except Exception:
                log.exception("stand-in kubelet: plugin watcher failed")
            self._stop.wait(self.poll_s)

    def _scan(self) -> None:
        seen: dict[str, tuple[int, int]] = {}
        for entry in os.scandir(self.registry):
            if entry.name.startswith("."):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed between the listing and the stat: fsnotify would say Remove
                continue
            if stat.S_ISSOCK(st.st_mode):
                seen[entry.path] = (st.st_ino, st.st_ctime_ns)  # inodes are reused: ctime tells files apart
        with self._lock:
            by_socket = {p.socket: p for p in self.plugins.values()}
        for path, gone in by_socket.items():
            if path not in seen:  # fsnotify Remove: the plugin is deregistered
                self._unregister(gone)
        for path, ino in seen.items():
            known = by_socket.get(path)
            if known is not None and known.inode == ino:
                continue
            if known is not None:
                self.events.append(f"An updated version of plugin has been found, unregistering the plugin "
                                   f"first before reregistering: {known.name}")
                self._unregister(known)
            self._register(path, ino)

    def _register(self, path: str, ino: tuple[int, int]) -> None:
        ch = grpc.insecure_channel(f"unix://{path}")
        try:
            stub = pluginregistration_pb2_grpc.RegistrationStub(ch)
            info = stub.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=5)
            error = ""
            version = next((v for v in info.supported_versions if v in self.versions), "")
            if info.type != "DRAPlugin":
                error = f"unsupported plugin type {info.type!r}"
            elif not version:
                error = (f"none of the versions supported by the plugin {list(info.supported_versions)} "
                         f"is supported by this kubelet {list(self.versions)}")
            elif not info.name:
                error = "plugin name is empty"
            stub.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(
                plugin_registered=not error, error=error), timeout=5)
        except grpc.RpcError as exc:
            log.info("stand-in kubelet: registration through %s failed: %s", path, exc)
            return
        finally:
            ch.close()
        if error:
            self.events.append(f"Registration failed: {error}")
            return
        endpoint = info.endpoint
        channel = grpc.insecure_channel(f"unix://{endpoint}")
        plugin = _Plugin(info.name, path, ino, endpoint, version, channel)
        with self._lock:
            old = self.plugins.get(info.name)
            if old is not None:
                self._unregister(old)
            self.plugins[info.name] = plugin
            self._pending_wipes.pop(info.name, None)
        self.events.append(f'Registered DRA plugin {info.name} chosenService="{version}" endpoint={endpoint}')
        t = threading.Thread(target=self._health_stream, args=(plugin,), name=f"dra-health-{info.name}",
                             daemon=True)
        plugin.health_thread = t
        t.start()
        self._wake.set()

    def _unregister(self, p: _Plugin) -> None:
        with self._lock:
            if self.plugins.get(p.name) is p:
                del self.plugins[p.name]
                self._pending_wipes[p.name] = time.monotonic()  # slices go unless it comes back in time
        p.channel.close()
        self.events.append(f"Unregistered DRA plugin {p.name}")

    def _health_stream(self, p: _Plugin) -> None:
        stub = dra_health_pb2_grpc.DRAResourceHealthStub(p.channel)
        try:
            for msg in stub.NodeWatchResources(dra_health_pb2.NodeWatchResourcesRequest()):
                p.health_messages += 1
                changed = 0
                for d in msg.devices:
                    key = (d.device.pool_name, d.device.device_name)
                    h = dra_health_pb2.HealthStatus.Name(d.health)
                    if p.health.get(key) != h:
                        changed += 1
                    p.health[key] = h
                if changed:
                    self.events.append(f"Health info changed, checking affected pods changedDevicesCount={changed}")
        except grpc.RpcError as exc:
            if not self._stop.is_set():
                self.events.append(f"Error receiving from WatchResources stream: {exc.code()}")
        self.events.append("Clearing health cache for driver upon stream exit")
        p.health.clear()

    def _check_connections(self) -> None:
        now = time.monotonic()
        with self._lock:
            plugins = list(self.plugins.values())
            due = [n for n, t in self._pending_wipes.items() if now - t >= self.wipe_delay_s and n not in self.plugins]
            for n in due:
                del self._pending_wipes[n]
        for n in due:
            self._delete_slices(f"spec.driver={n},spec.nodeName={self.node}")
        for p in plugins:
            alive = os.path.exists(p.endpoint) and p.health_thread is not None and p.health_thread.is_alive()
            if alive:
                if not p.connected:
                    self.events.append(f"Connection changed plugin={p.name} connected=true")
                p.connected, p.disconnected_at = True, None
                continue
            if p.connected:
                p.connected, p.disconnected_at = False, now
                self.events.append(f"Connection changed plugin={p.name} connected=false")
            elif p.disconnected_at is not None and now - p.disconnected_at >= self.wipe_delay_s:
                self._delete_slices(f"spec.driver={p.name},spec.nodeName={self.node}")
                p.disconnected_at = None  # once per disconnect

    # ----- checkpoint --------------------------------------------------------------------------

    def _load_checkpoint(self) -> dict[str, dict[str, Any]]:
        try:
            raw = json.loads(self.checkpoint_path.read_text())
        except FileNotFoundError:
            return {}
        data = raw["Data"]
        if zlib.crc32(data.encode()) != raw["Checksum"]:
            raise RuntimeError(f"checkpoint {self.checkpoint_path} is corrupt (checksum mismatch)")
        state = json.loads(data)
        return {c["ClaimUID"]: c for c in state.get("ClaimInfoStateList") or []}

    def _save_checkpoint(self) -> None:
        data = json.dumps({"kind": "DRACheckpoint", "apiVersion": "checkpoint.dra.kubelet.k8s.io/v1",
                           "ClaimInfoStateList": list(self.claims.values())}, separators=(",", ":"))
        body = json.dumps({"Data": data, "Checksum": zlib.crc32(data.encode())})
        tmp = self.checkpoint_path.with_suffix(".tmp")
        tmp.write_text(body)
        os.replace(tmp, self.checkpoint_path)

    # ----- pods --------------------------------------------------------------------------------

    def add_pod(self, pod: dict[str, Any]) -> None:
        """SyncLoop ADD: prepare the pod's claims and start it (or retry later)."""
        uid = pod["metadata"]["uid"]
        with self._lock:
            self.pods[uid] = pod
        if not self._sync_pod(uid):
            self._next_try[uid] = time.monotonic() + self.retry_s

    def _sync_loop(self) -> None:
        next_try = self._next_try
        while not self._stop.is_set():
            self._wake.wait(timeout=min(self.retry_s, 1.0))
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                waiting = [u for u in self.pods if u not in self.running]
            for uid in waiting:
                if now >= next_try.get(uid, 0) and not self._sync_pod(uid):
                    next_try[uid] = time.monotonic() + self.retry_s

    def _pod_claims(self, pod: dict[str, Any]) -> list[tuple[str, str]]:
        ns = pod["metadata"].get("namespace", "default")
        fresh = self.api.get_object("pods", pod["metadata"]["name"], ns)
        statuses = {s["name"]: s.get("resourceClaimName") for s in (fresh.get("status") or {}).get(
            "resourceClaimStatuses") or []}
        out = []
        for pc in (fresh.get("spec") or {}).get("resourceClaims") or []:
            name = pc.get("resourceClaimName") or statuses.get(pc["name"])
            if not name:
                raise RuntimeError(f"pod {ns}/{pod['metadata']['name']}: claim {pc['name']} has no ResourceClaim yet")
            out.append((pc["name"], name))
        ext = (fresh.get("status") or {}).get("extendedResourceClaimStatus")
        if ext:
            out.append(("", ext["resourceClaimName"]))
        return out

    def _sync_pod(self, pod_uid: str) -> bool:
        with self._sync_lock:  # one pod worker at a time (the kubelet has one per pod)
            return self._sync_pod_locked(pod_uid)

    def _sync_pod_locked(self, pod_uid: str) -> bool:
        with self._lock:
            pod = self.pods.get(pod_uid)
        if pod is None or pod_uid in self.running:
            return True
        ns = pod["metadata"].get("namespace", "default")
        try:
            claims = [self.api.get_object("resourceclaims", n, ns, GROUP) for _, n in self._pod_claims(pod)]
        except (ApiStatusError, RuntimeError) as exc:
            self.events.append(f"Failed to prepare dynamic resources: {exc}")
            return False
        todo: dict[str, list[dict[str, Any]]] = {}
        for c in claims:
            st = c.get("status") or {}
            if not st.get("allocation") or all(r.get("uid") != pod_uid for r in st.get("reservedFor") or []):
                self.events.append(f"ResourceClaim {c['metadata']['name']} is not allocated and reserved for the pod")
                return False
            uid = c["metadata"]["uid"]
            with self._lock:
                entry = self.claims.get(uid)
                if entry is not None and uid in self.prepared_now:
                    entry["PodUIDs"][pod_uid] = {}
                    continue
            drivers = {r["driver"] for r in st["allocation"]["devices"]["results"]}
            for d in drivers:
                todo.setdefault(d, []).append(c)
        for driver, cl in todo.items():
            if not self._prepare(driver, cl, pod_uid):
                return False
        with self._lock:
            self._save_checkpoint()
            self.running.add(pod_uid)
        self.api.store.update(self.api.kind("pods"), ns, pod["metadata"]["name"],
                              lambda o: dict(o, status=dict(o.get("status") or {}, phase="Running")), "status")
        return True

    def _stub(self, driver: str) -> tuple[Any, Any, str]:
        with self._lock:
            p = self.plugins.get(driver)
        if p is None:
            raise RuntimeError(f"DRA driver {driver} is not registered")
        if p.version == "v1.DRAPlugin":
            return dra_v1_pb2_grpc.DRAPluginStub(p.channel), dra_v1_pb2, p.version
        return dra_v1beta1_pb2_grpc.DRAPluginStub(p.channel), dra_v1beta1_pb2, p.version

    def _prepare(self, driver: str, claims: list[dict[str, Any]], pod_uid: str) -> bool:
        refs = [(c["metadata"]["namespace"], c["metadata"]["uid"], c["metadata"]["name"]) for c in claims]
        call = Call("NodePrepareResources", "", refs)
        self.calls.append(call)
        try:
            stub, pb, call.version = self._stub(driver)
            req = pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace=n, uid=u, name=m) for n, u, m in refs])
            resp = stub.NodePrepareResources(req, timeout=45)
        except (RuntimeError, grpc.RpcError) as exc:
            call.error = (f"rpc error: code = {exc.code().name.title()} desc = {exc.details()}"
                          if isinstance(exc, grpc.RpcError) else str(exc))
            self.events.append(f"prepare dynamic resources: NodePrepareResources: {call.error}")
            return False
        call.response = resp
        ok = True
        for ns, uid, name in refs:
            if uid not in resp.claims:
                self.events.append(f"NodePrepareResources left out claim {name} ({uid})")
                ok = False
                continue
            r = resp.claims[uid]
            if r.error:
                self.events.append(f"prepare dynamic resources: NodePrepareResources failed for ResourceClaim "
                                   f"{name}: {r.error}")
                ok = False
                continue
            devices = [{"PoolName": d.pool_name, "DeviceName": d.device_name,
                        "ShareID": d.share_id if d.HasField("share_id") else None,
                        "RequestNames": list(d.request_names), "CDIDeviceIDs": list(d.cdi_device_ids)}
                       for d in r.devices]
            with self._lock:
                entry = self.claims.get(uid)
                if entry is None:
                    entry = {"ClaimUID": uid, "ClaimName": name, "Namespace": ns, "PodUIDs": {},
                             "DriverState": {driver: {"Devices": []}}}
                    self.claims[uid] = entry
                # Upstream appends on re-prepare (recorded: the device listed twice after a restart).
                entry["DriverState"].setdefault(driver, {"Devices": []})["Devices"] += devices
                entry["PodUIDs"][pod_uid] = {}
                self.prepared_now.add(uid)
        return ok

    def remove_pod(self, pod: dict[str, Any]) -> list[str]:
        """The pod is gone: unprepare the claims no other pod uses. Returns the unprepared claim UIDs."""
        pod_uid = pod["metadata"]["uid"]
        with self._lock:
            self.pods.pop(pod_uid, None)
            self.running.discard(pod_uid)
            done: dict[str, list[dict[str, Any]]] = {}
            for entry in list(self.claims.values()):
                if pod_uid not in entry["PodUIDs"]:
                    continue
                del entry["PodUIDs"][pod_uid]
                if not entry["PodUIDs"]:
                    for driver in entry["DriverState"]:
                        done.setdefault(driver, []).append(entry)
        out: list[str] = []
        for driver, entries in done.items():
            refs = [(e["Namespace"], e["ClaimUID"], e["ClaimName"]) for e in entries]
            call = Call("NodeUnprepareResources", "", refs)
            self.calls.append(call)
            try:
                stub, pb, call.version = self._stub(driver)
                resp = stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(
                    claims=[pb.Claim(namespace=n, uid=u, name=m) for n, u, m in refs]), timeout=45)
                call.response = resp
            except (RuntimeError, grpc.RpcError) as exc:
                call.error = str(exc)
                continue
            for _, uid, _ in refs:
                if uid in resp.claims and not resp.claims[uid].error:
                    with self._lock:
                        self.claims.pop(uid, None)
                        self.prepared_now.discard(uid)
                    out.append(uid)
        with self._lock:
            self._save_checkpoint()
        return out

    def pod_resources(self, pod_uid: str) -> dict[str, list[dict[str, Any]]]:
        """PodResources v1 ``dynamic_resources`` per container, as the kubelet reports them."""
        with self._lock:
            pod = self.pods.get(pod_uid)
            if pod is None:
                return {}
            entries = [e for e in self.claims.values() if pod_uid in e["PodUIDs"]]
        by_name = {e["ClaimName"]: e for e in entries}
        claims = dict(self._pod_claims(pod))
        out: dict[str, list[dict[str, Any]]] = {}
        for ctr in (pod.get("spec") or {}).get("containers") or []:
            res = []
            for c in (ctr.get("resources") or {}).get("claims") or []:
                e = by_name.get(claims.get(c["name"], ""))
                if e is None:
                    continue
                crs = []
                for driver, ds in e["DriverState"].items():
                    for d in ds["Devices"]:
                        cr: dict[str, Any] = {"cdi_devices": [{"name": x} for x in d["CDIDeviceIDs"]],
                                              "driver_name": driver, "pool_name": d["PoolName"],
                                              "device_name": d["DeviceName"]}
                        if d["ShareID"]:
                            cr["share_id"] = d["ShareID"]
                        crs.append(cr)
                res.append({"claim_name": e["ClaimName"], "claim_namespace": e["Namespace"], "claim_resources": crs})
            out[ctr["name"]] = res
        return out

    def wait(self, cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if cond():
                return True
            time.sleep(0.01)
        return cond()
