"""A stand-in libcuda.so.1 for the level-3 probe's tests: the driver API calls the probe makes, with cuda.h's
argument types and CUresult codes, behaving as the environment of the probe's child process says.

``CUDA_STANDIN_BUS``: the one PCI bus id it has a device at (CUDA's spelling, case-insensitive); another id is
CUDA_ERROR_INVALID_DEVICE. ``CUDA_STANDIN_UUID``: the device's UUID as 32 hex digits. ``CUDA_STANDIN_FAULT``:
``init`` (cuInit: CUDA_ERROR_NO_DEVICE), ``context`` (cuCtxCreate: CUDA_ERROR_UNKNOWN), ``alloc`` (cuMemAlloc:
CUDA_ERROR_OUT_OF_MEMORY), ``copy`` (the copy back returns zeros), ``hang`` (cuCtxCreate never returns),
``crash`` (the process aborts in cuCtxCreate). ``CUDA_STANDIN_SLOW_MS``: cuCtxCreate takes that long.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

C_SOURCE = r"""
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <stdio.h>
#include <unistd.h>
#define EXPORT __attribute__((visibility("default")))
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

static int initialised = 0;
static const char *fault(void) { const char *f = getenv("CUDA_STANDIN_FAULT"); return f ? f : ""; }

EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr) {
    switch (error) {
    case 0: *pStr = "CUDA_SUCCESS"; return 0;
    case 1: *pStr = "CUDA_ERROR_INVALID_VALUE"; return 0;
    case 2: *pStr = "CUDA_ERROR_OUT_OF_MEMORY"; return 0;
    case 3: *pStr = "CUDA_ERROR_NOT_INITIALIZED"; return 0;
    case 100: *pStr = "CUDA_ERROR_NO_DEVICE"; return 0;
    case 101: *pStr = "CUDA_ERROR_INVALID_DEVICE"; return 0;
    case 999: *pStr = "CUDA_ERROR_UNKNOWN"; return 0;
    default: *pStr = 0; return 1;
    }
}

EXPORT CUresult cuInit(unsigned int flags) {
    if (flags != 0) return 1;
    if (strcmp(fault(), "init") == 0) return 100;
    initialised = 1;
    return 0;
}

EXPORT CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId) {
    if (!initialised) return 3;
    const char *bus = getenv("CUDA_STANDIN_BUS");
    if (!bus || strcasecmp(bus, pciBusId) != 0) return 101;
    *dev = 0;
    return 0;
}

EXPORT CUresult cuDeviceGetUuid_v2(char *uuid, CUdevice dev) {
    const char *hex = getenv("CUDA_STANDIN_UUID");
    if (dev != 0) return 101;
    if (!hex || strlen(hex) != 32) return 999;
    for (int i = 0; i < 16; i++) { unsigned int b; sscanf(hex + 2 * i, "%2x", &b); uuid[i] = (char)b; }
    return 0;
}

EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    if (!initialised) return 3;
    if (dev != 0) return 101;
    const char *slow = getenv("CUDA_STANDIN_SLOW_MS");
    if (slow) usleep((useconds_t)atoi(slow) * 1000);
    if (strcmp(fault(), "hang") == 0) for (;;) pause();
    if (strcmp(fault(), "crash") == 0) abort();
    if (strcmp(fault(), "context") == 0) return 999;
    *pctx = malloc(16);
    return 0;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    if (strcmp(fault(), "alloc") == 0) return 2;
    void *p = malloc(bytesize);
    if (!p) return 2;
    *dptr = (CUdeviceptr)p;
    return 0;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    if (!dst) return 1;
    memcpy((void *)dst, src, n);
    return 0;
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    if (!src) return 1;
    if (strcmp(fault(), "copy") == 0) memset(dst, 0, n); else memcpy(dst, (const void *)src, n);
    return 0;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) { free((void *)dptr); return 0; }
EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) { free(ctx); return 0; }
"""


def build_library(folder: Path) -> Path:
    """Compile the stand-in into ``folder/libcuda.so.1`` (gcc, warnings as errors); its path."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "cuda_standin.c"
    source.write_text(C_SOURCE)
    target = folder / "libcuda.so.1"
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc is needed to build the stand-in libcuda.so.1: run scripts/bootstrap.sh --test")
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
         "-o", str(target), str(source)],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return target
