"""C++ kernels for the CPU worker (``services/worker/csrc``), compiled on first use by the machine that
runs them and cached by torch (``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``).

The ISA flags come from what this machine's /proc/cpuinfo lists (AVX2 + FMA + F16C, and AVX-512 VNNI, when present), never
``-march=native``, which may pick instructions a virtual machine advertises but does not execute.
Without a compiler (or with ``TOKENYARD_CPU_KERNELS=0``) the worker keeps its torch paths, and the
reason is reported in ``/instrumentation``.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import structlog

log = structlog.get_logger()

SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "bindings.cpp",
        "paged_decode_attention.cpp",
        "kv_store.cpp",
        "int8_linear.cpp",
        "block_quant_gemm.cpp",
        "decoder_fusions.cpp",
        "dense_decoder.cpp",
        "sample_rows.cpp",
    )
]
# csrc/*.h are included by these; ninja's dependency files rebuild the module when one changes.


def _isa_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    if not {"avx2", "fma", "f16c"} <= set(flags):
        return []
    # AVX-512 VNNI (on 256-bit vectors) for the integer block products of block_quant_gemm.cpp.
    vnni = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"] if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags) else []
    return ["-mavx2", "-mfma", "-mf16c", *vnni]


@functools.cache
def cpu_kernels() -> tuple[ModuleType | None, str]:
    """``(module, "")`` once built, or ``(None, why not)``; built at most once per process."""
    if os.environ.get("TOKENYARD_CPU_KERNELS", "1") == "0":
        return None, "disabled by TOKENYARD_CPU_KERNELS=0"
    if shutil.which("ninja") is None:  # the pip-installed ninja sits beside this interpreter
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        from torch.utils import cpp_extension

        module = cpp_extension.load(
            name="tokenyard_cpu_kernels",
            sources=[str(s) for s in SOURCES],
            # -fopenmp: at::parallel_for's OpenMP loop is inlined from the headers; without it, one thread.
            extra_cflags=["-O3", "-fopenmp", *_isa_flags()],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch paths still work
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        log.warning("cpu_kernels_unavailable", why=why)
        return None, why
    return module, ""


if __name__ == "__main__":  # `make setup` builds them ahead of the first worker start
    built, reason = cpu_kernels()
    print("tokenyard CPU kernels:", "built" if built is not None else f"unavailable ({reason}); the worker will use its torch paths")
