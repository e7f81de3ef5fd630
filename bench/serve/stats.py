"""What a level's records add up to: latency distributions, throughput, completeness, and ratios between endpoints.

Only measured requests that succeeded enter the latency and throughput figures; every failed request or
token count that is off is counted and named, and makes the run incomplete.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bench.serve.client import RequestRecord

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 (linear interpolation between order statistics, numpy's default); None when empty."""
    if len(values) == 0:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}, "count": 0}
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()), **{f"p{q}": float(np.percentile(array, q)) for q in PERCENTILES}, "count": int(array.size)}


def level_summary(records: Sequence[RequestRecord]) -> dict:
    """One endpoint at one level: request counts, problems, latency distributions and throughput."""
    warmup = [r for r in records if r.phase == "warmup"]
    measured = [r for r in records if r.phase == "measured"]
    good = [r for r in measured if r.ok]
    problems = [f"{r.phase} request {r.index}: {r.error}" for r in records if not r.ok]
    problems += [f"{r.phase} request {r.index}: {r.count_problem}" for r in records if r.ok and r.count_problem]
    output_tokens = sum(r.completion_tokens or 0 for r in good)
    # A level measured in interleaved rounds ran only during its rounds: the duration is their sum, each
    # from its first send to its last stream's end (one round: the level's whole span).
    duration = 0.0
    for round_index in {r.round for r in good}:
        in_round = [r for r in good if r.round == round_index]
        duration += max(r.start_s + (r.end_s or 0.0) for r in in_round) - min(r.start_s for r in in_round)
    chunks = sum(len(r.chunk_offsets_s) for r in good)
    return {
        "requests": {
            "warmup": len(warmup),
            "measured": len(measured),
            "succeeded": len(good),
            "failed": sum(not r.ok for r in records),
            "count_off": sum(r.ok and r.count_problem is not None for r in records),
        },
        "problems": problems,
        "duration_s": duration,
        "rounds": len({r.round for r in measured}),
        "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in good),
        "request_throughput": len(good) / duration if duration > 0 else None,
        "output_throughput": output_tokens / duration if duration > 0 else None,
        "chunks_per_token": chunks / output_tokens if output_tokens else None,
        "ttft_s": distribution([r.ttft_s for r in good if r.ttft_s is not None]),
        "tpot_s": distribution([r.tpot_s for r in good if r.tpot_s is not None]),
        "itl_s": distribution([gap for r in good for gap in r.itl_s]),
        "e2e_s": distribution([r.end_s for r in good if r.end_s is not None]),
    }


def is_complete(summary: dict) -> bool:
    return not summary["problems"]


RATIO_FIGURES = {
    "output_throughput": ("output_throughput",),
    "request_throughput": ("request_throughput",),
    "ttft_p50": ("ttft_s", "p50"),
    "ttft_p99": ("ttft_s", "p99"),
    "tpot_p50": ("tpot_s", "p50"),
    "itl_p50": ("itl_s", "p50"),
    "itl_p99": ("itl_s", "p99"),
    "e2e_p50": ("e2e_s", "p50"),
}


def _figure(summary: dict, path: tuple[str, ...]) -> float | None:
    value = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def ratios(numerator: dict, denominator: dict) -> dict[str, float | None]:
    """numerator / denominator for each headline figure (throughput: higher is better; latency: lower is)."""
    out: dict[str, float | None] = {}
    for name, path in RATIO_FIGURES.items():
        a, b = _figure(numerator, path), _figure(denominator, path)
        out[name] = a / b if a is not None and b else None
    return out
