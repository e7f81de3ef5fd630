"""Where a run's numbers come from: the code's commit, the exact model files, the machine and the settings."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime


def git_commit(repo: str = ".") -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def model_hash(path: str) -> dict:
    """sha256 of a model file, or of a directory as the sorted (relative path, file sha256) lines of its visible files."""
    if os.path.isfile(path):
        return {"path": path, "sha256": file_sha256(path), "bytes": os.path.getsize(path)}
    lines, total = [], 0
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            full = os.path.join(root, name)
            total += os.path.getsize(full)
            lines.append(f"{os.path.relpath(full, path)} {file_sha256(full)}\n")
    return {"path": path, "sha256": hashlib.sha256("".join(lines).encode()).hexdigest(), "bytes": total, "files": len(lines)}


def machine() -> dict:
    cpu_model, flags = platform.processor() or None, []  # /proc/cpuinfo names the CPU where it exists
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    cpu_model = value.strip()
                if key.strip() == "flags":
                    flags = value.split()
                    break
    except OSError:
        pass
    memory_gib = None
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        pass
    return {
        "cpu_model": cpu_model,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "simd": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))),
        "memory_gib": round(memory_gib, 1) if memory_gib else None,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "hostname": platform.node(),
        "python": sys.version.split()[0],
    }


def provenance(models: dict[str, str], settings: dict, repo: str = ".") -> dict:
    return {
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_commit(repo),
        "models": {name: model_hash(path) for name, path in models.items()},
        "machine": machine(),
        "settings": settings,
        "argv": sys.argv,
    }
