"""Where the worker runs: resolving ``--device`` / ``--dtype``, and the device's identity and memory.

On CUDA the identity (name, UUID, total memory, driver version) comes from ``cuda-python``'s driver
bindings (the optional ``gpu`` extra), falling back to torch's view when they are not installed;
on the CPU it is the CPU model and core count.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from shared.choices import DEVICES


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    if name not in DEVICES:
        raise ValueError(f"device {name!r} is not supported (supported: {', '.join(DEVICES)})")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device (is this a CUDA build of torch, with a GPU visible?)")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """``auto``: bfloat16 on CUDA, float32 on the CPU."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _driver_identity(ordinal: int) -> dict[str, Any]:
    """Name, UUID, total memory and driver version from the CUDA driver API (cuda-python)."""
    from cuda.bindings import driver  # the optional `gpu` extra

    def check(result: tuple) -> Any:
        err, *values = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return values[0] if len(values) == 1 else values

    check(driver.cuInit(0))
    dev = check(driver.cuDeviceGet(ordinal))
    raw_uuid = check(driver.cuDeviceGetUuid(dev)).bytes
    hexed = raw_uuid.hex()
    version = check(driver.cuDriverGetVersion())
    return {
        "name": check(driver.cuDeviceGetName(256, dev)).split(b"\0", 1)[0].decode(),
        "uuid": f"GPU-{hexed[:8]}-{hexed[8:12]}-{hexed[12:16]}-{hexed[16:20]}-{hexed[20:32]}",
        "total_memory_bytes": int(check(driver.cuDeviceTotalMem(dev))),
        "driver_version": f"{version // 1000}.{version % 1000 // 10}",
        "identity_source": "cuda-python",
    }


def describe_device(device: torch.device) -> dict[str, Any]:
    """Identity for /instrumentation: the GPU's (CUDA) or the CPU's."""
    if device.type != "cuda":
        return {"type": "cpu", "name": cpu_name(), "cores": os.cpu_count()}
    ordinal = device.index or 0
    props = torch.cuda.get_device_properties(ordinal)
    info: dict[str, Any] = {
        "type": "cuda",
        "index": ordinal,
        "name": props.name,
        "uuid": str(getattr(props, "uuid", "")),
        "total_memory_bytes": props.total_memory,
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "cuda_runtime": torch.version.cuda,
        "identity_source": "torch",
    }
    try:
        info.update(_driver_identity(ordinal))
    except Exception as exc:  # cuda-python missing or the driver call failed: torch's view stands
        info["identity_error"] = f"{type(exc).__name__}: {exc}"
    return info


def device_memory(device: torch.device) -> dict[str, int]:
    """Bytes in use by this process's tensors, reserved by its caching allocator, and free on the device."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "allocated_bytes": torch.cuda.memory_allocated(device),
        "reserved_bytes": torch.cuda.memory_reserved(device),
        "free_bytes": free,
        "total_bytes": total,
    }
