"""A frozen workload manifest: the prompt set (pinned by its sha256), output length, sampling and ignore_eos.

A manifest is JSON under bench/workloads/. The digest covers the prompts in their canonical JSON form, so a
changed, added or reordered prompt is refused before any request is sent. ``python -m bench.serve.workload
PATH`` prints the digest of a manifest's prompts (to freeze a new one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

APIS = ("chat", "completions")


class WorkloadError(ValueError):
    """The manifest is malformed or its prompts do not match their recorded sha256."""


def prompts_sha256(prompts: list[str]) -> str:
    canonical = json.dumps(prompts, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Workload:
    name: str
    path: str
    prompts: list[str]
    sha256: str
    output_tokens: int
    ignore_eos: bool
    api: str = "chat"
    sampling: dict[str, Any] = field(default_factory=dict)  # extra body fields such as temperature, top_p, seed

    def prompt(self, index: int) -> str:
        """The prompt of the index-th request of a level (the set is cycled in order)."""
        return self.prompts[index % len(self.prompts)]

    def describe(self) -> dict:
        return {
            "name": self.name,
            "path": self.path,
            "sha256": self.sha256,
            "num_prompts": len(self.prompts),
            "output_tokens": self.output_tokens,
            "ignore_eos": self.ignore_eos,
            "api": self.api,
            "sampling": self.sampling,
        }


def _field(raw: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in raw:
        raise WorkloadError(f"workload manifest: missing field '{name}'")
    value = raw[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WorkloadError(f"workload manifest: field '{name}' has the wrong type ({type(value).__name__})")
    return value


def load_workload(path: str) -> Workload:
    """Reads and verifies a manifest; raises WorkloadError naming the field or the digest that is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"workload manifest {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise WorkloadError("workload manifest: the top level must be an object")
    prompts = _field(raw, "prompts", list)
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise WorkloadError("workload manifest: field 'prompts' must be a non-empty list of non-empty strings")
    recorded = _field(raw, "prompts_sha256", str)
    actual = prompts_sha256(prompts)
    if recorded != actual:
        raise WorkloadError(f"workload manifest: 'prompts_sha256' is {recorded} but the prompts hash to {actual}")
    output_tokens = _field(raw, "output_tokens", int)
    if output_tokens < 1:
        raise WorkloadError("workload manifest: field 'output_tokens' must be at least 1")
    api = raw.get("api", "chat")
    if api not in APIS:
        raise WorkloadError(f"workload manifest: field 'api' must be one of {APIS}")
    sampling = raw.get("sampling", {})
    if not isinstance(sampling, dict):
        raise WorkloadError("workload manifest: field 'sampling' must be an object")
    reserved = {"model", "messages", "prompt", "max_tokens", "stream", "stream_options", "ignore_eos"} & sampling.keys()
    if reserved:
        raise WorkloadError(f"workload manifest: field 'sampling' may not set {sorted(reserved)}")
    return Workload(
        name=_field(raw, "name", str),
        path=path,
        prompts=prompts,
        sha256=actual,
        output_tokens=output_tokens,
        ignore_eos=_field(raw, "ignore_eos", bool),
        api=api,
        sampling=sampling,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.serve.workload", description="print the sha256 of each manifest's prompts (to freeze a new one)")
    parser.add_argument("manifests", nargs="+", metavar="MANIFEST")
    for manifest in parser.parse_args().manifests:
        with open(manifest, encoding="utf-8") as f:
            print(prompts_sha256(json.load(f)["prompts"]), manifest)
