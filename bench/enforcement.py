"""Check that every share kubegpu serves is held to its limits by the MPS daemon kubegpu started.

The sequence (the same with or without a GPU):

1. a node daemon with ``shareEnforcement: mps`` and share slots serves, through the stand-in kubelet over its
   real socket, two shapes of fine-grained share (25 % / 16 GiB twice, 50 % / 32 GiB): kubegpu's own
   ``Allocate`` answers; a node daemon with ``sharing.mps`` (4 replicas) serves one MPS replica; the DRA
   driver prepares one consumable-capacity share (25 % / 16 GiB): kubegpu's own ``NodePrepareResources``
   answer (the claim's CDI spec);
2. each answer is run as the container would run it: its environment, its pipe directory (the host path of
   its mount), its GPU; once as served and once with the container's own environment raised to 100 % and
   the whole GPU's memory (``env_raise_escapes``: clients that got more than their share that way);
3. two 50 % shares run at once (``two_share_throughput_ratio``: their summed throughput over one client
   alone, the concurrency one server keeps);
4. one share daemon is stopped: the node must refuse that shape (``void_limits_served`` counts answers
   that carried limits with no daemon answering behind their pipe), and serve it again once it is back.

With an NVIDIA GPU and PyTorch each client is a CUDA process: memory is what it could allocate in 1 GiB
blocks (``memory_over_limit_gib``: the worst excess over its limit), compute its bf16 8192³ matmul
throughput as a share of one client alone through an unlimited MPS server (``compute_error_points``: the
worst |measured − granted| × 100; ``…_at_baseline_clock``: the same with each client's throughput taken at the
unlimited client's SM clock, since a lone small share runs at a higher clock). A share has ``escaped`` when it
could allocate more than its limit, when raising its own environment got it more than 5 % more throughput,
or when its throughput at the baseline clock is more than 5 points over its grant (more SMs). Without them
the stand-in ``nvidia-cuda-mps-control`` answers instead
(``"gpu": null``): the limits are those its server grants each client, so the memory and compute figures
check what kubegpu told MPS, not what a GPU did, and the throughput ratio is null.

5. per enforcement mode (``none``, ``per-shape``, ``strict``; ``modes`` in the JSON), at the node's MPS layer
   (``ShareEnforcer``, the layer both kubelet paths ask): shares are served, then each share's client tries
   the three edits a tenant can make: its environment raised, its pipe directory pointed at an empty
   directory, its pipe directory unset (CUDA then looks at ``/tmp/nvidia-mps``, where kubegpu mounts the pipe
   too). ``pipe_escapes``: clients that got GPU memory or compute past their share by skipping the server (0
   in strict); ``escapes``: by any edit; ``compute_mode_restored``: the GPU's compute mode is the one found
   once its shares ended and the node stopped; ``for_share_p99_ms``: the answer once the GPU's daemon is up;
6. ``Allocate`` round trips through the stand-in kubelet, enforcement off and on (``allocate_p99_ms``): a
   share's daemon is asked once per shape, so enforcement adds little once it is up.

Usage: ``python bench/enforcement.py [--standin]``; progress on stderr, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 2**30
NODE = "bench-node"
SLOTS = "kubegpu.io/gpu.shared"

# One CUDA client: how much memory it can pin (1 GiB blocks up to a cap) and its bf16 matmul throughput.
CLIENT = r"""
import json, os, sys, time
import torch
cap = int(os.environ["BENCH_CAP_GIB"]); seconds = float(os.environ["BENCH_SECONDS"])
out = {"allocated_gib": 0, "tflops": None, "sm_clock_mhz": None, "power_w": None, "error": ""}
try:
    blocks = []
    if cap > 0:
        try:
            for _ in range(cap):
                blocks.append(torch.empty(2**30, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError:
            pass
        out["allocated_gib"] = len(blocks)
        del blocks
        torch.cuda.empty_cache()
    if seconds > 0:
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        start = os.environ.get("BENCH_START")
        if start:
            while time.time() < float(start):
                time.sleep(0.001)
        t0 = time.perf_counter(); k = 0
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                a @ b
            torch.cuda.synchronize(); k += 10
        out["tflops"] = 2 * n**3 * k / (time.perf_counter() - t0) / 1e12
        try:  # the SM clock right after the timed loop: a lone small share runs at a higher clock
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByUUID(os.environ["CUDA_VISIBLE_DEVICES"])
            out["sm_clock_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
            out["power_w"] = round(pynvml.nvmlDeviceGetPowerUsage(h) / 1000)
        except Exception:
            pass
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"[:300]
print(json.dumps(out))
"""


def log(msg: str) -> None:
    print(f"[enforcement] {msg}", file=sys.stderr, flush=True)


@dataclass
class Served:
    """One container answer: what kubegpu handed out, and the share it was for."""

    label: str
    path: str  # allocate or prepare
    gpu: str
    core: int
    memory_bytes: int
    env: dict[str, str]
    mounts: dict[str, str]  # container path -> host path

    def host_env(self, **override: str) -> dict[str, str]:
        """The environment the client sees, with its pipe directory at the host path the mount gives."""
        env = {k: v for k, v in self.env.items() if k.startswith(("CUDA_MPS_", "KUBEGPU_"))}
        pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
        if pipe is not None:
            env["CUDA_MPS_PIPE_DIRECTORY"] = self.mounts.get(pipe, "")
        env.update(override)
        return env


# ----- the GPU or the stand-in ---------------------------------------------------------------------


class Runner:
    """Runs one client of a served share; ``measure`` answers allocated GiB and the share of throughput."""

    gpu: str | None = None
    total_gib = 0

    def measure(self, env: dict[str, str], gpu: str, limit_gib: float, compute: bool) -> dict[str, Any]:
        raise NotImplementedError

    def concurrent(self, envs: Sequence[dict[str, str]], gpu: str) -> list[float | None]:
        raise NotImplementedError


class StandinRunner(Runner):
    def __init__(self, total_gib: int, driver_state: str | None = None) -> None:
        self.total_gib = total_gib
        self.driver_state = driver_state  # the fake driver's compute modes and contexts

    def measure(self, env: dict[str, str], gpu: str, limit_gib: float, compute: bool) -> dict[str, Any]:
        from kubegpu_standins.mps_control import connect_client

        got = connect_client(env, [gpu], driver_state=self.driver_state)
        if got.get("error"):  # the driver refused it a context: no GPU at all
            return {"allocated_gib": 0, "share": 0.0, "mps": got["mps"], "error": got["error"]}
        if not got["mps"]:  # no daemon behind the pipe: the whole GPU, as the H200 showed
            return {"allocated_gib": self.total_gib, "share": 1.0, "mps": False}
        mib = got["memory_limit_mib"].get(gpu)
        alloc = self.total_gib if mib is None else min(self.total_gib, int(mib // 1024))
        return {"allocated_gib": alloc, "share": got["thread_percentage"] / 100, "mps": True}

    def concurrent(self, envs: Sequence[dict[str, str]], gpu: str) -> list[float | None]:
        return [None for _ in envs]  # throughput is not something a stand-in can measure


class CudaRunner(Runner):
    def __init__(self, gpu_model: str, total_gib: int, seconds: float = 2.0) -> None:
        self.gpu = gpu_model
        self.total_gib = total_gib
        self.seconds = seconds
        self.baseline: float | None = None
        self.baseline_clock: int | None = None

    def _spawn(self, env: dict[str, str], gpu: str, cap: int, seconds: float, start: float | None = None
               ) -> subprocess.Popen[str]:
        full = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        full.update(env, CUDA_VISIBLE_DEVICES=gpu, BENCH_CAP_GIB=str(cap), BENCH_SECONDS=str(seconds))
        if start is not None:
            full["BENCH_START"] = str(start)
        return subprocess.Popen([sys.executable, "-c", CLIENT], env=full, stdout=subprocess.PIPE, text=True)

    @staticmethod
    def _result(p: subprocess.Popen[str]) -> dict[str, Any]:
        out, _ = p.communicate(timeout=120)
        try:
            got: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"allocated_gib": 0, "tflops": None, "error": f"client said {out[-300:]!r}"}
        return got

    def measure(self, env: dict[str, str], gpu: str, limit_gib: float, compute: bool) -> dict[str, Any]:
        cap = min(self.total_gib, int(limit_gib) + 8)  # enough to show an excess, not a full fill each time
        got = self._result(self._spawn(env, gpu, cap, self.seconds if compute else 0))
        if got.get("error"):
            log(f"client error: {got['error']}")
        share = per_clock = None
        if got.get("tflops") and self.baseline:
            share = got["tflops"] / self.baseline
            if got.get("sm_clock_mhz") and self.baseline_clock:
                per_clock = share * self.baseline_clock / got["sm_clock_mhz"]
        return {"allocated_gib": got["allocated_gib"], "share": share, "share_at_baseline_clock": per_clock,
                "tflops": got.get("tflops"), "sm_clock_mhz": got.get("sm_clock_mhz"),
                "power_w": got.get("power_w"), "error": got.get("error", "")}

    def concurrent(self, envs: Sequence[dict[str, str]], gpu: str) -> list[float | None]:
        start = time.time() + 8  # every client starts its timed loop at once, after CUDA is up
        procs = [self._spawn(e, gpu, 0, self.seconds, start) for e in envs]
        return [self._result(p).get("tflops") for p in procs]


def detect_gpu() -> tuple[Any, str, int] | None:
    """(NVML backend, model, memory GiB) of GPU 0, or None without an NVIDIA GPU and PyTorch."""
    try:
        import torch  # type: ignore[import-not-found]  # noqa: F401

        from kubegpu.inventory.nvml import NvmlBackend

        backend = NvmlBackend(node_name=NODE)
        inv = backend.discover()
    except Exception as exc:
        log(f"no GPU run ({type(exc).__name__}: {exc}); using the stand-in")
        return None
    if not inv.gpus:
        return None
    g = inv.gpus[0]
    return backend, g.model, g.memory_bytes // GIB


# ----- kubegpu's answers ---------------------------------------------------------------------------


class Records:
    """The scheduler's record for the next pending container (one at a time, as the bench asks)."""

    def __init__(self) -> None:
        self.core, self.memory = 25, 16 * GIB

    def resolve(self, resource: str, device_ids: Sequence[str]) -> Any:
        from kubegpu.model.allocation import DeviceGrant
        from kubegpu.node.deviceplugin.resolver import ResolvedAllocation

        if resource != SLOTS:
            return None
        gpus = tuple(DeviceGrant(0, i.split("::")[0], self.core, self.memory, 0) for i in device_ids)
        return ResolvedAllocation(gpus, pod="bench/p", container="c")

    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                  size: int) -> Sequence[str] | None:
        return None

    def set_inventory(self, inventory: Any) -> None:
        pass

    def kubelet_registered(self, resource: str) -> None:
        pass


@contextmanager
def node_daemon(backend_factory: Callable[[], Any], work: Path, flags: dict[str, str], resolver: Any = None
                ) -> Iterator[tuple[Any, Any]]:
    from kubegpu.node.daemon import NodeDaemon
    from kubegpu.node.options import load_node_options
    from kubegpu_standins.kubelet import StandinKubelet

    plugin_dir = work / "dp"
    kubelet = StandinKubelet(plugin_dir)
    kubelet.start()
    settings = {"cdi_dir": str(work / "cdi"), "mig_minors_file": str(work / "mig-minors")}
    d = NodeDaemon(backend_factory(), lambda: load_node_options(flags, {}, settings=settings,
                                                                 plugin_dir=str(plugin_dir)), resolver=resolver,
                   env=os.environ)
    d.start()
    try:
        yield d, kubelet
    finally:
        d.stop()
        kubelet.stop()


def _served(label: str, path: str, resp: Any, core: int, memory: int) -> Served:
    env = dict(resp.envs)
    return Served(label, path, env.get("KUBEGPU_VISIBLE_GPUS", ""), core, memory, env,
                  {m.container_path: m.host_path for m in resp.mounts})


@contextmanager
def dra_share(backend_factory: Callable[[], Any], work: Path, mps_root: str, binary: str, core: int,
              memory: int) -> Iterator[Served]:
    """The DRA driver prepares one consumable-capacity share; its answer is the claim's CDI spec."""
    from kubegpu.model.quantity import format_bytes
    from kubegpu.node.dra.daemon import DraDaemon, DraOptions
    from kubegpu.node.dra.names import DRIVER
    from kubegpu.node.dra.prepare import cdi_spec_path
    from kubegpu.node.dra.slices import DraSettings

    settings = DraSettings(node_name=NODE, shared_gpus=None, mps=True, mps_root=mps_root, mps_binary=binary)
    opts = DraOptions(settings=settings, plugins_dir=str(work / "plugins"), registry_dir=str(work / "registry"),
                      cdi_dir=str(work / "cdi-dra"))
    claims: dict[str, dict[str, Any]] = {}

    class Reader:
        def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
            return claims[name]

    d = DraDaemon(backend_factory(), opts, None, reader=Reader(), env=os.environ)
    d.start()
    try:
        dev = next(x for x in d.table().values() if x.share_memory_max)  # a GPU that takes shares
        claims["share"] = {"metadata": {"uid": "bench-claim-uid", "name": "share", "namespace": "bench"},
                           "status": {"allocation": {"devices": {"results": [{
                               "driver": DRIVER, "pool": NODE, "device": dev.name, "request": "gpu",
                               "shareID": "bench-share",
                               "consumedCapacity": {"compute": str(core), "memory": format_bytes(memory)}}]}}}}
        assert d.preparer is not None
        d.preparer.prepare("bench", "bench-claim-uid", "share")
        spec = json.loads(cdi_spec_path(opts.cdi_dir, "bench-claim-uid").read_text())
        edits = spec["containerEdits"]
        env = dict(e.split("=", 1) for e in edits["env"])
        mounts = {m["containerPath"]: m["hostPath"] for m in edits.get("mounts", [])}
        yield Served(f"dra {core}%/{memory // GIB}GiB", "prepare", dev.gpu_uuid, core, memory, env, mounts)
    finally:
        d.stop()


# ----- the checks ----------------------------------------------------------------------------------


def daemon_answers(binary: str, pipe: str) -> bool:
    if not pipe or not os.path.isdir(pipe):
        return False
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe}
    try:
        p = subprocess.run([binary], input="get_server_list\n", env=env, capture_output=True, text=True,
                           timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0


def run(standin: bool, allocations: int = 200) -> dict[str, Any]:
    from kubegpu.inventory.fake import FakeBackend
    from kubegpu_standins.fake_driver import ENV_DRIVER_STATE
    from kubegpu_standins.mps_control import install

    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kgbe-", dir="/tmp"))  # unix socket paths stay short
    mps_root = str(work / "mps")
    found = None if standin else detect_gpu()
    runner: Runner
    if found is None:
        topo = work / "h200.yaml"
        topo.write_text("name: bench\nnode: {cpu: 16, memory: 128Gi}\ngpus:\n"
                        "- {model: NVIDIA H200, memoryMiB: 143771, computeCapability: \"9.0\"}\n")

        driver_state = str(work / "driver")
        os.environ[ENV_DRIVER_STATE] = driver_state  # the stand-in daemons read the fake driver's modes there

        def backend_factory() -> Any:
            return FakeBackend(str(topo), node_name=NODE, driver_state=driver_state)

        binary = install(work)
        runner = StandinRunner(143771 // 1024, driver_state)
    else:
        from kubegpu.inventory.nvml import NvmlBackend
        from kubegpu.node.mps import find_binary

        _, model, total_gib = found

        def backend_factory() -> Any:
            return NvmlBackend(node_name=NODE)

        real = find_binary("/")
        if real is None:
            raise SystemExit("a GPU but no nvidia-cuda-mps-control: cannot check enforcement")
        binary = real
        runner = CudaRunner(model, total_gib)
    served: list[Served] = []
    void = 0
    results: list[dict[str, Any]] = []
    two_ratio: float | None = None
    try:
        if isinstance(runner, CudaRunner):
            from kubegpu.node.mps import MpsManager, share_spec

            gpu0 = backend_factory().discover().gpus[0]
            # its own root: the node daemons do not restart it
            base = MpsManager(binary, str(work / "mps-base"), base_env=os.environ)
            b = base.serve(share_spec([(gpu0.uuid, 100, gpu0.memory_bytes)]))
            env = {k: v for k, v in b.env}
            env["CUDA_MPS_PIPE_DIRECTORY"] = b.mounts[0][0]
            got = runner._result(runner._spawn(env, gpu0.uuid, 0, runner.seconds))
            runner.baseline, runner.baseline_clock = got.get("tflops"), got.get("sm_clock_mhz")
            baseline = {k: got.get(k) for k in ("tflops", "sm_clock_mhz", "power_w")}
            log(f"one client alone through an unlimited MPS server: {baseline}")
            base.stop()

        flags = {"shared-slots": "16", "share-enforcement": "mps", "mps-control-binary": binary,
                 "mps-root": mps_root, "fail-on-init-error": "true"}
        rec = Records()
        with node_daemon(backend_factory, work / "a", flags, rec) as (d, kubelet):
            assert kubelet.wait_registered(SLOTS, timeout_s=10)
            for core, mem in ((25, 16), (25, 16), (50, 32)):
                rec.core, rec.memory = core, mem * GIB
                resp = kubelet.allocate(SLOTS, 1).response
                served.append(_served(f"share {core}%/{mem}GiB", "allocate", resp, core, mem * GIB))
            dra = dra_share(backend_factory, work / "dra", mps_root, binary, 30, 12 * GIB)
            with dra as claim:
                served.append(claim)
                log(f"served {len(served)} shares; daemons: {[s.name for s in d.mps.states()]}")
                results += check_all(runner, served)
                for s in served:
                    if any(k.startswith(("CUDA_MPS_", "KUBEGPU_GPU_")) for k in s.env):
                        pipe = s.mounts.get(s.env.get("CUDA_MPS_PIPE_DIRECTORY", ""), "")
                        void += not daemon_answers(binary, pipe)
            # Two 50 % shares of one shape at once: one server, concurrent kernels.
            rec.core, rec.memory = 50, 32 * GIB
            second = _served("share 50%/32GiB", "allocate", kubelet.allocate(SLOTS, 1).response, 50, 32 * GIB)
            pair = next(s for s in served if s.core == 50), second
            tflops = runner.concurrent([p.host_env() for p in pair], pair[0].gpu)
            if all(t is not None for t in tflops) and isinstance(runner, CudaRunner) and runner.baseline:
                two_ratio = sum(t for t in tflops if t is not None) / runner.baseline
                log(f"two 50% shares at once: {tflops} TFLOP/s, ratio {two_ratio:.2f}")
            # A daemon that stops answering (and cannot start again): its shape is refused, its GPU's slots
            # are Unhealthy; once it starts again the shape is served through it again.
            assert d.mps is not None
            (entry,) = [e for e in d.mps._entries.values() if e.spec.describe().startswith("25% / 16384M")]
            entry.control.quit()
            entry.control.binary = str(work / "missing")
            d.mps.supervise()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not kubelet.unhealthy(SLOTS):
                time.sleep(0.05)
            rec.core, rec.memory = 25, 16 * GIB
            try:
                refused = kubelet.allocate(SLOTS, 1).response
                void += 1  # served while its daemon was down: a limit nothing enforces
                log(f"served while the daemon was down: {dict(refused.envs)}")
            except Exception as exc:
                log(f"refused while the daemon was down, as it must be: {str(exc)[:160]}")
            entry.control.binary, entry.next_try = binary, 0.0
            d.mps.supervise()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and kubelet.unhealthy(SLOTS):
                time.sleep(0.05)
            again = kubelet.allocate(SLOTS, 1).response
            s = _served("share 25%/16GiB after restart", "allocate", again, 25, 16 * GIB)
            void += not daemon_answers(binary, s.mounts.get(s.env.get("CUDA_MPS_PIPE_DIRECTORY", ""), ""))
            results += check_all(runner, [s], compute=False)
            served.append(s)
        mflags = {"mps-control-binary": binary, "mps-root": mps_root, "config-file": str(work / "mps.yaml")}
        (work / "mps.yaml").write_text("version: v1\nsharing:\n  mps:\n    resources:\n"
                                       "    - name: nvidia.com/gpu\n      replicas: 4\n")
        with node_daemon(backend_factory, work / "b", mflags) as (d, kubelet):
            assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=10)
            resp = kubelet.allocate("nvidia.com/gpu", 1).response
            total = backend_factory().discover().gpus[0].memory_bytes
            s = _served("MPS replica 1/4", "allocate", resp, 25, total // 4)
            void += not daemon_answers(binary, s.mounts.get(s.env.get("CUDA_MPS_PIPE_DIRECTORY", ""), ""))
            results += check_all(runner, [s])
            served.append(s)
        modes = {m: escape_mode(m, runner, backend_factory(), binary, work / f"m-{m}") for m in MODES}
        latency = allocate_latency(backend_factory, work / "lat", binary, allocations)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    over = max((r["over_gib"] for r in results), default=0.0)
    comp = [r["compute_error_points"] for r in results if r["compute_error_points"] is not None]
    at = [abs(r["share_at_baseline_clock_pct"] - r["granted_core"]) for r in results
          if r["share_at_baseline_clock_pct"] is not None]
    return {
        "gpu": runner.gpu,
        "mode": "cuda" if runner.gpu else "stand-in (limits as the stand-in server grants them; no throughput)",
        "shares_tested": len(served),
        "memory_over_limit_gib": round(over, 2),
        "compute_error_points": round(max(comp), 1) if comp else None,
        "compute_error_points_at_baseline_clock": round(max(at), 1) if at else None,
        "env_raise_escapes": sum(1 for r in results if r["raised_env"] and r["escaped"]),
        "escapes": sum(1 for r in results if r["escaped"]),
        "void_limits_served": void,
        "two_share_throughput_ratio": None if two_ratio is None else round(two_ratio, 3),
        "pipe_escapes": modes["strict"]["pipe_escapes"],
        "compute_mode_restored": all(m["compute_mode_restored"] for m in modes.values()),
        "modes": modes,
        "allocate_p99_ms": latency,
        "allocate_p99_over_unenforced_ms": round(latency["per-shape"] - latency["none"], 2),
        "clients": results,
        "seconds": round(time.monotonic() - t_start, 1),
    }


def check_all(runner: Runner, served: Sequence[Served], compute: bool = True) -> list[dict[str, Any]]:
    out = []
    for s in served:
        limit_gib = s.memory_bytes / GIB
        served_share: float | None = None
        for raised in (False, True):
            env = s.host_env(**({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
                                 "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={runner.total_gib + 8}G"} if raised else {}))
            got = runner.measure(env, s.gpu, limit_gib, compute)
            over = max(0.0, got["allocated_gib"] - limit_gib)
            share = got.get("share") if compute else None
            err = None if share is None else abs(share * 100 - s.core)
            # A lone share runs at a higher SM clock than the whole GPU does (power headroom), so its share of
            # the unlimited client's throughput is above its grant; what it must not get is more SMs (its
            # throughput at the unlimited client's clock) or anything more by raising its own environment.
            at_clock = got.get("share_at_baseline_clock") if compute else None
            gained = raised and share is not None and served_share is not None and share > served_share * 1.05
            bounded = at_clock if at_clock is not None else share  # raw throughput where no clock was read
            escaped = over > 0 or gained or (bounded is not None and bounded * 100 > s.core + 5)
            if not raised:
                served_share = share
            row = {"share": s.label, "path": s.path, "raised_env": raised,
                   "granted_core": s.core, "limit_gib": round(limit_gib, 2), "allocated_gib": got["allocated_gib"],
                   "measured_share_pct": None if share is None else round(share * 100, 1),
                   "share_at_baseline_clock_pct": None if at_clock is None else round(at_clock * 100, 1),
                   "sm_clock_mhz": got.get("sm_clock_mhz"), "power_w": got.get("power_w"),
                   "over_gib": over, "compute_error_points": err, "escaped": escaped}
            log(json.dumps(row))
            out.append(row)
    return out


MODES = ("none", "per-shape", "strict")
ESCAPES = ("raised_env", "empty_pipe", "unset_pipe")


def _escape_env(s: Served, how: str, empty: str, total_gib: int) -> dict[str, str]:
    """The client's environment after one tenant edit, its pipe at the host path its container would reach."""
    from kubegpu.node.mps.spec import DEFAULT_PIPE_DIR

    if how == "raised_env":
        return s.host_env(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100",
                          CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=f"0={total_gib + 8}G")
    env = s.host_env()
    # Unset, CUDA looks at /tmp/nvidia-mps: in the container, whatever is mounted there (kubegpu's pipe, or
    # nothing); empty, a directory the tenant made.
    env["CUDA_MPS_PIPE_DIRECTORY"] = empty if how == "empty_pipe" else s.mounts.get(DEFAULT_PIPE_DIR, empty)
    return env


def escape_mode(mode: str, runner: Runner, backend: Any, binary: str, work: Path) -> dict[str, Any]:
    """Serve shares under ``mode`` at the node's MPS layer and try every tenant edit on one of them."""
    from kubegpu.node.mps import ComputeModeGuard, MpsError, MpsManager
    from kubegpu.node.mps.enforcer import ShareEnforcer

    work.mkdir(parents=True)
    empty = work / "empty"
    empty.mkdir()
    inv = backend.discover()
    gpu = inv.gpus[0]
    found = backend.compute_mode(gpu.uuid)
    root = str(work / "mps")
    manager = MpsManager(binary, root, base_env=os.environ) if mode != "none" else None
    guard = ComputeModeGuard(backend, root) if mode == "strict" else None
    enf = ShareEnforcer(manager, "mps" if mode == "per-shape" else mode, inv, compute_modes=guard,
                        server_uid=os.getuid())
    served: list[Served] = []
    other_shape = ""
    try:
        for i, (core, mem) in enumerate(((25, 16), (25, 16), (50, 32))):
            try:
                b = enf.for_share([(gpu.uuid, core, mem * GIB)], [gpu.uuid], holder=f"bench-{i}")
            except MpsError as exc:
                other_shape = str(exc)[:200]  # strict: one shape per GPU
                continue
            env = dict(b.env) if b is not None else {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(core),
                                                     "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={mem * 1024}M"}
            mounts = {c: h for h, c in b.mounts} if b is not None else {}
            served.append(Served(f"{mode} {core}%/{mem}GiB", "mps-layer", gpu.uuid, core, mem * GIB, env, mounts))
        mode_now = backend.compute_mode(gpu.uuid)
        rows = []
        s = served[0]
        for how in ESCAPES:
            got = runner.measure(_escape_env(s, how, str(empty), runner.total_gib), s.gpu, s.memory_bytes / GIB, True)
            share = got.get("share_at_baseline_clock") or got.get("share")
            over = max(0.0, got["allocated_gib"] - s.memory_bytes / GIB)
            escaped = over > 0 or (share is not None and share * 100 > s.core + 5)
            rows.append({"edit": how, "allocated_gib": got["allocated_gib"],
                         "share_pct": None if share is None else round(share * 100, 1), "escaped": escaped,
                         "refused": got.get("error", "")[:160]})
            log(f"{mode}: {json.dumps(rows[-1])}")
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            enf.for_share([(gpu.uuid, 25, 16 * GIB)], [gpu.uuid], holder="bench-0")
            times.append((time.perf_counter() - t0) * 1000)
        times.sort()
    finally:
        for i in range(3):
            enf.release_share(f"bench-{i}", [gpu.uuid])
        kept = enf.stop()
        if manager is not None:
            manager.stop()
    return {
        "shares_served": len(served),
        "compute_mode_while_shared": mode_now,
        "other_shape_refused": other_shape,
        "escapes": sum(r["escaped"] for r in rows),
        "pipe_escapes": sum(r["escaped"] for r in rows if r["edit"] != "raised_env"),
        "compute_mode_restored": backend.compute_mode(gpu.uuid) == found and not kept,
        "for_share_p50_ms": round(times[len(times) // 2], 3),
        "for_share_p99_ms": round(times[int(0.99 * len(times)) - 1], 3),
        "edits": rows,
    }


def allocate_latency(backend_factory: Callable[[], Any], work: Path, binary: str, n: int = 200) -> dict[str, float]:
    """p99 (and p50, ``<mode>_p50``) of a share's ``Allocate`` round trip through the stand-in kubelet,
    enforcement off and per-shape."""
    out: dict[str, float] = {}
    for mode, setting in (("none", "none"), ("per-shape", "mps")):
        flags = {"shared-slots": "16", "share-enforcement": setting, "mps-control-binary": binary,
                 "mps-root": str(work / mode / "mps"), "fail-on-init-error": "true"}
        with node_daemon(backend_factory, work / mode, flags, Records()) as (_, kubelet):
            assert kubelet.wait_registered(SLOTS, timeout_s=10)
            kubelet.allocate(SLOTS, 1, reserve=False)  # the daemon of the shape starts here, once
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                kubelet.allocate(SLOTS, 1, reserve=False)
                times.append((time.perf_counter() - t0) * 1000)
        times.sort()
        out[mode] = round(times[int(0.99 * n) - 1], 2)
        out[f"{mode}_p50"] = round(times[n // 2], 2)
        log(f"Allocate with enforcement {mode}: p50 {out[f'{mode}_p50']} ms, p99 {out[mode]} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--standin", action="store_true", help="use the stand-in even where a GPU is present")
    ap.add_argument("--allocations", type=int, default=200, help="Allocate round trips timed per mode")
    args = ap.parse_args()
    result = run(args.standin, args.allocations)
    print(json.dumps(result))


if __name__ == "__main__":
    threading.excepthook = lambda a: log(f"thread {a.thread}: {a.exc_value}")
    main()
