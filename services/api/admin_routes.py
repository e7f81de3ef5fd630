"""Admin routes (behind the API keys, as every route): ``POST /v1/admin/memory`` moves a CPU worker's memory between
its KV cache and its expert cache at runtime, checked here against each engine replica's split before it is relayed."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec
from aiohttp import web

from services.api.errors import ApiError
from services.api.protocol import check, read_body
from services.api.state import API_STATE
from shared.frames import MemorySplit

routes = web.RouteTableDef()

BYTES = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None


class MemoryRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A new split: either size or both, in bytes; the one left out stays as it is."""

    REQUIRED: ClassVar[tuple[str, ...]] = ()
    RULES: ClassVar[tuple[dict[str, Any], ...]] = (
        {"anyOf": [{"properties": {name: {"type": "integer"}}, "required": [name]} for name in ("kv_cache_bytes", "expert_cache_bytes")]},
    )

    kv_cache_bytes: BYTES = None
    expert_cache_bytes: BYTES = None


def check_split(body: MemoryRequest, split: MemorySplit, max_model_len: int, block_size: int) -> None:
    """A 400 naming the field unless ``split``'s worker can take ``body``: a KV cache that holds one request of
    ``max_model_len``, and an expert cache (where the model is served with one) of at least one layer's top-k slots."""
    check(body.kv_cache_bytes is not None or body.expert_cache_bytes is not None, "kv_cache_bytes", "send kv_cache_bytes, expert_cache_bytes or both")
    if (budget := body.expert_cache_bytes) is not None:
        check(split.experts > 0, "expert_cache_bytes", "this engine serves its model without an expert cache (--expert-cache-bytes 0, or no routed experts)")
        slots, size, top_k = min(budget // split.expert_slot_bytes, split.experts), split.expert_slot_bytes, split.expert_top_k
        check(
            slots >= top_k,
            "expert_cache_bytes",
            f"expert_cache_bytes {budget} holds {slots} experts of {size} bytes, fewer than one layer's top-k ({top_k}): give at least {top_k * size}",
        )
    if (budget := body.kv_cache_bytes) is not None:
        blocks = budget // split.kv_block_bytes
        needed = -(-max_model_len // block_size)
        check(
            blocks >= needed,
            "kv_cache_bytes",
            f"kv_cache_bytes {budget} holds {blocks * block_size} tokens of KV ({blocks} blocks of {split.kv_block_bytes} bytes), fewer than one request "
            f"of max_model_len ({max_model_len}): give at least {needed * split.kv_block_bytes}",
        )


def describe_split(split: MemorySplit, block_size: int) -> dict[str, Any]:
    return {
        "kv_cache_bytes": split.kv_cache_bytes,
        "kv_blocks": split.kv_blocks,
        "kv_cache_tokens": split.kv_blocks * block_size,
        "expert_cache_bytes": split.expert_cache_bytes,
        "expert_slots": split.expert_slots,
        "applying": split.applying,
    }


@routes.post("/v1/admin/memory")
async def resize_memory(request: web.Request) -> web.Response:
    """Applies the split to every ready engine replica and answers once each has applied it: its running requests
    are preempted and recomputed, none fails. 409 while a previous resize still applies."""
    state = request.app[API_STATE]
    body: MemoryRequest = await read_body(request, MemoryRequest)
    splits = state.engine.memory_splits()
    if not splits:
        raise ApiError(503, "no engine replica is ready to resize", headers={"Retry-After": "1"})
    block_size = state.config.block_size
    for split in splits.values():
        check_split(body, split, state.max_model_len, block_size)
    kv, experts = (-1 if value is None else value for value in (body.kv_cache_bytes, body.expert_cache_bytes))
    answers = await state.engine.resize_memory(kv, experts)
    for name, answer in answers.items():
        if answer.status != 200:
            where = f"engine replica {name}: " if len(answers) > 1 else ""
            raise ApiError(answer.status, where + answer.error)
    return web.json_response({"engines": {name: describe_split(answer.split, block_size) for name, answer in answers.items()}})
