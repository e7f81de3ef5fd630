"""bench.serve's arithmetic and checks without a server: percentiles, per-request latencies, count checks,
level summaries, ratios and the workload manifest's verification."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from bench.serve.client import RequestRecord
from bench.serve.provenance import model_hash
from bench.serve.stats import distribution, level_summary, ratios
from bench.serve.workload import WorkloadError, load_workload, prompts_sha256

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def record(
    phase: str = "measured", index: int = 0, offsets=(0.1, 0.3, 0.6), end: float | None = 0.7, tokens: int | None = 5, expected: int = 5, **kw
) -> RequestRecord:
    r = RequestRecord("ep", {"mode": "concurrency", "value": 1}, phase, index, index, expected, kw.pop("ignore_eos", True), **kw)
    r.chunk_offsets_s, r.chunk_chars, r.end_s, r.completion_tokens = list(offsets), [3] * len(offsets), end, tokens
    return r


def test_distribution_uses_linear_interpolation_between_order_statistics():
    d = distribution([4.0, 1.0, 3.0, 2.0])
    assert d["mean"] == pytest.approx(2.5)
    assert d["p50"] == pytest.approx(2.5)
    assert d["p90"] == pytest.approx(3.7)  # 1 + 0.9 * 3 = position 2.7 between 3 and 4
    assert d["p99"] == pytest.approx(3.97)
    assert d["count"] == 4
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "count": 0}


def test_request_latencies_come_from_chunk_times_and_usage():
    r = record(offsets=(0.1, 0.3, 0.6), end=0.7, tokens=5)
    assert r.ttft_s == pytest.approx(0.1)
    assert r.itl_s == pytest.approx([0.2, 0.3])
    assert r.tpot_s == pytest.approx((0.7 - 0.1) / 4)  # over tokens from usage, not over the 3 chunks
    assert record(tokens=1).tpot_s is None


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"tokens": 5, "expected": 5}, None),
        ({"tokens": 3, "expected": 5}, "3 tokens, 5 asked with ignore_eos"),
        ({"tokens": None}, "no usage reported"),
        ({"tokens": 3, "expected": 5, "ignore_eos": False}, None),  # an early EOS is allowed without ignore_eos
        ({"tokens": 6, "expected": 5, "ignore_eos": False}, "6 tokens, more than max_tokens 5"),
        ({"tokens": 5, "offsets": ()}, "5 tokens reported but no text streamed"),
    ],
)
def test_count_problems_are_named(kwargs, problem):
    assert record(**kwargs).count_problem == problem


def test_level_summary_counts_only_measured_successes_and_names_every_problem():
    warm = record("warmup", 0)
    good = [record(index=i) for i in range(3)]
    for i, r in enumerate(good):
        r.start_s = 1.0 + i  # ends at 1.7, 2.7, 3.7
    failed = record(index=3, tokens=None, error="HTTP 500: boom")
    short = record(index=4, tokens=4)
    short.start_s = 1.5
    s = level_summary([warm, *good, failed, short])
    assert s["requests"] == {"warmup": 1, "measured": 5, "succeeded": 4, "failed": 1, "count_off": 1}
    assert s["problems"] == ["measured request 3: HTTP 500: boom", "measured request 4: 4 tokens, 5 asked with ignore_eos"]
    assert s["output_tokens"] == 5 * 3 + 4
    assert s["duration_s"] == pytest.approx(3.7 - 1.0)
    assert s["output_throughput"] == pytest.approx(19 / 2.7)
    assert s["request_throughput"] == pytest.approx(4 / 2.7)
    assert s["ttft_s"]["count"] == 4 and s["itl_s"]["count"] == 8
    assert s["chunks_per_token"] == pytest.approx(12 / 19)


def test_a_level_with_no_success_has_no_figures_rather_than_zeros():
    s = level_summary([record(error="timeout", tokens=None)])
    assert s["output_throughput"] is None and s["ttft_s"]["p50"] is None
    assert s["problems"] == ["measured request 0: timeout"]


def test_ratios_divide_the_first_endpoint_by_the_second():
    fast = level_summary([record(offsets=(0.1, 0.2), end=0.3)])
    slow = level_summary([record(offsets=(0.2, 0.4), end=0.6)])
    r = ratios(fast, slow)
    assert r["output_throughput"] == pytest.approx(2.0)
    assert r["ttft_p50"] == pytest.approx(0.5)
    assert r["e2e_p50"] == pytest.approx(0.5)
    assert ratios(fast, level_summary([]))["output_throughput"] is None


def test_the_committed_workloads_verify():
    workloads = os.path.join(REPO, "bench", "workloads")
    names = sorted(n for n in os.listdir(workloads) if n.endswith(".json"))
    assert names
    for name in names:
        w = load_workload(os.path.join(workloads, name))
        assert w.sha256 == hashlib.sha256(json.dumps(w.prompts, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def _write(tmp_path, manifest: dict) -> str:
    path = tmp_path / "w.json"
    path.write_text(json.dumps(manifest))
    return str(path)


def _manifest(**overrides) -> dict:
    prompts = ["one", "two"]
    return {"name": "t", "prompts": prompts, "prompts_sha256": prompts_sha256(prompts), "output_tokens": 4, "ignore_eos": True, **overrides}


def test_a_changed_prompt_fails_the_digest(tmp_path):
    manifest = _manifest()
    manifest["prompts"][1] = "two!"
    with pytest.raises(WorkloadError, match="prompts_sha256"):
        load_workload(_write(tmp_path, manifest))


def test_reordered_prompts_fail_the_digest(tmp_path):
    manifest = _manifest()
    manifest["prompts"].reverse()
    with pytest.raises(WorkloadError, match="prompts_sha256"):
        load_workload(_write(tmp_path, manifest))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"output_tokens": "4"}, "output_tokens"),
        ({"output_tokens": 0}, "output_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"api": "embeddings"}, "api"),
        ({"sampling": {"max_tokens": 9}}, "sampling"),
        ({"prompts": []}, "prompts"),
    ],
)
def test_a_bad_manifest_field_is_named(tmp_path, overrides, field):
    with pytest.raises(WorkloadError, match=field):
        load_workload(_write(tmp_path, _manifest(**overrides)))


def test_a_missing_field_is_named(tmp_path):
    manifest = _manifest()
    del manifest["output_tokens"]
    with pytest.raises(WorkloadError, match="missing field 'output_tokens'"):
        load_workload(_write(tmp_path, manifest))


def test_model_hash_covers_every_file_and_its_name(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / ".complete").write_text("marker")  # hidden files are bookkeeping, not the model
    first = model_hash(str(tmp_path))
    assert first["files"] == 2 and first["bytes"] == 9
    (tmp_path / "a.bin").write_bytes(b"weightz")
    assert model_hash(str(tmp_path))["sha256"] != first["sha256"]
    assert model_hash(str(tmp_path / "a.bin"))["sha256"] == hashlib.sha256(b"weightz").hexdigest()
