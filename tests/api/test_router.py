"""The api's routing among engine replicas: the policies, and a replica leaving rotation."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import zmq

from services.api.engine_client import EngineClient
from services.api.errors import ApiError
from services.api.router import LeastLoad, PrefixAffinity, RoundRobin, make_policy
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import Abort, ApiAnnounce, EngineStatus, StreamOpen, Submit, TextDelta, TokenBatch, TokenDelta
from shared.transport import Inbox


@dataclass
class Replica:
    name: str
    load: int = 0


def test_least_load_picks_the_idlest_and_rotates_ties() -> None:
    a, b, c = Replica("a", 3), Replica("b", 1), Replica("c", 1)
    policy = LeastLoad(16)
    assert {policy.choose([a, b, c], []).name for _ in range(4)} == {"b", "c"}
    assert RoundRobin(16).choose([a], []).name == "a"


def test_prefix_affinity_follows_a_shared_prefix_unless_that_replica_is_much_busier() -> None:
    a, b = Replica("a"), Replica("b")
    policy = PrefixAffinity(block_size=4)
    shared = list(range(100, 132))  # 8 blocks
    first = policy.choose([a, b], shared + [1, 2])
    other = b if first is a else a
    first.load = 3  # busier, within the slack: the prefix still wins
    assert all(policy.choose([a, b], shared + [i, i, i, i, i]) is first for i in range(5))
    assert policy.choose([a, b], [7, 7, 7, 7] + shared) is other  # a different first block shares nothing
    first.load = other.load + PrefixAffinity.BALANCE_SLACK + 1
    assert policy.choose([a, b], shared + [9]) is other
    assert policy.choose([other], shared) is other  # the owner out of rotation: any replica


def test_bad_routing_settings_name_their_flag() -> None:
    with pytest.raises(ValueError, match="--router-policy: unknown policy 'fastest'"):
        make_policy("fastest", 16)
    with pytest.raises(ValueError, match="--engines: expected name=scheduler_addr"):
        _ = StackConfig(engines="engine-0").engine_addresses
    with pytest.raises(ValueError, match="given twice"):
        _ = StackConfig(engines="a=ipc:///x,a=ipc:///y").engine_addresses
    assert StackConfig(port=1234).engine_addresses == {"engine-0": StackConfig(port=1234).scheduler_address}


@contextlib.asynccontextmanager
async def _one_ready_replica(tmp_path, **settings) -> AsyncIterator[tuple[EngineClient, Inbox]]:
    """An EngineClient (``settings`` for its StackConfig) with one ready replica, e0, and e0's scheduler inbox."""
    scheduler_address = f"ipc://{tmp_path}/s0.sock"
    ctx = zmq.Context()
    scheduler = Inbox(ctx, scheduler_address, "test_scheduler_inbox")
    client = EngineClient(StackConfig(run_dir=str(tmp_path), engines=f"e0={scheduler_address}", **settings))
    try:
        client._on_status(EngineStatus(state="ready", boot="b1", engine="e0"))
        yield client, scheduler
    finally:
        await client.close()
        scheduler.close()
        ctx.destroy(0)


async def _collect(client: EngineClient, submit: Submit) -> list:
    return [d async for d in client.generate(submit)]


