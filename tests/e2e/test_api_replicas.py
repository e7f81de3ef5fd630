"""Two api replicas sharing two engine replicas: the launcher's api (B) and a second api process (A)
started with ``--engines`` naming the same schedulers, on a tiny Llama with SmolLM2's tokenizer; once with
the engines' detokenizers making the text, once with each api making its own (``--detokenize-in api``: the
workers send each request's tokens to the api that owns it).

Both apis, driven at once with the OpenAI SDK, get exactly the replies a greedy run of each prompt
gives alone (no reply reaches the wrong api or request), over both engines; a client leaving a
stream on A leaves B's streams alone; stopping A leaves B serving and the engines holding nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import openai
import pytest

from services.launcher.__main__ import replica_config
from shared.config import StackConfig
from shared.devtools.random_model import build_random_smollm
from shared.devtools.stack import free_port_block, stop_process
from tests.e2e.conftest import ENGINES, Replicas, Stack, launched_stack, metric_value, running_service

MODEL = "tiny-smollm"
PROMPTS = ["Name three colours.", "What is a tensor?", "Count to five.", "Tell me about caches."]
MAX_TOKENS = 48


class Reply:
    """What one chat request gave its client: the text and the usage."""

    def __init__(self, text: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.text, self.prompt_tokens, self.completion_tokens = text, prompt_tokens, completion_tokens

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Reply) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"Reply({self.text!r}, prompt={self.prompt_tokens}, completion={self.completion_tokens})"


def chat(client: openai.OpenAI, prompt: str, stream: bool, on_first_delta: Callable[[], None] = lambda: None) -> Reply:
    request = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        reply = client.chat.completions.create(**request)
        assert reply.choices[0].finish_reason == "length"
        return Reply(reply.choices[0].message.content, reply.usage.prompt_tokens, reply.usage.completion_tokens)
    text, usage, finish = [], None, None
    for chunk in client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if not text:
                    on_first_delta()
                text.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert finish == "length" and usage is not None
    return Reply("".join(text), usage.prompt_tokens, usage.completion_tokens)


class TwoApis:
    def __init__(self, engines: Replicas, api_a: Stack, api_b: Stack) -> None:
        self.engines, self.api_a, self.api_b = engines, api_a, api_b
        self.clients = {"A": openai.OpenAI(base_url=f"{api_a.base_url}/v1", api_key="unused", max_retries=0, timeout=60), "B": engines.client}
        self.references: dict[str, Reply] = {}
        self.detokenize_in = "detokenizer"

    def requests_detokenizing(self) -> list[float]:
        """Requests whose text is being made: by each engine's detokenizer, or by the api B (A is stopped)."""
        if self.detokenize_in == "api":
            return [metric_value(self.api_b.metrics("api"), "tokenyard:detokenizer_requests")]
        return [self.engines.instrumentation(e, "detokenizer")["requests"] for e in (0, 1)]

    def finished(self, reason: str = "length") -> list[float]:
        """Requests each engine ended for this reason, so far."""
        name = f'tokenyard:scheduler_requests_finished_total{{finished_reason="{reason}"}}'
        return [metric_value(self.engines.metrics(e), name, default=0) for e in (0, 1)]

    def routed(self) -> dict[str, dict[str, float]]:
        return {"A": self.engines.routed(self.api_a.port), "B": self.engines.routed()}


@pytest.fixture(scope="module", params=["detokenizer", "api"])
def apis(request, tmp_path_factory) -> TwoApis:
    tmp = tmp_path_factory.mktemp("api_replicas")
    build_random_smollm(str(tmp / MODEL), initializer_range=0.2)  # wide logit margins: batching never flips a greedy token
    common = ["--model", str(tmp / MODEL), "--run-dir", str(tmp / "run"), "--router-policy", "load", "--detokenize-in", request.param]
    flags = [*common, "--replicas", "2", "--kv-cache-tokens", "8192", "--num-threads", "1"]
    port = free_port_block(7)
    launcher_config = StackConfig.from_argv(["--port", str(port), *flags])
    engines = ",".join(f"engine-{i}={replica_config(launcher_config, i).scheduler_address}" for i in range(2))
    api_flags = [*common, "--api-replica", "api-a", "--engines", engines, "--drain-timeout-s", "1"]
    with launched_stack(port, flags, str(tmp / "stack.log")) as stack, running_service("api", free_port_block(1), api_flags, str(tmp / "api-a.log")) as api_a:
        replicas = Replicas(stack)
        replicas.wait_all_in_rotation(180)
        replicas.wait_all_in_rotation(60, api_a.port)
        two = TwoApis(replicas, api_a, stack)
        two.detokenize_in = request.param
        for prompt in PROMPTS:  # each prompt alone, on an idle stack
            two.references[prompt] = chat(replicas.client, prompt, stream=False)
        yield two


