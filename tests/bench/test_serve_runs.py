"""bench.serve end to end against in-process fake OpenAI servers: what it sends, what it writes, and how a run
with a failed request or a short token count labels itself. Nothing here depends on how fast anything ran."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import sys

import pytest

from bench.serve.cli import _endpoints, build_parser, main
from bench.serve.endpoints import StackEndpoint
from bench.serve.peer import llama_server_command
from bench.serve.speculation import acceptance, read_counters
from bench.serve.workload import prompts_sha256
from tests.bench.fake_openai import FakeBehaviour, FakeOpenAI

PROMPTS = ["alpha", "beta", "gamma"]
OUTPUT_TOKENS = 6


@pytest.fixture
def workload(tmp_path):
    def write(**overrides) -> str:
        manifest = {
            "name": "tiny",
            "prompts": PROMPTS,
            "prompts_sha256": prompts_sha256(PROMPTS),
            "output_tokens": OUTPUT_TOKENS,
            "ignore_eos": True,
            "sampling": {"temperature": 0},
            **overrides,
        }
        path = tmp_path / f"workload-{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(manifest))
        return str(path)

    return write


def run(tmp_path, *args: str) -> tuple[int, dict, list[dict]]:
    out = tmp_path / "out"
    code = main([*args, "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return code, summary, rows


def test_a_clean_run_writes_every_request_a_summary_and_a_plot(tmp_path, workload):
    with FakeOpenAI(FakeBehaviour(tokens_per_chunk=2)) as server:
        code, summary, rows = run(
            tmp_path, "--workload", workload(), "--endpoint", f"fake={server.url}", "--concurrency", "1", "3", "--num-requests", "4", "--warmup-requests", "2"
        )
    assert code == 0
    assert summary["complete"] is True and summary["incomplete_reasons"] == []
    assert [r["label"] for r in summary["results"]] == ["c=1", "c=3"]
    for result in summary["results"]:
        s = result["summary"]
        assert s["requests"] == {"warmup": 2, "measured": 4, "succeeded": 4, "failed": 0, "count_off": 0}
        assert s["output_tokens"] == 4 * OUTPUT_TOKENS  # counted from usage, not from the 3 chunks per request
        assert s["chunks_per_token"] == pytest.approx(0.5)
        for latency in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert set(s[latency]) == {"mean", "p50", "p90", "p99", "count"}
            assert s[latency]["p50"] is not None
        assert s["itl_s"]["count"] == 4 * 2  # three chunks per request: two gaps
    assert len(rows) == 2 * (2 + 4)
    assert [r["phase"] for r in rows[:6]] == ["warmup"] * 2 + ["measured"] * 4
    for row in rows:
        assert row["ok"] and row["count_problem"] is None and row["completion_tokens"] == OUTPUT_TOKENS
        assert len(row["chunk_offsets_s"]) == 3 and row["chunk_offsets_s"] == sorted(row["chunk_offsets_s"])
        assert row["end_s"] >= row["chunk_offsets_s"][-1]
    # every request asked for what the manifest froze, with usage in the stream
    assert len(server.bodies) == 12
    for path, body in server.bodies:
        assert path == "/v1/chat/completions"
        assert body["max_tokens"] == OUTPUT_TOKENS and body["ignore_eos"] is True and body["temperature"] == 0
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "fake-model"
    # prompts cycle in order from the first warm-up, the same at every level
    assert [r["prompt_index"] for r in rows if r["level"]["value"] == 1] == [0, 1, 2, 0, 1, 2]
    assert (tmp_path / "out" / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    prov = summary["provenance"]
    assert len(prov["git"]["commit"]) == 40
    assert prov["machine"]["cores"] >= 1 and prov["machine"]["cpu_model"]
    assert summary["workload"]["sha256"] == prompts_sha256(PROMPTS)


def test_a_failed_request_and_a_short_count_make_the_run_incomplete(tmp_path, workload):
    behaviour = FakeBehaviour(http_error_on={2}, short_on={4}, stream_error_on={5})
    with FakeOpenAI(behaviour) as server:
        code, summary, rows = run(
            tmp_path, "--workload", workload(), "--endpoint", f"fake={server.url}", "--concurrency", "1", "--num-requests", "6", "--warmup-requests", "1"
        )
    assert code == 1
    assert summary["complete"] is False
    s = summary["results"][0]["summary"]
    assert s["requests"] == {"warmup": 1, "measured": 6, "succeeded": 4, "failed": 2, "count_off": 1}
    reasons = "\n".join(summary["incomplete_reasons"])
    assert "measured request 1: HTTP 500" in reasons  # arrival 2 is measured request 1 after one warm-up
    assert f"measured request 3: {OUTPUT_TOKENS - 2} tokens, {OUTPUT_TOKENS} asked with ignore_eos" in reasons
    assert "measured request 4: stream error" in reasons
    assert [r["ok"] for r in rows] == [True, True, False, True, True, False, True]
    # the short request's tokens are counted as served (it succeeded), the failed ones are not
    assert s["output_tokens"] == 3 * OUTPUT_TOKENS + (OUTPUT_TOKENS - 2)


def test_a_stream_without_done_or_usage_is_not_trusted(tmp_path, workload):
    with FakeOpenAI(FakeBehaviour(no_done_on={0}, usage=False)) as server:
        code, summary, rows = run(tmp_path, "--workload", workload(), "--endpoint", f"fake={server.url}", "--num-requests", "2", "--warmup-requests", "0")
    assert code == 1
    assert rows[0]["error"] == "the stream ended without [DONE]"
    assert rows[1]["ok"] and rows[1]["count_problem"] == "no usage reported"


def test_two_endpoints_alternate_per_level_and_get_ratios(tmp_path, workload):
    with FakeOpenAI(model="a") as first, FakeOpenAI(model="b") as second:
        code, summary, rows = run(
            tmp_path,
            *("--workload", workload(), "--endpoint", f"ours={first.url}", "--endpoint", f"peer={second.url}"),
            *("--concurrency", "1", "2", "4", "--num-requests", "2", "--warmup-requests", "1"),
        )
    assert code == 0
    assert [(r["endpoint"], r["label"]) for r in summary["results"]] == [
        ("ours", "c=1"), ("peer", "c=1"), ("peer", "c=2"), ("ours", "c=2"), ("ours", "c=4"), ("peer", "c=4"),
    ]  # fmt: skip
    assert [(r["numerator"], r["denominator"], r["label"]) for r in summary["ratios"]] == [("ours", "peer", f"c={c}") for c in (1, 2, 4)]
    for row in summary["ratios"]:
        assert set(row["ratios"]) >= {"output_throughput", "ttft_p99", "itl_p50", "tpot_p50"}
        assert all(value is not None and value > 0 for value in row["ratios"].values())
    assert len(first.bodies) == len(second.bodies) == 3 * 3
    assert {body["model"] for _, body in first.bodies} == {"a"}
    # both endpoints saw the same prompts in the same order
    assert [b["messages"] for _, b in first.bodies[:3]] == [b["messages"] for _, b in second.bodies[:3]]


def test_rounds_interleave_the_endpoints_and_time_only_their_own_rounds(tmp_path, workload):
    """--rounds 3 over 5 measured requests: rounds of 2, 2 and 1, the endpoints taking turns (the first of
    a round goes last in the next); prompts as in one round; each endpoint's throughput counts the time of
    its own rounds, not the other endpoint's."""
    with FakeOpenAI() as first, FakeOpenAI() as second:
        code, summary, rows = run(
            tmp_path,
            *("--workload", workload(), "--endpoint", f"ours={first.url}", "--endpoint", f"peer={second.url}"),
            *("--concurrency", "1", "--num-requests", "5", "--warmup-requests", "1", "--rounds", "3"),
        )
    assert code == 0 and summary["complete"] is True
    assert summary["provenance"]["settings"]["rounds"] == 3
    measured = [r for r in rows if r["phase"] == "measured"]
    turns = []  # (endpoint, round) in the order the rounds were sent
    for row in sorted(measured, key=lambda r: r["start_s"]):
        if not turns or turns[-1] != (row["endpoint"], row["round"]):
            turns.append((row["endpoint"], row["round"]))
    assert turns == [("ours", 0), ("peer", 0), ("peer", 1), ("ours", 1), ("ours", 2), ("peer", 2)]
    for name in ("ours", "peer"):
        mine = [r for r in measured if r["endpoint"] == name]
        assert [(r["index"], r["round"], r["prompt_index"]) for r in mine] == [(0, 0, 1), (1, 0, 2), (2, 1, 0), (3, 1, 1), (4, 2, 2)]
        result = next(r["summary"] for r in summary["results"] if r["endpoint"] == name)
        assert result["requests"]["measured"] == 5 and result["rounds"] == 3
        spans = [max(r["start_s"] + r["end_s"] for r in mine if r["round"] == k) - min(r["start_s"] for r in mine if r["round"] == k) for k in range(3)]
        assert result["duration_s"] == pytest.approx(sum(spans))
        assert result["duration_s"] < max(r["start_s"] + r["end_s"] for r in mine) - min(r["start_s"] for r in mine)