def test_a_silent_replica_fails_only_its_requests_and_leaves_rotation(tmp_path) -> None:
    async def scenario() -> None:
        config = StackConfig(run_dir=str(tmp_path), engines=f"e0=ipc://{tmp_path}/s0.sock,e1=ipc://{tmp_path}/s1.sock", heartbeat_s=0.05)
        client = EngineClient(config)
        try:
            for name in ("e0", "e1"):
                client._on_status(EngineStatus(state="ready", boot="b1", engine=name))
            tasks = {rid: asyncio.create_task(_collect(client, Submit(rid=rid, prompt_ids=[1], max_tokens=1))) for rid in ("r0", "r1")}
            await asyncio.sleep(0.01)
            owners = {rid: client.owner[rid].name for rid in tasks}
            assert sorted(owners.values()) == ["e0", "e1"]  # load-aware: one each
            lost = client.replicas[owners["r0"]]
            lost.status_seen = time.monotonic() - 10  # silent for longer than engine_timeout_s
            client._update_rotation(lost)
            with pytest.raises(ApiError, match=f"engine replica {lost.name} is unavailable") as failed:
                await tasks["r0"]
            assert failed.value.status == 503
            assert not client.ready or [r.name for r in client.replicas.values() if r.ready] == [owners["r1"]]
            client.streams["r1"].put_nowait(TextDelta(rid="r1", text="x", finish="length"))
            assert [d.finish for d in await tasks["r1"]] == ["length"]
            late = asyncio.create_task(_collect(client, Submit(rid="r2", prompt_ids=[1], max_tokens=1)))
            await asyncio.sleep(0.01)
            assert client.owner["r2"].name == owners["r1"]  # only the healthy replica takes new requests
            client.streams["r2"].put_nowait(TextDelta(rid="r2", finish="stop"))
            await late
            client._on_status(EngineStatus(state="ready", boot="b1", engine=lost.name))  # it answers again: rejoins
            assert lost.in_rotation and lost.ready
        finally:
            await client.close()

    asyncio.run(scenario())


def test_an_interrupt_fails_the_request_with_the_apis_error_and_stops_it_in_its_replica(tmp_path) -> None:
    async def scenario() -> None:
        async with _one_ready_replica(tmp_path) as (client, scheduler):
            task = asyncio.create_task(_collect(client, Submit(rid="r0", prompt_ids=[1], max_tokens=8)))
            await asyncio.sleep(0.01)
            client.interrupt("r0", ApiError(503, "drain deadline passed"))
            client.interrupt("unknown", ApiError(503, "drain deadline passed"))  # not in flight: nothing happens
            with pytest.raises(ApiError, match="drain deadline passed"):
                await task
            assert "r0" not in client.streams and not client.replicas["e0"].rids
            frames = []
            for _ in range(50):
                frames += list(scheduler.recv(100))
                if any(isinstance(f, Abort) for f in frames):
                    break
            assert [(type(f).__name__, f.rid) for f in frames if not isinstance(f, ApiAnnounce)] == [("Submit", "r0"), ("Abort", "r0")]

    asyncio.run(scenario())


def test_tokens_sent_to_an_api_that_leaves_the_text_to_a_detokenizer_fail_their_request_with_the_reason(tmp_path) -> None:
    async def scenario() -> None:
        async with _one_ready_replica(tmp_path, detokenize_in="detokenizer") as (client, _):
            task = asyncio.create_task(_collect(client, Submit(rid="r0", prompt_ids=[1], max_tokens=8)))
            await asyncio.sleep(0.01)
            client._on_frame(TokenBatch(deltas=[TokenDelta(rid="r0", token_ids=[5]), TokenDelta(rid="not-ours", token_ids=[6])]))
            with pytest.raises(ApiError, match="start every process with the same --detokenize-in") as failed:
                await task
            assert failed.value.status == 500 and "r0" not in client.streams

    asyncio.run(scenario())


def test_an_api_that_makes_the_text_forgets_a_request_it_stopped_streaming_and_ignores_its_late_tokens(tmp_path) -> None:
    async def scenario() -> None:
        async with _one_ready_replica(tmp_path, model=DEFAULT_MODEL_DIR, detokenize_in="api") as (client, _):
            streamed = client.generate(Submit(rid="r0", prompt_ids=[1], max_tokens=8))
            first = asyncio.create_task(anext(streamed))
            await asyncio.sleep(0.01)
            client._on_frame(TokenBatch(opened=[StreamOpen(rid="r0", prompt_tokens=1, max_tokens=8)], deltas=[TokenDelta(rid="r0", token_ids=[28])]))
            assert (await first).completion_tokens == 1 and "r0" in client.detokenization.requests
            await streamed.aclose()  # the client left: aborted
            assert not client.detokenization.requests
            late = TokenBatch(
                opened=[StreamOpen(rid="r1", prompt_tokens=1, max_tokens=8)], deltas=[TokenDelta(rid="r0", token_ids=[29]), TokenDelta(rid="r1", token_ids=[5])]
            )
            client._on_frame(late)  # r0's step was in flight; r1 was never this api's (or it was aborted before its opening came)
            assert not client.detokenization.requests

    asyncio.run(scenario())
