"""What a speculating stack's workers verified during a level: their counters (vLLM's names under ``tokenyard:``)
read before and after the level's measured requests, and the acceptance rate between them."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")  # tokenyard:spec_decode_num_<name>_total


def read_counters(metrics_urls: list[str], timeout_s: float = 5.0) -> dict[str, float] | None:
    """The speculation counters summed over the workers at ``metrics_urls``; None where a worker does not answer
    or does not speculate."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for url in metrics_urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                text = response.read().decode()
        except OSError:
            return None
        samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
        for name in COUNTERS:
            value = samples.get(f"tokenyard:spec_decode_num_{name}_total")
            if value is None:
                return None
            totals[name] += value
    return totals


def acceptance(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """The level's verifies: drafts, draft tokens, accepted tokens, the share of draft tokens accepted and the
    accepted tokens per draft; None without both readings or without a draft."""
    if before is None or after is None:
        return None
    counts = {name: after[name] - before[name] for name in COUNTERS}
    if counts["drafts"] <= 0 or counts["draft_tokens"] <= 0:
        return None
    return {
        **counts,
        "acceptance_rate": counts["accepted_tokens"] / counts["draft_tokens"],
        "accepted_per_draft": counts["accepted_tokens"] / counts["drafts"],
    }
