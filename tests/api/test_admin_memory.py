"""POST /v1/admin/memory: behind the API key; a split is checked against the engine's before it is relayed (400 naming
the field for a bad value, for an expert cache the model is served without, for a KV cache that cannot hold one request
of max_model_len or an expert cache below one layer's top-k); the engine's refusal (409 while a resize applies) is the
answer's status, and an applied split is answered with the new sizes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
import pytest_asyncio

from services.api.admin_routes import MemoryRequest, check_split
from services.api.errors import ApiError
from shared.config import DEFAULT_MODEL_DIR
from shared.frames import MemoryResized, MemorySplit
from tests.api.conftest import Api, start_api

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = {"Authorization": "Bearer admin-key"}
BLOCK = 184320  # one KV block of SmolLM2-135M (8 tokens, 30 layers, 3 KV heads of 64, float16)
MOE = MemorySplit(kv_blocks=128, kv_block_bytes=4096, expert_cache_bytes=8000, expert_slots=2, expert_slot_bytes=3456, expert_top_k=2, experts=32)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def api() -> AsyncIterator[Api]:
    api = await start_api(DEFAULT_MODEL_DIR, api_key="admin-key", max_model_len=256, block_size=8)
    yield api
    await api.close()


@pytest.fixture(autouse=True)
def fresh_engine(api: Api) -> None:
    api.engine.memory = MemorySplit(kv_blocks=2048, kv_block_bytes=BLOCK)
    api.engine.resizes.clear()
    api.engine.resize_answer = None


async def _post(api: Api, body: object, headers: dict | None = None) -> tuple[int, dict]:
    response = await api.client.post("/v1/admin/memory", json=body, headers=KEY if headers is None else headers)
    return response.status, await response.json()


async def test_the_call_needs_the_api_key(api: Api) -> None:
    status, answer = await _post(api, {"kv_cache_bytes": 64 * BLOCK}, headers={})
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert api.engine.resizes == []


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"kv_cache_bytes": -1}, "kv_cache_bytes", ">= 0"),
        ({"kv_cache_bytes": "1GB"}, "kv_cache_bytes", "Expected `int"),
        ({"kv_cache_bytes": 1.5}, "kv_cache_bytes", "Expected `int"),
        ({"expert_cache_bytes": True}, "expert_cache_bytes", "Expected `int"),
        ({"kv_cache_bytes": 1 << 30, "gpu_bytes": 1}, "gpu_bytes", "Unrecognized"),
        ({}, "kv_cache_bytes", "send kv_cache_bytes, expert_cache_bytes or both"),
        ({"expert_cache_bytes": 1 << 20}, "expert_cache_bytes", "without an expert cache"),
        # 256 tokens of max_model_len are 32 blocks of 8
        ({"kv_cache_bytes": 32 * BLOCK - 1}, "kv_cache_bytes", f"248 tokens of KV (31 blocks of {BLOCK} bytes), fewer than one request of max_model_len (256)"),
    ],
)
async def test_a_split_the_engine_cannot_take_is_a_400_naming_the_field(api: Api, body: dict, param: str, words: str) -> None:
    status, answer = await _post(api, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer
    assert api.engine.resizes == []  # nothing reached the engine


async def test_an_applied_split_is_answered_with_the_new_sizes(api: Api) -> None:
    status, answer = await _post(api, {"kv_cache_bytes": 32 * BLOCK})
    assert status == 200, answer
    assert api.engine.resizes == [(32 * BLOCK, -1)]  # the size left out stays
    assert answer["engines"]["scripted"] == {
        "kv_cache_bytes": 32 * BLOCK,
        "kv_blocks": 32,
        "kv_cache_tokens": 256,
        "expert_cache_bytes": 0,
        "expert_slots": 0,
        "applying": False,
    }


async def test_the_expert_cache_of_a_moe_engine_moves_and_its_bound_is_one_layers_top_k(api: Api) -> None:
    api.engine.memory = MOE
    status, answer = await _post(api, {"expert_cache_bytes": 2 * 3456 - 1, "kv_cache_bytes": 1 << 20})
    assert status == 400 and answer["error"]["param"] == "expert_cache_bytes", answer
    assert "holds 1 experts of 3456 bytes, fewer than one layer's top-k (2): give at least 6912" in answer["error"]["message"]
    status, answer = await _post(api, {"expert_cache_bytes": 8 * 3456, "kv_cache_bytes": 64 * 4096})
    assert status == 200, answer
    assert api.engine.resizes == [(64 * 4096, 8 * 3456)]
    assert (answer["engines"]["scripted"]["expert_slots"], answer["engines"]["scripted"]["kv_blocks"]) == (8, 64)


async def test_the_engines_refusal_is_the_answer_409_while_a_resize_applies(api: Api) -> None:
    api.engine.resize_answer = MemoryResized(id="x", status=409, error="a memory resize (api-0-memory-1) is still applying; retry once it is done")
    status, answer = await _post(api, {"kv_cache_bytes": 64 * BLOCK})
    assert status == 409 and "still applying" in answer["error"]["message"], answer


async def test_check_split_takes_every_expert_resident_and_no_less_than_max_model_len() -> None:
    everything = MemoryRequest(expert_cache_bytes=1 << 40)  # more than every expert: all of them, in 32 slots
    check_split(everything, MOE, max_model_len=1024, block_size=8)
    check_split(MemoryRequest(kv_cache_bytes=128 * 4096), MOE, max_model_len=1024, block_size=8)
    with pytest.raises(ApiError, match="give at least 524288"):
        check_split(MemoryRequest(kv_cache_bytes=128 * 4096 - 1), MOE, max_model_len=1024, block_size=8)
    assert msgspec.json.decode(b'{"kv_cache_bytes": 0}', type=MemoryRequest).kv_cache_bytes == 0
