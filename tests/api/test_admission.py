"""Past the in-flight bound the api answers 429 with Retry-After; a drain refuses new requests with 503, lets
running ones finish within its deadline and ends the rest with an error the client receives."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

from shared.config import DEFAULT_MODEL_DIR
from tests.api.conftest import Api, start_api

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def bounded() -> Api:
    api = await start_api(DEFAULT_MODEL_DIR, max_in_flight=2)
    yield api
    await api.close()


def _completion(api: Api, **extra) -> dict:
    return {"model": api.model, "prompt": "hi", "max_tokens": 8, **extra}


async def _until(condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_past_the_bound_is_429_with_retry_after_in_each_protocols_shape(bounded: Api) -> None:
    bounded.engine.script("a", "b", delay_s=0.3).script("c", "d", delay_s=0.3)
    running = [asyncio.create_task(bounded.post("/v1/completions", _completion(bounded))) for _ in range(2)]
    await _until(lambda: bounded.state.admission.in_flight == 2)

    response = await bounded.client.post("/v1/chat/completions", json={"model": bounded.model, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status == 429 and response.headers["Retry-After"] == "1"
    error = (await response.json())["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded" and "limit 2" in error["message"]

    response = await bounded.client.post("/v1/messages", json={"model": bounded.model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status == 429 and response.headers["Retry-After"] == "1"
    assert (await response.json())["error"]["type"] == "rate_limit_error"

    assert [status for status, _ in await asyncio.gather(*running)] == [200, 200]
    assert bounded.state.admission.in_flight == 0
    assert (await bounded.post("/v1/completions", _completion(bounded)))[0] == 200  # room again


async def test_the_openai_sdk_sees_a_rate_limit_error(bounded: Api) -> None:
    import openai

    bounded.engine.script("a", "b", delay_s=0.3).script("c", "d", delay_s=0.3)
    running = [asyncio.create_task(bounded.post("/v1/completions", _completion(bounded))) for _ in range(2)]
    await _until(lambda: bounded.state.admission.in_flight == 2)
    with pytest.raises(openai.RateLimitError):
        await bounded.openai().completions.create(model=bounded.model, prompt="hi", max_tokens=4)
    await asyncio.gather(*running)


async def test_drain_refuses_new_requests_finishes_running_ones_and_interrupts_the_rest() -> None:
    api = await start_api(DEFAULT_MODEL_DIR)
    try:
        # A quick non-streaming request, and a slow stream that outlives the deadline.
        api.engine.script("done", " soon", delay_s=0.2).script(*[f"t{i} " for i in range(50)], delay_s=0.1)
        quick = asyncio.create_task(api.post("/v1/completions", _completion(api)))
        await _until(lambda: api.state.admission.in_flight == 1)
        slow = await api.client.post("/v1/completions", json=_completion(api, stream=True))
        assert slow.status == 200
        drain = asyncio.create_task(api.state.admission.drain(timeout_s=1.0))
        await _until(lambda: api.state.admission.draining)

        status, body = await api.post("/v1/completions", _completion(api))
        assert status == 503 and body["error"]["code"] == "shutting_down"
        health = await api.client.get("/health")
        assert health.status == 503 and (await health.json())["status"] == "draining"

        status, body = await quick
        assert status == 200 and body["choices"][0]["text"] == "done soon"  # finished within the deadline
        events = [line[len("data: ") :] for line in (await slow.text()).splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "shutting_down" and "drain deadline" in error["message"]
        assert await drain == 1
        assert api.engine.aborted == [api.engine.submits[1].rid]  # the engine was told to stop the interrupted request
        assert api.state.admission.in_flight == 0
    finally:
        await api.close()


async def test_a_request_interrupted_before_its_first_token_gets_503() -> None:
    api = await start_api(DEFAULT_MODEL_DIR)
    try:
        api.engine.script("late", delay_s=5.0)
        pending = asyncio.create_task(api.post("/v1/messages", {"model": api.model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}))
        await _until(lambda: api.state.admission.in_flight == 1)
        assert await api.state.admission.drain(timeout_s=0.2) == 1
        status, body = await pending
        assert status == 503 and body["type"] == "error" and "drain deadline" in body["error"]["message"]
    finally:
        await api.close()


async def test_a_drain_interrupts_every_engine_request_of_a_request_with_several_choices() -> None:
    api = await start_api(DEFAULT_MODEL_DIR)
    try:
        for _ in range(2):
            api.engine.script(*[f"t{i} " for i in range(50)], delay_s=0.1)
        pending = asyncio.create_task(api.post("/v1/completions", {**_completion(api), "n": 2}))
        await _until(lambda: api.state.admission.in_flight == 2)
        assert await api.state.admission.drain(timeout_s=0.2) == 1
        status, body = await pending
        assert status == 503 and "drain deadline" in body["error"]["message"]
        assert sorted(api.engine.aborted) == sorted(s.rid for s in api.engine.submits)  # both told to stop
        assert api.state.admission.in_flight == 0
    finally:
        await api.close()