def test_both_apis_get_their_own_replies_from_both_engines(apis: TwoApis) -> None:
    texts = [reply.text for reply in apis.references.values()]
    assert len(set(texts)) == len(texts), "the prompts' greedy replies must differ for cross-talk to show"
    finished, routed = apis.finished(), apis.routed()
    results: dict[tuple[str, str], Reply | Exception] = {}

    def run(api: str, prompt: str, stream: bool) -> None:
        try:
            results[api, prompt] = chat(apis.clients[api], prompt, stream)
        except Exception as exc:  # reported below, with the others
            results[api, prompt] = exc

    # Every prompt on both apis at once, streamed on one and not on the other.
    jobs = [(api, prompt, (i + j) % 2 == 0) for j, api in enumerate("AB") for i, prompt in enumerate(PROMPTS)]
    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {key: result for key, result in results.items() if result != apis.references[key[1]]} == {}
    assert len(results) == len(jobs)
    served = [after - before for after, before in zip(apis.finished(), finished)]
    assert sum(served) == len(jobs) and min(served) > 0, served
    after = apis.routed()
    for api in "AB":  # each api sent work to each engine: the engines answered two apis at once
        assert all(after[api][e] > routed[api][e] for e in ENGINES), (api, routed, after)


def test_a_client_leaving_api_a_does_not_disturb_api_b(apis: TwoApis) -> None:
    aborted = sum(apis.finished("abort"))
    long = apis.clients["A"].chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a long story"}], max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
    )
    for n, _ in enumerate(long):
        if n == 3:
            break
    b_streaming = threading.Barrier(len(PROMPTS[:2]) + 1)
    results: dict[str, Reply | Exception] = {}

    def run(prompt: str) -> None:
        try:
            results[prompt] = chat(apis.clients["B"], prompt, stream=True, on_first_delta=lambda: b_streaming.wait(30))
        except Exception as exc:
            results[prompt] = exc

    threads = [threading.Thread(target=run, args=(prompt,)) for prompt in PROMPTS[:2]]
    for t in threads:
        t.start()
    b_streaming.wait(30)  # B's streams have begun; now A's client goes away mid-stream
    long.close()
    for t in threads:
        t.join(60)
    assert results == {prompt: apis.references[prompt] for prompt in PROMPTS[:2]}
    deadline = time.monotonic() + 10
    while sum(apis.finished("abort")) <= aborted:
        assert time.monotonic() < deadline, "the engine did not abort the request of the client that left"
        time.sleep(0.1)


def test_stopping_api_a_leaves_b_serving_and_no_request_behind(apis: TwoApis) -> None:
    inboxes = {api: stack.instrumentation("api")["addresses"]["inbox"] for api, stack in (("A", apis.api_a), ("B", apis.api_b))}
    assert all(sorted(apis.engines.instrumentation(e, "scheduler")["addresses"]["apis"]) == sorted(inboxes.values()) for e in (0, 1))
    long = apis.clients["A"].chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "another long story"}], max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(long))
    # Ctrl-C: A drains; its running stream is interrupted after --drain-timeout-s and aborted in its engine.
    assert stop_process(apis.api_a.process) == 0
    with pytest.raises((openai.APIError, openai.APIConnectionError)):
        for _ in long:
            pass
    assert chat(apis.clients["B"], PROMPTS[0], stream=True) == apis.references[PROMPTS[0]]
    assert chat(apis.clients["B"], PROMPTS[1], stream=False) == apis.references[PROMPTS[1]]
    deadline = time.monotonic() + 15
    while True:  # nothing is left of A's requests, and the schedulers forget A once it stops announcing
        schedulers = [apis.engines.instrumentation(e, "scheduler") for e in (0, 1)]
        held = [(s["running"], s["waiting"], s["kv_blocks_used"]) for s in schedulers]
        known = [sorted(s["addresses"]["apis"]) for s in schedulers]
        if held == [(0, 0, 0)] * 2 and not any(apis.requests_detokenizing()) and known == [[inboxes["B"]]] * 2:
            break
        assert time.monotonic() < deadline, (held, apis.requests_detokenizing(), known)
        time.sleep(0.2)
