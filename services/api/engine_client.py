"""The api's side of the engine replicas: routes each request to one, streams its text deltas back.

Each in-flight request has one queue and one owning replica. A request ends exactly once:
with a finishing delta, an engine error, or an abort sent when its consumer goes away
early. A replica that goes silent, reports a new boot or stops being ready leaves
rotation and fails the requests it held; it rejoins once it reports ready again. With
``--engines-from-dns`` the replicas come and go with the Service's addresses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

import structlog
import zmq

from services.api.engine_discovery import DnsEngines
from services.api.errors import ApiError
from services.api.metrics import REPLICA_FAILED, REPLICA_IN_FLIGHT, REPLICA_LATENCY, REPLICA_READY, ROUTED
from services.api.router import make_policy
from shared.config import StackConfig
from shared.detokenize.requests import Detokenization
from shared.frames import (
    Abort,
    ApiAnnounce,
    EngineStatus,
    Error,
    FinishReason,
    MemoryResized,
    MemorySplit,
    ResizeMemory,
    Submit,
    TextBatch,
    TextDelta,
    TokenBatch,
)
from shared.metrics import FRAMES_UNEXPECTED
from shared.tokenizer import load_tokenizer
from shared.transport import AsyncInbox, Curve, Outbox, stop_authenticator

log = structlog.get_logger()

_FAILED = {  # finish reasons that end a request without a result
    FinishReason.ERROR.value: (500, "the engine failed this request"),
    FinishReason.ABORT.value: (503, "the engine aborted this request"),
}


class Engine(Protocol):
    """What the api's handlers need from the engine; ``EngineClient`` over ZeroMQ, or a scripted stand-in in tests.

    ``generate`` yields a request's deltas up to and including the finishing one, raises
    ApiError if the engine refuses or fails it, and aborts it if closed early; ``interrupt``
    makes a request's ``generate`` raise the api's own error (and stops it in the engine).
    """

    status: EngineStatus
    streams: dict[str, asyncio.Queue[TextDelta | ApiError]]

    @property
    def ready(self) -> bool: ...

    def start(self) -> None: ...

    async def close(self) -> None: ...

    def describe_state(self) -> tuple[str, str]: ...

    def addresses(self) -> dict[str, str]: ...

    def describe_replicas(self) -> list[dict]: ...

    def generate(self, submit: Submit) -> AsyncIterator[TextDelta]: ...

    def interrupt(self, rid: str, error: ApiError) -> None: ...

    def memory_splits(self) -> dict[str, MemorySplit]: ...

    async def resize_memory(self, kv_cache_bytes: int, expert_cache_bytes: int) -> dict[str, MemoryResized]: ...


class EngineReplica:
    """One engine replica (a scheduler with its worker, and a detokenizer where one runs) as this api sees it."""

    def __init__(self, name: str, outbox: Outbox, timeout_s: float) -> None:
        self.name = name
        self.outbox = outbox
        self.timeout_s = timeout_s
        self.status = EngineStatus(state="loading", detail="no word from the scheduler yet")
        self.status_seen = 0.0
        self.rids: set[str] = set()  # this api's requests in flight on the replica
        self.own_at_status = 0  # len(rids) when the last status arrived
        self.in_rotation = False
        self.retiring = False  # gone from DNS: takes no new request, and goes once its own have ended

    @property
    def address(self) -> str:
        return self.outbox.address

    @property
    def connected(self) -> bool:
        return time.monotonic() - self.status_seen < self.timeout_s

    @property
    def ready(self) -> bool:
        return self.connected and self.status.state == "ready" and not self.retiring

    @property
    def load(self) -> int:
        """Requests on the replica: this api's (counted here, current) plus other api replicas'
        (the reported total beyond what this api had in flight when it was reported)."""
        others = max(0, self.status.running + self.status.waiting - self.own_at_status)
        return len(self.rids) + others

    def describe_state(self) -> tuple[str, str]:
        if not self.status_seen:
            return "loading", "waiting for the scheduler"
        if not self.connected:
            return "unavailable", f"no status from the scheduler for over {self.timeout_s:g}s"
        return self.status.state, self.status.detail


class EngineClient:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.policy = make_policy(config.router_policy, config.block_size)
        self.ctx = zmq.Context()  # sends never block (NOBLOCK, high-water marks); the inbox is read from the loop
        curve = Curve.from_file(config.curve_key_file)
        self.curve = curve
        self.inbox = AsyncInbox(self.ctx, config.api_address, "api_inbox", curve)
        self.discovery = DnsEngines(*config.engines_dns_target) if config.engines_from_dns else None
        self.replicas: dict[str, EngineReplica] = {}
        self.streams: dict[str, asyncio.Queue[TextDelta | ApiError]] = {}
        self.owner: dict[str, EngineReplica] = {}  # rid -> the replica serving it
        self.resizes: dict[str, asyncio.Future[MemoryResized]] = {}  # memory resizes awaiting their answer, by id
        self._resizes = 0
        # --detokenize-in api: the workers send this api its requests' tokens, and the text is made here.
        self.detokenization = Detokenization(load_tokenizer(config.model)) if config.detokenize_in == "api" else None
        self._tasks: list[asyncio.Task] = []
        for name, address in config.engine_addresses.items():
            self._add_replica(name, address)

    def _add_replica(self, name: str, address: str) -> None:
        self.replicas[name] = EngineReplica(name, Outbox(self.ctx, address, "api_to_scheduler", self.curve), self.config.engine_timeout_s)
        ROUTED.labels(name)  # every replica's series exists from the start
        REPLICA_FAILED.labels(name)
        REPLICA_READY.labels(name).set(0)
        REPLICA_IN_FLIGHT.labels(name).set(0)

    def _drop_replica(self, replica: EngineReplica) -> None:
        log.info("replica_removed", replica=replica.name, address=replica.address)
        self.replicas.pop(replica.name, None)
        replica.outbox.close()
        REPLICA_READY.labels(replica.name).set(0)

    def apply_discovered(self, found: dict[str, str]) -> None:
        """Adopts the replicas DNS names now (name -> scheduler address): new ones join once they report ready,
        gone ones retire (their requests run out), and a name at a new address (its pod was replaced) starts over."""
        for replica in list(self.replicas.values()):
            address = found.get(replica.name)
            if address is None and not replica.retiring:
                log.info("replica_retiring", replica=replica.name, in_flight=len(replica.rids))
                replica.retiring = True
                self._update_rotation(replica)
            elif address is not None and address != replica.address:
                self._fail_replica(replica, f"engine replica {replica.name} was replaced; retry the request")
                self._drop_replica(replica)
            elif address is not None and replica.retiring:  # back in DNS before its requests ran out
                replica.retiring = False
        for name, address in found.items():
            if name not in self.replicas:
                log.info("replica_found", replica=name, address=address)
                self._add_replica(name, address)

    # Lifecycle. ------------------------------------------------------------------------

    def start(self) -> None:
        self.inbox.start(self._on_frame)
        self._tasks = [asyncio.create_task(self._watch())]
        if self.discovery is not None:
            self._tasks.append(asyncio.create_task(self._discover()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.inbox.close()
        for replica in self.replicas.values():
            replica.outbox.close()
        stop_authenticator(self.ctx)
        self.ctx.term()

    def addresses(self) -> dict[str, str]:
        if len(self.replicas) == 1:
            (replica,) = self.replicas.values()
            return {"inbox": self.inbox.address, "scheduler": replica.outbox.address}
        return {"inbox": self.inbox.address, **{f"scheduler/{r.name}": r.outbox.address for r in self.replicas.values()}}

    # Health. ---------------------------------------------------------------------------

    @property
    def status(self) -> EngineStatus:
        """The replicas' load summed; the state of the healthiest."""
        replicas = list(self.replicas.values())
        state, detail = self.describe_state()
        return EngineStatus(
            state=state,
            detail=detail,
            running=sum(r.status.running for r in replicas),
            waiting=sum(r.status.waiting for r in replicas),
            kv_blocks_total=sum(r.status.kv_blocks_total for r in replicas),
            kv_blocks_used=sum(r.status.kv_blocks_used for r in replicas),
        )

    @property
    def ready(self) -> bool:
        return any(r.ready for r in self.replicas.values())

    def describe_state(self) -> tuple[str, str]:
        states = [(r.name, *r.describe_state()) for r in self.replicas.values()]
        if not states:
            return "loading", f"no engine replica at {self.config.engines_from_dns} yet"
        if len(states) == 1:
            return states[0][1:]
        ready = [name for name, state, _ in states if state == "ready"]
        others = "; ".join(f"{name}: {state} {detail}".strip() for name, state, detail in states if state != "ready")
        if ready:
            return "ready", f"{len(ready)} of {len(states)} engine replicas ready" + (f" ({others})" if others else "")
        rank = ("loading", "unhealthy", "failed", "unavailable")  # the hopeful state names the whole
        best = min((state for _, state, _ in states), key=lambda s: rank.index(s) if s in rank else len(rank))
        return best, others

    def describe_replicas(self) -> list[dict]:
        return [
            {
                "name": r.name,
                "scheduler": r.outbox.address,
                "state": r.describe_state()[0],
                "detail": r.describe_state()[1],
                "in_rotation": r.ready,
                "boot": r.status.boot,
                "running": r.status.running,
                "waiting": r.status.waiting,
                "in_flight": len(r.rids),
            }
            for r in self.replicas.values()
        ]

    # Requests. -------------------------------------------------------------------------

    async def generate(self, submit: Submit) -> AsyncIterator[TextDelta]:
        """Yields the request's text deltas up to and including the finishing one.

        Raises ApiError if no replica is ready, or the engine refuses or fails the request.
        Closing the iterator early (client gone) aborts the request in its replica.
        """
        candidates = [r for r in self.replicas.values() if r.ready]
        if not candidates:
            state, detail = self.describe_state()
            raise ApiError(503, f"the engine is not ready ({state}: {detail})", headers={"Retry-After": "1"})
        replica = self.policy.choose(candidates, submit.prompt_ids)
        queue: asyncio.Queue[TextDelta | ApiError] = asyncio.Queue()
        self.streams[submit.rid] = queue
        self.owner[submit.rid] = replica
        replica.rids.add(submit.rid)
        ROUTED.labels(replica.name).inc()
        REPLICA_IN_FLIGHT.labels(replica.name).set(len(replica.rids))
        started = time.perf_counter()
        outcome = "aborted"  # unless a finishing delta or an error arrives
        log.info("request_submitted", rid=submit.rid, replica=replica.name, prompt_tokens=len(submit.prompt_ids), max_tokens=submit.max_tokens)
        try:
            replica.outbox.send(submit)
            while True:
                item = await queue.get()
                if isinstance(item, ApiError):
                    outcome = f"error {item.status}"
                    raise item
                if item.finish in _FAILED:
                    outcome = f"error {_FAILED[item.finish][0]}"
                    raise ApiError(*_FAILED[item.finish])
                if item.finish:
                    outcome = item.finish
                    REPLICA_LATENCY.labels(replica.name).observe(time.perf_counter() - started)
                yield item
                if item.finish:
                    return
        finally:
            self.streams.pop(submit.rid, None)
            self.owner.pop(submit.rid, None)
            replica.rids.discard(submit.rid)
            REPLICA_IN_FLIGHT.labels(replica.name).set(len(replica.rids))
            if outcome == "aborted":
                replica.outbox.send(Abort(rid=submit.rid))
            if self.detokenization is not None and (outcome == "aborted" or outcome.startswith("error")):
                self.detokenization.end(submit.rid)  # ended from outside: its text state goes
            log.info("request_ended", rid=submit.rid, replica=replica.name, outcome=outcome)

    # Memory. --------------------------------------------------------------------------

    def memory_splits(self) -> dict[str, MemorySplit]:
        """Each ready replica's memory split, as its scheduler last reported it."""
        return {r.name: r.status.memory for r in self.replicas.values() if r.ready and r.status.memory is not None}

    async def resize_memory(self, kv_cache_bytes: int, expert_cache_bytes: int) -> dict[str, MemoryResized]:
        """Asks every ready replica for a new split (-1 keeps a size) and waits for each one's answer (a 504 answer
        for one silent past ``stall_timeout_s``)."""
        loop = asyncio.get_running_loop()
        waiting: dict[str, tuple[str, asyncio.Future[MemoryResized]]] = {}
        for name in self.memory_splits():
            self._resizes += 1
            ident = f"{self.config.api_replica}-memory-{self._resizes}"
            waiting[name] = (ident, self.resizes.setdefault(ident, loop.create_future()))
            frame = ResizeMemory(id=ident, kv_cache_bytes=kv_cache_bytes, expert_cache_bytes=expert_cache_bytes, reply_to=self.inbox.address)
            self.replicas[name].outbox.send(frame)
        answers = {}
        try:
            for name, (ident, future) in waiting.items():
                try:
                    answers[name] = await asyncio.wait_for(future, self.config.stall_timeout_s)
                except TimeoutError:
                    answers[name] = MemoryResized(id=ident, status=504, error=f"the engine did not answer the resize within {self.config.stall_timeout_s:g}s")
        finally:
            for ident, _ in waiting.values():
                self.resizes.pop(ident, None)
        return answers

    def interrupt(self, rid: str, error: ApiError) -> None:
        """Ends a request in flight with the api's own error (a drain's deadline): its ``generate`` raises
        it, and its replica is told to stop. A request not (or no longer) in flight is left alone."""
        queue, replica = self.streams.get(rid), self.owner.get(rid)
        if queue is None or replica is None:
            return
        queue.put_nowait(error)
        replica.outbox.send(Abort(rid=rid, reason="interrupted by the api"))

    # Receiving. ------------------------------------------------------------------------

    def _on_frame(self, frame: object) -> None:
        if isinstance(frame, TextBatch):
            for delta in frame.deltas:
                queue = self.streams.get(delta.rid)
                if queue is not None:
                    queue.put_nowait(delta)
        elif isinstance(frame, TokenBatch):
            if self.detokenization is not None:
                self._on_tokens(frame)
            else:
                self._on_undetokenized(frame)
        elif isinstance(frame, EngineStatus):
            self._on_status(frame)
        elif isinstance(frame, MemoryResized):
            future = self.resizes.get(frame.id)
            if future is not None and not future.done():
                future.set_result(frame)
        elif isinstance(frame, Error):
            self._fail(list(self.streams) if not frame.rid else [frame.rid], frame)
        else:
            log.warning("unexpected_frame", frame=type(frame).__name__)
            FRAMES_UNEXPECTED.labels(self.inbox.name).inc()

    def _on_tokens(self, batch: TokenBatch) -> None:
        """A worker's tokens for this api's requests (``--detokenize-in api``), turned into text deltas here."""
        if any(o.rid not in self.streams for o in batch.opened):  # a request over here before it opened starts nothing
            batch = TokenBatch(opened=[o for o in batch.opened if o.rid in self.streams], deltas=batch.deltas)
        out = self.detokenization.take(batch)
        for stop in out.stops:  # ahead of the text: the request's scheduler stops its steps
            replica = self.owner.get(stop.rid)
            if replica is not None:
                replica.outbox.send(stop)
        for _, delta in out.texts:
            queue = self.streams.get(delta.rid)
            if queue is not None:
                queue.put_nowait(delta)

    def _on_undetokenized(self, batch: TokenBatch) -> None:
        """Tokens from a worker started with ``--detokenize-in api`` while this api leaves the text to a
        detokenizer: the requests they name fail at once, with the reason, rather than wait for text."""
        rids = {o.rid for o in batch.opened} | {d.rid for d in batch.deltas}
        log.error("tokens_without_detokenization", requests=len(rids))
        message = "a worker sent this api its tokens, but this api runs --detokenize-in detokenizer: start every process with the same --detokenize-in"
        for rid in rids:
            self.interrupt(rid, ApiError(500, message))

    def _on_status(self, status: EngineStatus) -> None:
        # Until this api's announcement reaches it, a scheduler addresses the configured api with engine "".
        if not status.engine and (len(self.replicas) > 1 or self.discovery is not None):
            return  # which engine sent it is unknown until our announcement reaches it (within a heartbeat)
        replica = self.replicas.get(status.engine) if status.engine else next(iter(self.replicas.values()))
        if replica is None:
            log.warning("status_from_unknown_engine", engine=status.engine)
            return
        if status.state != replica.status.state:
            log.info("engine_state", replica=replica.name, state=status.state, detail=status.detail)
        if replica.status.boot and status.boot != replica.status.boot and replica.rids:
            log.error("scheduler_restarted", replica=replica.name, in_flight=len(replica.rids))
            self._fail_replica(replica, "the scheduler restarted and lost this request; retry it")
        replica.status, replica.status_seen, replica.own_at_status = status, time.monotonic(), len(replica.rids)
        self._update_rotation(replica)

    def _fail(self, rids: list[str], error: Error) -> None:
        exc = ApiError(error.status, error.message, headers={"Retry-After": "1"} if error.status in (429, 503) else None)
        for rid in rids:
            queue = self.streams.get(rid)
            if queue is not None:
                queue.put_nowait(exc)

    def _fail_replica(self, replica: EngineReplica, message: str) -> None:
        """Fails every request this api holds on the replica; they are over, for it too."""
        REPLICA_FAILED.labels(replica.name).inc(len(replica.rids))
        self._fail(list(replica.rids), Error(rid="", status=503, message=message))
        for rid in replica.rids:  # a stalled scheduler that recovers must not keep serving them
            replica.outbox.send(Abort(rid=rid, reason="failed by the api"))
        replica.rids.clear()
        REPLICA_IN_FLIGHT.labels(replica.name).set(0)

    def _update_rotation(self, replica: EngineReplica) -> None:
        """A replica leaves rotation when it is not ready, and rejoins when it is again.

        Leaving because it went silent, stalled or failed fails the requests it held; a
        scheduler that lost its worker or detokenizer fails them itself, with the reason.
        """
        ready = replica.ready
        REPLICA_READY.labels(replica.name).set(int(ready))
        if ready == replica.in_rotation:
            return
        replica.in_rotation = ready
        if ready:
            log.info("replica_joined", replica=replica.name)
            return
        state, detail = replica.describe_state()
        log.error("replica_left", replica=replica.name, state=state, detail=detail, in_flight=len(replica.rids))
        if replica.rids and state in ("unavailable", "unhealthy", "failed"):
            self._fail_replica(replica, f"engine replica {replica.name} is {state} ({detail}); retry the request")

    async def _watch(self) -> None:
        """Announces this api to every scheduler and notices silent ones: a hang must never look alive."""
        while True:
            for replica in list(self.replicas.values()):
                if replica.retiring and (not replica.rids or not replica.connected):
                    self._fail_replica(replica, f"engine replica {replica.name} went away; retry the request")
                    self._drop_replica(replica)
                    continue
                replica.outbox.send(ApiAnnounce(replica=self.config.api_replica, address=self.inbox.address, engine=replica.name))
                self._update_rotation(replica)
            await asyncio.sleep(self.config.heartbeat_s)

    async def _discover(self) -> None:
        """Resolves --engines-from-dns now and every --engines-dns-interval-s (in a thread: a lookup blocks)."""
        while True:
            found = await asyncio.to_thread(self.discovery.lookup)
            if found is not None:
                self.apply_discovered(found)
            await asyncio.sleep(self.config.engines_dns_interval_s)
