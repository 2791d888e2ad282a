"""Level-3 health probe: can a CUDA context be created on this GPU, and does a tiny copy come back intact?

``CudaProbe.probe(uuid, pci_bus_id, timeout_s)`` runs ``python -m mapper.edge.gpu.cudaprobe`` as a short-lived child
process that loads libcuda through ctypes and calls, in order: ``cuInit``, ``cuDeviceGetByPCIBusId`` (and, where
the driver has it, ``cuDeviceGetUuid_v2`` to check it is the GPU NVML calls ``uuid``), ``cuCtxCreate_v2``,
``cuMemAlloc_v2`` (64 KiB), ``cuMemcpyHtoD_v2``, ``cuMemcpyDtoH_v2`` (the bytes compared), ``cuMemFree_v2`` and
``cuCtxDestroy_v2``. The child prints one JSON line and exits. A child still running at ``timeout_s`` is killed:
a hung context creation (a GPU stuck after an XID) cannot hang the mapper, and the driver frees whatever the
child held when it dies. Nothing of CUDA is ever loaded into the mapper's own process.

The result is a ``mapper.edge.health.checks.ProbeResult``: ``pass``, ``fail`` with the step and CUDA's error name
(``cuCtxCreate-CUDA_ERROR_UNKNOWN``), ``timeout``, or ``skipped`` (``libcuda-not-found``: no CUDA driver library
in this container, which says nothing about the GPU). (``slow`` is the caller's verdict on the latency.)
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the child process imports nothing of the mapper but this module: a probe costs less CPU
    from mapper.edge.health.checks import ProbeResult

__all__ = ["DEFAULT_LIBRARY", "CudaProbe", "cuda_bus_id", "run_probe"]

DEFAULT_LIBRARY = "libcuda.so.1"
#: The child's answer when libcuda cannot be loaded: the probe is ``skipped`` (no verdict), not failed.
LIBCUDA_NOT_FOUND = "libcuda-not-found"
_COPY_BYTES = 64 * 1024


def cuda_bus_id(nvml_bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` as CUDA spells it (``0000:3B:00.0``: a 4-digit domain)."""
    parts = nvml_bus_id.strip().split(":")
    if len(parts) == 3:
        try:
            parts[0] = f"{int(parts[0], 16):04x}"
        except ValueError:
            return nvml_bus_id
    return ":".join(parts)


