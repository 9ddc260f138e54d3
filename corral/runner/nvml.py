"""Free GPU memory from NVML, NVIDIA's management library, which ships with the driver.

The daemon asks how much VRAM is free before each load. Asking ggml (cudaMemGetInfo)
creates a CUDA context in the daemon, a few hundred MB of VRAM that it then holds for
as long as it runs, though it never computes anything there. NVML answers without a
context. Where it is missing, or CUDA_VISIBLE_DEVICES limits what CUDA sees (NVML counts
every device regardless), the caller falls back to ggml's answer.
"""

from __future__ import annotations

import ctypes

from corral.config import cuda_visible_devices


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


def free_bytes(library: str = "libnvidia-ml.so.1") -> int | None:
    """Free bytes summed over the driver's GPUs; None where NVML cannot say."""
    if cuda_visible_devices() is not None:
        return None
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        free = 0
        for i in range(count.value):
            handle, memory = ctypes.c_void_p(), _Memory()
            if (nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(handle)) != 0
                    or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0):
                return None
            free += memory.free
        return free
    finally:
        nvml.nvmlShutdown()