def test_rounds_beyond_the_measured_requests_are_refused(tmp_path, workload, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--workload", workload(), "--endpoint", "x=http://127.0.0.1:9", "--num-requests", "2", "--rounds", "3", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "--num-requests must be at least --rounds" in capsys.readouterr().err


def test_poisson_arrivals_send_the_asked_count_on_the_completions_route(tmp_path, workload):
    with FakeOpenAI() as server:
        args = [
            "--workload",
            workload(api="completions"),
            "--endpoint",
            f"fake={server.url}",
            "--request-rate",
            "200",
            "--num-requests",
            "5",
            "--warmup-requests",
            "1",
        ]
        code, summary, rows = run(tmp_path, *args)
    assert code == 0
    assert summary["results"][0]["level"] == {"mode": "rate", "value": 200.0}
    assert summary["results"][0]["summary"]["requests"]["measured"] == 5
    assert {path for path, _ in server.bodies} == {"/v1/completions"}
    assert sorted(body["prompt"] for _, body in server.bodies) == sorted(PROMPTS[i % 3] for i in range(6))


def test_a_tampered_manifest_sends_nothing(tmp_path, workload, capsys):
    with FakeOpenAI() as server:
        code = main(["--workload", workload(prompts_sha256="0" * 64), "--endpoint", f"fake={server.url}", "--out", str(tmp_path / "out")])
    assert code == 2
    assert "prompts_sha256" in capsys.readouterr().err
    assert server.bodies == []


@pytest.mark.parametrize(
    "args", [["--concurrency", "0"], ["--request-rate", "0"], ["--endpoint", "nourl"], ["--endpoint", "a=http://x", "--endpoint", "a=http://y"], []]
)
def test_bad_arguments_are_refused(args, workload, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--workload", workload(), *args])
    assert exit_info.value.code == 2


def test_stack_variants_are_stacks_of_the_same_model_with_their_own_flags(workload, capsys):
    args = build_parser().parse_args(
        [
            "--workload",
            workload(),
            "--start-stack",
            "--stack-args",
            "--speculative-method ngram",
            "--stack-variant",
            "off=",
            "--stack-variant",
            "k8=--num-speculative-tokens 8",
        ]
    )
    endpoints = _endpoints(args)
    assert [(e.name, e.flags) for e in endpoints] == [("tokenyard", "--speculative-method ngram"), ("off", ""), ("k8", "--num-speculative-tokens 8")]
    assert len({e.model_path for e in endpoints}) == 1
    with pytest.raises(SystemExit) as exit_info:  # a variant of no stack
        main(["--workload", workload(), "--endpoint", "a=http://x", "--stack-variant", "off="])
    assert exit_info.value.code == 2 and "--stack-variant needs --start-stack" in capsys.readouterr().err


def test_a_started_stack_that_speculates_reports_what_its_workers_verified_in_the_measured_requests(tmp_path, workload, monkeypatch):
    """The workers' counters are read after the warm-ups and after the measured requests: the level's verifies
    alone, summed over the engines, with the share of draft tokens accepted."""
    with FakeOpenAI(FakeBehaviour(verify=(4, 3))) as engine0, FakeOpenAI(FakeBehaviour(verify=(6, 1))) as engine1:
        monkeypatch.setattr(StackEndpoint, "serving", lambda self, level: contextlib.nullcontext(engine0.url))
        monkeypatch.setattr(StackEndpoint, "worker_metrics_urls", lambda self: [f"{engine0.url}/metrics", f"{engine1.url}/metrics"])
        engine1.finished = 5  # the other engine verifies nothing during the level
        code, summary, _ = run(tmp_path, "--workload", workload(), "--start-stack", "--num-requests", "4", "--warmup-requests", "2")
    assert code == 0
    (result,) = summary["results"]
    assert result["speculation"] == {"drafts": 4, "draft_tokens": 16, "accepted_tokens": 12, "acceptance_rate": 0.75, "accepted_per_draft": 3.0}


def test_worker_counters_say_nothing_where_a_worker_does_not_speculate_or_answer():
    with FakeOpenAI(FakeBehaviour(verify=(4, 3))) as speculating, FakeOpenAI() as plain:
        counts = read_counters([f"{speculating.url}/metrics"])
        assert counts == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        assert acceptance(counts, counts) is None  # no draft in between
        assert read_counters([f"{speculating.url}/metrics", f"{plain.url}/metrics"]) is None
    assert read_counters(["http://127.0.0.1:9/metrics"]) is None
    stack = StackEndpoint("model", "--speculative-method ngram --replicas 2")
    assert stack.worker_metrics_urls() == []  # not started
    stack._url = "http://127.0.0.1:8000"
    assert stack.worker_metrics_urls() == ["http://127.0.0.1:8002/metrics", "http://127.0.0.1:8005/metrics"]  # the launcher's ports


def test_an_unreachable_endpoint_is_a_labelled_failure_not_a_crash(tmp_path, workload):
    code, summary, _ = run(
        tmp_path, "--workload", workload(), "--endpoint", "gone=http://127.0.0.1:9", "--model-name", "m", "--num-requests", "1", "--warmup-requests", "0"
    )
    assert code == 1
    assert "ConnectionRefusedError" in summary["incomplete_reasons"][0]


def test_the_started_peer_is_restarted_per_level_with_one_slot_per_stream(tmp_path, workload, monkeypatch):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\ncd {repo} && exec {sys.executable} -m tests.bench.fake_llama_server "$@"\n')
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake")
    code, summary, rows = run(
        tmp_path,
        *("--workload", workload(), "--start-peer", "--peer-gguf", str(gguf), "--concurrency", "1", "3", "--num-requests", "3", "--warmup-requests", "0"),
        *("--peer-args", "--spec-type ngram-simple --spec-draft-n-max 5"),
    )
    assert code == 0
    log = (tmp_path / "out" / "llama-server.log").read_text()
    assert [line.split(" threads")[0] for line in log.splitlines() if line.startswith("fake")] == [
        "fake llama-server: parallel 1",
        "fake llama-server: parallel 3",
    ]
    assert f"threads 2 model {gguf} then " in log and log.count("--no-webui --spec-type ngram-simple --spec-draft-n-max 5\n") == 2
    assert summary["provenance"]["settings"]["peer_args"] == "--spec-type ngram-simple --spec-draft-n-max 5"
    assert [r["endpoint"] for r in summary["results"]] == ["llama.cpp", "llama.cpp"]
    assert len(rows) == 6 and all(r["ok"] for r in rows)
    assert summary["provenance"]["models"]["llama.cpp"]["sha256"] == hashlib.sha256(b"GGUF fake").hexdigest()


def test_the_peer_gets_one_slot_per_stream_and_the_asked_threads():
    command = llama_server_command("/bin/llama-server", "/m.gguf", 8080, parallel=8, threads=2)
    assert command[:3] == ["/bin/llama-server", "-m", "/m.gguf"]
    assert command[command.index("--parallel") + 1] == "8"
    assert command[command.index("-t") + 1] == "2"
    assert int(command[command.index("-c") + 1]) >= 8 * 1024  # every slot holds a prompt and its output
