"""C++ kernels for the CPU worker (``services/worker/csrc``), compiled on first use by the machine that
runs them, into a build directory of the installation keyed by what goes into the build.

``build_extension`` keys a build by a hash of its sources and headers, the compile and link flags, the
compiler and the torch and Python it builds against, and builds into ``<sys.prefix>/share/tokenyard/cpu-kernels/
<name>-<key>/`` (under torch's extensions directory where the installation is read-only), from a copy of the
sources taken there, as a module named ``<name>_<key>``: identical sources share one build, different ones
(two checkouts, a checkout and a pip install) never rebuild each other's, and two builds can coexist in one
process. A failed build raises ``KernelBuildError``, one line naming the first compiler error and the full log.

The ISA flags come from what this machine's /proc/cpuinfo lists (AVX2 + FMA + F16C, and AVX-512 VNNI, when present), never
``-march=native``, which may pick instructions a virtual machine advertises but does not execute.
Without a compiler (or with ``TOKENYARD_CPU_KERNELS=0``) the worker keeps its torch paths, and the
reason is reported in ``/instrumentation``.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from types import ModuleType

import structlog

log = structlog.get_logger()

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "bindings.cpp",
        "paged_decode_attention.cpp",
        "kv_store.cpp",
        "int8_linear.cpp",
        "block_quant_gemm.cpp",
        "grouped_moe.cpp",
        "decoder_fusions.cpp",
        "direct_reads.cpp",
        "decoder_layers.cpp",
        "expert_bank.cpp",
        "sample_rows.cpp",
    )
]
HEADERS = sorted(CSRC.glob("*.h"))  # included by the sources; part of the key, and copied beside them
COMPLETE = ".complete"  # written into a build directory once its module has built and loaded
KEEP_BUILDS = 4  # of one extension name in a root, the most recently used; older ones are removed
_COMPILER_ERROR = re.compile(r"^\S+?:\d+(?::\d+)?: (?:fatal )?error: ")


class KernelBuildError(RuntimeError):
    """A build that failed; the message is one line: the first compiler error, then where the full log is."""


def isa_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The compiler's ISA flags for the CPU that ``cpuinfo`` describes (its first ``flags`` line): AVX2 + FMA + F16C
    where it lists them all, AVX-512 VNNI beside them where it lists that too; none otherwise (portable loops)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    if not {"avx2", "fma", "f16c"} <= set(flags):
        return []
    # AVX-512 VNNI (on 256-bit vectors) for the integer block products of block_quant_gemm.cpp.
    vnni = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"] if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags) else []
    return ["-mavx2", "-mfma", "-mf16c", *vnni]


INSTALLATION_ROOT = Path(sys.prefix) / "share" / "tokenyard" / "cpu-kernels"


def default_root() -> Path:
    """Where this installation keeps its builds: beside its interpreter's packages, or torch's extensions directory."""
    existing = next(p for p in (INSTALLATION_ROOT, *INSTALLATION_ROOT.parents) if p.exists())
    if os.access(existing, os.W_OK):
        return INSTALLATION_ROOT
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / "tokenyard"


def build_key(sources: Sequence[Path], headers: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """16 hex digits of a hash of everything that goes into the build; the torch and Python paths too, so
    that two installations sharing one root never rewrite each other's build file."""
    import torch

    digest = hashlib.sha256()
    for path in [*sources, *headers]:
        digest.update(f"{path.name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\0".encode())
    context = [*cflags, "|", *ldflags, "|", os.environ.get("CXX", "c++"), torch.__version__, os.path.dirname(torch.__file__)]
    context += [sys.implementation.cache_tag, getattr(sys, "abiflags", ""), sysconfig.get_paths()["include"]]
    digest.update("\0".join(context).encode())
    return digest.hexdigest()[:16]


