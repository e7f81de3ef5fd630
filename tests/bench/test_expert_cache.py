"""bench.expert_cache on the tiny MoE shape: every cache size under each policy decodes the all-resident run's tokens,
a smaller cache reads more expert bytes per token, and the storage bandwidth that the bound divides by is measured."""

from __future__ import annotations

import json

import pytest

from bench.expert_cache import main
from services.worker.cpu_kernels import cpu_kernels


@pytest.mark.skipif(cpu_kernels()[0] is None, reason=f"CPU kernels unavailable: {cpu_kernels()[1]}")
def test_the_bench_reports_each_cache_size_and_policy_against_all_resident(tmp_path) -> None:
    out = tmp_path / "expert_cache.json"
    main(["--shape", "tiny", "--rounds", "1", "--max-tokens", "4", "--policy", "lru", "lfu", "--cache-dir", str(tmp_path / "store"), "--out", str(out)])
    summary = json.loads(out.read_text())["uniform"]
    rows = {(row["concurrency"], row["cache_percent"], row["policy"]): row for row in summary["rows"]}
    assert set(rows) == {(c, 0, "") for c in (1, 8)} | {(c, p, policy) for c in (1, 8) for p in (100, 50, 25, 12.5) for policy in ("lru", "lfu")}
    assert all(row["same_tokens_as_resident"] for row in rows.values())
    assert all(rows[(c, 0, "")]["bytes_read_per_token"] == 0 and rows[(c, 0, "")]["hit_rate"] is None for c in (1, 8))
    for policy in ("lru", "lfu"):
        assert rows[(1, 12.5, policy)]["hit_rate"] == 0  # one layer's top-k slots shared by two layers: every step misses
        assert rows[(1, 12.5, policy)]["bytes_read_per_token"] > rows[(1, 100, policy)]["bytes_read_per_token"]
    assert summary["bandwidth"]["sequential_bytes_per_s"] > 0
    assert all(row["bound_ms"] >= rows[(row["concurrency"], 0, "")]["step_ms"] for row in rows.values())
    assert all(len(row["step_over_bound_by_round"]) == 1 and row["step_over_bound_by_round"][0] > 0 for row in rows.values())  # one per round
    assert rows[(1, 0, "")]["step_over_bound_by_round"] == [1.0]  # all resident: its own bound