class CudaProbe:
    """The probe as a child process. ``library``: libcuda's path or name; ``python``: the interpreter of the
    child; ``env``: extra environment for it (tests point it at a stand-in libcuda)."""

    def __init__(
        self,
        library: str = DEFAULT_LIBRARY,
        *,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.library = library
        self.python = python
        self.env = dict(env) if env else {}

    def command(self, uuid: str, pci_bus_id: str) -> list[str]:
        return [self.python, "-m", "mapper.edge.gpu.cudaprobe", "--library", self.library, "--uuid", uuid, pci_bus_id]

    def probe(self, uuid: str, pci_bus_id: str, timeout_s: float) -> ProbeResult:
        """Blocks for at most ``timeout_s`` (plus the kill); never raises for a GPU or CUDA problem."""
        from mapper.edge.health.checks import ProbeResult

        if not pci_bus_id:
            return ProbeResult("fail", "no-pci-bus-id", 0.0)
        env = {**os.environ, **self.env} if self.env else None
        started = time.perf_counter()
        try:
            done = subprocess.run(
                self.command(uuid, pci_bus_id),
                capture_output=True,
                timeout=timeout_s,
                env=env,
                check=False,
                text=True,
            )
        except subprocess.TimeoutExpired:
            return ProbeResult("timeout", f"after-{timeout_s:g}s", time.perf_counter() - started)
        except OSError as exc:
            return ProbeResult("fail", f"probe-not-started-{type(exc).__name__}", time.perf_counter() - started)
        took_s = time.perf_counter() - started
        if done.returncode < 0:
            return ProbeResult("fail", f"probe-killed-by-signal-{-done.returncode}", took_s)
        line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        try:
            answer = json.loads(line)
        except ValueError:
            return ProbeResult("fail", f"probe-exit-{done.returncode}", took_s)
        if not isinstance(answer, dict):
            return ProbeResult("fail", f"probe-exit-{done.returncode}", took_s)
        if answer.get("ok") is True:
            return ProbeResult("pass", "", took_s)
        reason = str(answer.get("reason", "unknown"))[:200]
        if reason == LIBCUDA_NOT_FOUND:
            # No CUDA in this container (NVIDIA_DRIVER_CAPABILITIES without "compute"): no verdict on the GPU.
            return ProbeResult("skipped", reason, None)
        return ProbeResult("fail", reason, took_s)


# --------------------------------------------------------------------------------------------------
# The child
# --------------------------------------------------------------------------------------------------


class _CudaFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _uuid_text(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def run_probe(library: str, pci_bus_id: str, uuid: str = "") -> dict[str, object]:
    """The probe itself (in the child): ``{"ok": true}`` or ``{"ok": false, "reason": "<step>-<CUDA error>"}``."""
    try:
        cuda = ctypes.CDLL(library)
    except OSError:
        return {"ok": False, "reason": LIBCUDA_NOT_FOUND}

    def name_of(code: int) -> str:
        text = ctypes.c_char_p()
        fn = getattr(cuda, "cuGetErrorName", None)
        if fn is not None and fn(ctypes.c_int(code), ctypes.byref(text)) == 0 and text.value:
            return text.value.decode(errors="replace")
        return f"CUDA_ERROR_{code}"

    def call(step: str, fname: str, *args: object) -> None:
        fn = getattr(cuda, fname, None)
        if fn is None:
            raise _CudaFailed(f"{step}-not-in-libcuda")
        code = int(fn(*args))
        if code != 0:
            raise _CudaFailed(f"{step}-{name_of(code)}")

    ctx = ctypes.c_void_p()
    dptr = ctypes.c_ulonglong()
    try:
        call("cuInit", "cuInit", ctypes.c_uint(0))
        dev = ctypes.c_int()
        call("cuDeviceGetByPCIBusId", "cuDeviceGetByPCIBusId", ctypes.byref(dev), cuda_bus_id(pci_bus_id).encode())
        get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or getattr(cuda, "cuDeviceGetUuid", None)
        if uuid and get_uuid is not None:
            raw = ctypes.create_string_buffer(16)
            if int(get_uuid(raw, dev)) == 0 and _uuid_text(raw.raw[:16]).lower() != uuid.lower():
                return {"ok": False, "reason": "uuid-mismatch"}
        call("cuCtxCreate", "cuCtxCreate_v2", ctypes.byref(ctx), ctypes.c_uint(0), dev)
        call("cuMemAlloc", "cuMemAlloc_v2", ctypes.byref(dptr), ctypes.c_size_t(_COPY_BYTES))
        pattern = bytes(range(256)) * (_COPY_BYTES // 256)
        src = ctypes.create_string_buffer(pattern, _COPY_BYTES)
        back = ctypes.create_string_buffer(_COPY_BYTES)
        call("cuMemcpyHtoD", "cuMemcpyHtoD_v2", dptr, src, ctypes.c_size_t(_COPY_BYTES))
        call("cuMemcpyDtoH", "cuMemcpyDtoH_v2", back, dptr, ctypes.c_size_t(_COPY_BYTES))
        if back.raw != pattern:
            return {"ok": False, "reason": "cuMemcpyDtoH-data-mismatch"}
        call("cuMemFree", "cuMemFree_v2", dptr)
        dptr = ctypes.c_ulonglong()
        call("cuCtxDestroy", "cuCtxDestroy_v2", ctx)
        ctx = ctypes.c_void_p()
    except _CudaFailed as failed:
        return {"ok": False, "reason": failed.reason}
    finally:
        if dptr.value:
            getattr(cuda, "cuMemFree_v2", lambda _p: 0)(dptr)
        if ctx.value:
            getattr(cuda, "cuCtxDestroy_v2", lambda _c: 0)(ctx)
    return {"ok": True}


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mapper.edge.gpu.cudaprobe", description="one CUDA health probe")
    parser.add_argument("--library", default=DEFAULT_LIBRARY)
    parser.add_argument("--uuid", default="")
    parser.add_argument("pci_bus_id")
    args = parser.parse_args(argv)
    answer = run_probe(args.library, args.pci_bus_id, args.uuid)
    print(json.dumps(answer), flush=True)
    return 0 if answer.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