def build_extension(
    name: str,
    sources: Sequence[Path],
    headers: Sequence[Path] = (),
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
    root: Path | None = None,
) -> ModuleType:
    """The extension built from ``sources`` (``headers`` are what they include by a bare name) as module
    ``<name>_<key>``, built in ``<root>/<name>-<key>`` unless a build with that key is already there."""
    from torch.utils import cpp_extension

    if len({p.name for p in [*sources, *headers]}) != len(sources) + len(headers):
        raise ValueError("build_extension copies the sources into one directory: their names must differ")
    key = build_key(sources, headers, cflags, ldflags)
    for built in [root] if root else [INSTALLATION_ROOT, default_root()]:  # an image's read-only installation holds its build
        if (built / f"{name}-{key}" / COMPLETE).exists():
            with suppress(OSError):  # its last use, which pruning reads; a read-only one is never pruned
                os.utime(built / f"{name}-{key}" / ".lock")
            return _import_built(built / f"{name}-{key}", f"{name}_{key}")
    root = root or default_root()
    build_dir = root / f"{name}-{key}"
    src_dir = build_dir / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    with _locked(build_dir):
        for path in [*sources, *headers]:
            if not (src_dir / path.name).exists():  # copied once: a later load leaves it (and ninja's view of it) as it is
                shutil.copyfile(path, src_dir / f".{path.name}.tmp")
                os.replace(src_dir / f".{path.name}.tmp", src_dir / path.name)
        (build_dir / "lock").unlink(missing_ok=True)  # torch's own lock, left by a build that was killed: ours is held
        try:
            module = cpp_extension.load(
                name=f"{name}_{key}",
                sources=[str(src_dir / p.name) for p in sources],
                extra_cflags=list(cflags),
                extra_ldflags=list(ldflags),
                build_directory=str(build_dir),
                verbose=False,
            )
        except Exception as exc:
            output = re.split(r"^Error building extension '[^']*': ", str(exc), maxsplit=1)[-1]
            if output == str(exc):  # not the compiler's output: no compiler, no ninja, a module that fails to load
                raise
            (build_dir / "build.log").write_text(output)
            first = first_error(output)
            for path in [*sources, *headers]:
                first = first.replace(str(src_dir / path.name), str(path))
            raise KernelBuildError(f"{first} (full log: {build_dir / 'build.log'})") from None
        (build_dir / COMPLETE).touch()
    _prune(root, name, keep=KEEP_BUILDS)
    return module


def _import_built(build_dir: Path, module_name: str) -> ModuleType:
    """A finished build's module, loaded as it is: no lock, no ninja, nothing written (the directory may be read-only)."""
    import torch  # noqa: F401 - the extension links against torch's libraries, loaded with it

    spec = importlib.util.spec_from_file_location(module_name, build_dir / f"{module_name}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_error(output: str) -> str:
    """The first compiler error of a build's output (``file:line:col: error: ...``), else its first line
    that reads as an error (a missing compiler, an undefined reference), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    plain = [line for line in lines if not line.startswith(("[", "FAILED:", "ninja: ")) and " -o " not in line]
    return (
        next((line for line in lines if _COMPILER_ERROR.match(line)), None)
        or next((line for line in plain if re.search(r"error|not found|undefined reference", line, re.IGNORECASE)), None)
        or (lines[-1] if lines else "the build failed without output")
    )


@contextmanager
def _locked(build_dir: Path) -> Iterator[None]:
    """One process builds a key at a time; the others wait, then find it built. Its mtime is the last use."""
    with open(build_dir / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.utime(lock.fileno())
        yield


def _prune(root: Path, name: str, keep: int) -> None:
    """Removes all but the ``keep`` most recently used builds of ``name``, skipping any in use by a build."""
    used = {}
    for lock_path in root.glob(f"{name}-*/.lock"):
        with suppress(FileNotFoundError):  # another process pruned it
            used[lock_path] = lock_path.stat().st_mtime
    for lock_path in sorted(used, key=used.get, reverse=True)[keep:]:
        with suppress(FileNotFoundError, BlockingIOError), open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(lock_path.parent, ignore_errors=True)


@functools.cache
def cpu_kernels() -> tuple[ModuleType | None, str]:
    """``(module, "")`` once built, or ``(None, why not)``; built at most once per process."""
    if os.environ.get("TOKENYARD_CPU_KERNELS", "1") == "0":
        return None, "disabled by TOKENYARD_CPU_KERNELS=0"
    if shutil.which("ninja") is None:  # the pip-installed ninja sits beside this interpreter
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        # -fopenmp: at::parallel_for's OpenMP loop is inlined from the headers; without it, one thread.
        module = build_extension("tokenyard_cpu_kernels", SOURCES, HEADERS, cflags=["-O3", "-fopenmp", *isa_flags()], ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch paths still work
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"  # a KernelBuildError is one line
        log.warning("cpu_kernels_unavailable", why=why)
        return None, why
    return module, ""


if __name__ == "__main__":  # `make setup` builds them ahead of the first worker start
    built, reason = cpu_kernels()
    print("tokenyard CPU kernels:", "built" if built is not None else f"unavailable ({reason}); the worker will use its torch paths")
