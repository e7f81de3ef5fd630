"""Memory moved between the KV cache and the expert cache at runtime (``POST /v1/admin/memory``) on a stack serving a
tiny random qwen3moe GGUF with Q4_0 experts from two expert slots: a resize under 8 running streams preempts them and
every stream completes with the greedy text of an unresized run; the scheduler's and worker's /instrumentation show
the new split; a split the engine cannot take is a 400 naming the field, and a resize while one applies is a 409."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.worker.linear import block_formats
from shared.devtools.stack import free_port_block
from tests.e2e.conftest import Stack, launched_stack, metric_value, wait_healthy
from tests.worker.gguf_files import tiny_gguf
from tests.worker.harness import prompt_of

pytestmark = pytest.mark.skipif(not block_formats(torch.device("cpu"), torch.float32), reason="the C++ CPU kernels are unavailable here")

KEY = "admin-key"
SLOT_BYTES = 4096  # Q4_0 gate_up [64, 64] and down [64, 32] (18 bytes per block of 32: 3456) padded to a page
MAX_MODEL_LEN = 128
PROMPTS = [prompt_of(40 + i, n) for i, n in enumerate((5, 9, 13, 17, 21, 25, 29, 33))]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("resize")
    path, _ = tiny_gguf("qwen3_moe", str(tmp), {"matrices": Q.Q4_0}, norm_topk_prob=True, num_hidden_layers=2)
    flags = ["--model", path, "--num-threads", "1", "--kv-cache-tokens", "1024", "--block-size", "8", "--max-num-batched-tokens", "16"]
    flags += ["--max-model-len", str(MAX_MODEL_LEN), "--api-key", KEY, "--expert-cache-bytes", "12.5%", "--expert-cache-dir", str(tmp / "store")]
    with launched_stack(free_port_block(), flags, str(tmp / "stack.log")) as stack:
        wait_healthy(stack, 300)
        yield stack


def resize(stack: Stack, body: object, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{stack.base_url}/v1/admin/memory", data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def block_bytes(stack: Stack) -> int:
    return stack.instrumentation("worker")["memory"]["kv_block_bytes"]


def streams(stack: Stack, started: threading.Barrier | None = None) -> list[str]:
    """The 8 prompts' greedy texts, streamed at once; ``started`` is passed once each stream has its first text."""
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=KEY, max_retries=0, timeout=300)

    def complete(prompt: list[int]) -> str:
        text, told = [], False
        stream = client.completions.create(
            model="model.gguf", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        for chunk in stream:
            text.append(chunk.choices[0].text)
            if started is not None and not told and "".join(text):
                told = True
                started.wait(120)
        return "".join(text)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(complete, PROMPTS))


def test_a_resize_under_8_running_streams_leaves_every_stream_as_unresized(stack: Stack) -> None:
    unresized = streams(stack)
    assert all(text for text in unresized)
    kv_block = block_bytes(stack)
    preempted_before = metric_value(stack.metrics("scheduler"), "tokenyard:num_preemptions_total")
    answers: list[tuple[int, dict]] = []

    def resize_once_all_stream() -> None:
        answers.append(resize(stack, {"kv_cache_bytes": 100 * kv_block, "expert_cache_bytes": 4 * SLOT_BYTES}))

    started = threading.Barrier(len(PROMPTS) + 1)
    resizer = threading.Thread(target=lambda: (started.wait(120), resize_once_all_stream()))
    resizer.start()
    resized = streams(stack, started)
    resizer.join(120)

    ((status, answer),) = answers
    assert status == 200, answer
    assert answer["engines"]["engine-0"] == {
        "kv_cache_bytes": 100 * kv_block,
        "kv_blocks": 100,
        "kv_cache_tokens": 800,
        "expert_cache_bytes": 4 * SLOT_BYTES,
        "expert_slots": 4,
        "applying": False,
    }
    assert resized == unresized
    assert metric_value(stack.metrics("scheduler"), "tokenyard:num_preemptions_total") > preempted_before  # preempted, not failed
    scheduler, worker = stack.instrumentation("scheduler"), stack.instrumentation("worker")
    assert (scheduler["kv_blocks_total"], scheduler["memory"]["kv_blocks"], scheduler["memory"]["expert_slots"], scheduler["memory"]["applying"]) == (
        100, 100, 4, False,
    )  # fmt: skip
    assert (worker["kv_blocks_total"], worker["memory"]["kv_cache_bytes"], worker["memory"]["expert_slots"]) == (100, 100 * kv_block, 4)
    assert (worker["runner"]["expert_cache"]["slots"], worker["runner"]["kv_cache_bytes"]) == (4, 100 * kv_block)
    assert "memory_resized" in stack.log()
    assert streams(stack) == unresized  # and on the new split, from a quiet start


def test_a_split_the_engine_cannot_take_is_a_400_naming_the_field(stack: Stack) -> None:
    kv_block = block_bytes(stack)
    before = stack.instrumentation("worker")["memory"]
    status, answer = resize(stack, {"expert_cache_bytes": 2 * SLOT_BYTES - 1})
    assert status == 400 and answer["error"]["param"] == "expert_cache_bytes", answer
    assert f"fewer than one layer's top-k (2): give at least {2 * SLOT_BYTES}" in answer["error"]["message"]
    status, answer = resize(stack, {"kv_cache_bytes": MAX_MODEL_LEN // 8 * kv_block - 1})
    assert status == 400 and answer["error"]["param"] == "kv_cache_bytes", answer
    assert f"fewer than one request of max_model_len ({MAX_MODEL_LEN})" in answer["error"]["message"]
    status, answer = resize(stack, {"kv_cache_bytes": -1})
    assert status == 400 and answer["error"]["param"] == "kv_cache_bytes", answer
    status, answer = resize(stack, {"kv_cache_bytes": 64 * kv_block}, key=None)
    assert status == 401, answer
    assert stack.instrumentation("worker")["memory"] == before  # nothing was applied


def test_a_resize_while_one_applies_is_a_409(stack: Stack) -> None:
    kv_block = block_bytes(stack)
    large, small = {"kv_cache_bytes": (64 << 20) // kv_block * kv_block}, {"expert_cache_bytes": 3 * SLOT_BYTES}
    statuses: list[int] = []
    for _ in range(5):  # the second call must reach the scheduler while the first applies: a 64 MiB KV cache is made meanwhile
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(resize, stack, large)
            time.sleep(0.002)
            second = pool.submit(resize, stack, small)
            (status_first, answer_first), (status_second, answer_second) = first.result(), second.result()
        assert status_first == 200, answer_first
        statuses.append(status_second)
        if status_second == 409:
            assert "still applying" in answer_second["error"]["message"], answer_second
            break
        assert status_second == 200, answer_second
    assert 409 in statuses, statuses
    status, answer = resize(stack, {"kv_cache_bytes": 100 * kv_block, "expert_cache_bytes": 4 * SLOT_BYTES})
    assert status == 200 and not stack.instrumentation("scheduler")["memory"]["applying"], answer
