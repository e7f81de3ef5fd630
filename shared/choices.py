"""The names a setting chooses among, for the registries that live in services.

``shared/config.py`` reads its choices from here, and each registry in services is keyed by the
same names (``keyed_by`` refuses one that is not), so a name is defined once without the
configuration importing the registries (some import torch or aiohttp; ``shared`` imports no service).
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # services/worker/runner.py: DTYPES
WEIGHT_QUANTS = ("auto", "none", "fp16", "int8", "int4", "int4-a8")  # services/worker/linear.py
DEVICES = ("auto", "cpu", "cuda")  # services/worker/device.py
ROUTER_POLICY_NAMES = ("load", "prefix", "round_robin")  # services/api/router.py: POLICIES
EXPERT_CACHE_POLICIES = ("lru", "lfu")  # services/worker/expert_cache.py: POLICIES
EXPERT_CACHE_FILLS = ("auto", "on-demand", "streamed")  # services/worker/expert_cache.py: ExpertCache.fill_mode
EXPERT_CACHE_PREFETCH = ("on", "off")  # services/worker/expert_cache.py: ExpertCache.prefetch
EXPERT_CACHE_CPU_EXPERTS = ("auto", "off")  # services/worker/device_expert_cache.py: CoExecution
TOOL_PARSER_NAMES = ("hermes", "qwen3_coder", "llama3_json")  # services/api/tool_parsers.py: TOOL_PARSERS
REASONING_PARSER_NAMES = ("think",)  # services/api/reasoning.py: REASONING_PARSERS
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("auto", "json", "console")  # shared/logging.py


def keyed_by(names: tuple[str, ...], registry: dict[str, T]) -> dict[str, T]:
    """``registry``, refused unless its keys are ``names`` in their order."""
    if tuple(registry) != names:
        raise ValueError(f"a registry keyed {tuple(registry)} must be keyed {names}, the names in shared/choices.py")
    return registry
