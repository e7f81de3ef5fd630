"""The scheduler process's loop: frames in, plans out, at most ``pipeline_depth`` plans in flight.

With two plans in flight the worker always has the next step queued when it finishes
one, so it never waits on the scheduler; the scheduler plans while the worker computes.
"""

from __future__ import annotations

import os
import signal
import time

import msgspec
import structlog
import zmq
from prometheus_client import Counter, Gauge, Histogram

from services.scheduler.core import AdmissionError, Outcome, Scheduler
from services.scheduler.draft_blocks import DraftBlocks
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.speculation import Speculation
from services.scheduler.state_slots import CheckpointPool, SlotPool
from services.scheduler.traces import RequestTraces
from shared.config import StackConfig
from shared.cpu_placement import keep_off_worker_core
from shared.frames import (
    Abort,
    ApiAnnounce,
    CompileGrammar,
    EngineState,
    EngineStatus,
    Error,
    ErrorType,
    Finish,
    FinishReason,
    GrammarCompiled,
    Heartbeat,
    MemoryResized,
    MemorySplit,
    ProcessState,
    Release,
    ResizeMemory,
    StepResult,
    Submit,
    TokenBatch,
    TokenDelta,
)
from shared.metrics import FRAMES_UNEXPECTED, PREFIX, PROCESS_UP, start_metrics_server
from shared.model_info import gdn_checkpoints, kv_cache_blocks, load_model_info
from shared.tracing import tracer_for
from shared.transport import Curve, Inbox, Outbox, ReplyOutboxes

RUNNING = Gauge(f"{PREFIX}num_requests_running", "Requests in the running batch")
WAITING = Gauge(f"{PREFIX}num_requests_waiting", "Requests waiting for admission")
KV_USAGE = Gauge(f"{PREFIX}kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
KV_BLOCKS_USED = Gauge(f"{PREFIX}kv_blocks_used", "KV blocks held by requests")
KV_BLOCKS_TOTAL = Gauge(f"{PREFIX}kv_blocks_total", "KV blocks in the cache")
GDN_SLOTS_USED = Gauge(f"{PREFIX}gdn_state_slots_used", "GDN state slots held by running requests (hybrid models)")
GDN_SLOTS_TOTAL = Gauge(f"{PREFIX}gdn_state_slots_total", "GDN state slots on the worker (0: the model has no GDN layers)")
STEP_TOKEN_CAP = Gauge(f"{PREFIX}scheduler_mixed_step_token_cap", "Most tokens a step that carries decodes holds now (0: no cap, or none measured yet)")
DECODE_STEPS_PER_PLAN = Gauge(
    f"{PREFIX}scheduler_decode_steps_per_plan", "Decode steps the next plan of decodes alone runs (1 while anything waits or prefills)"
)
SECONDS_PER_TOKEN = Gauge(f"{PREFIX}scheduler_step_seconds_per_token", "The worker's time per token of large steps, averaged (0 until measured)")
PREFIX_QUERIES = Counter(f"{PREFIX}prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
PREFIX_HITS = Counter(f"{PREFIX}prefix_cache_hits", "Prompt tokens found in the prefix cache")
CHECKPOINTS_USED = Counter(f"{PREFIX}prefix_cache_gdn_checkpoints_used", "GDN state checkpoints restored at admissions (hybrid models)")
CHECKPOINTS_HELD = Gauge(f"{PREFIX}gdn_checkpoints_used", "GDN state checkpoints the prefix cache holds (hybrid models)")
CHECKPOINTS_TOTAL = Gauge(f"{PREFIX}gdn_checkpoints_total", "GDN checkpoint slots on the worker (0: none)")
PREEMPTIONS = Counter(f"{PREFIX}num_preemptions", "Running requests preempted for recomputation")
STEPS = Counter(f"{PREFIX}scheduler_steps", "Step plans sent to the worker")
STEP_TOKENS = Histogram(f"{PREFIX}step_tokens", "Tokens scheduled per step", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048))
PLAN_TIME = Histogram(f"{PREFIX}step_planning_seconds", "Time to plan one step", buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2))
QUEUE_TIME = Histogram(f"{PREFIX}scheduler_queue_time_seconds", "Time from arrival at the scheduler to admission")
FINISHED = Counter(f"{PREFIX}scheduler_requests_finished", "Requests the scheduler ended", ["finished_reason"])
REJECTED = Counter(f"{PREFIX}scheduler_requests_rejected", "Requests refused at admission", ["status"])


class _Peer:
    """What the scheduler last heard from a neighbour process."""

    def __init__(self) -> None:
        self.state: ProcessState | str = "unknown"  # or "lost": what the scheduler concluded, not what the peer said
        self.detail = ""
        self.progress = 0.0
        self.seen = 0.0
        self.pid = 0
        self.serving = False  # was ready and has not been lost since

    def alive(self, timeout_s: float) -> bool:
        return time.monotonic() - self.seen < timeout_s


class SchedulerLoop:
    def __init__(self, config: StackConfig, log: structlog.stdlib.BoundLogger) -> None:
        self.config = config
        self.log = log
        self.model = load_model_info(config.model)
        num_blocks = kv_cache_blocks(self.model, config.kv_cache_tokens, config.kv_cache_bytes, config.block_size, config.dtype)
        # A hybrid model's requests hold a GDN state slot each, as many as may run at once (the worker
        # sizes its state tensors the same way); its prefix cache resumes at GDN state checkpoints, without which it is off.
        hybrid = self.model.uses_state_slots
        self.prefix_cache_off_reason = "disabled by --enable-prefix-cache false"
        if config.enable_prefix_cache:
            off = hybrid and not gdn_checkpoints(self.model, config)
            budget = config.gdn_checkpoint_bytes
            why = f"--gdn-checkpoint-bytes {budget} holds no checkpoint" if budget else "--gdn-checkpoint-slots 0"
            self.prefix_cache_off_reason = f"{self.model.prefix_cache_unsupported} ({why})" if off else ""
        pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_cache and not self.prefix_cache_off_reason)
        slots = SlotPool(config.max_num_seqs) if hybrid else None
        checkpoints = CheckpointPool(gdn_checkpoints(self.model, config)) if hybrid and pool.enable_prefix_cache else None
        speculation = None
        if config.speculative_method:
            if config.tensor_parallel_size > 1:
                raise ValueError("speculative decoding does not run with tensor parallelism")
            speculation = Speculation(config.num_speculative_tokens, config.speculative_max_batch)
        # The draft's KV holds as many blocks as the target's as configured; the worker's count, once it says it, is adopted.
        draft_blocks = DraftBlocks(max(1, num_blocks), config.block_size) if config.speculative_method == "draft" else None
        self.core = Scheduler(
            pool,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_waiting,
            slots,
            config.mixed_step_target_ms / 1000,
            config.decode_plan_ms / 1000,
            checkpoints,
            config.gdn_checkpoint_interval,
            speculation=speculation,
            draft_blocks=draft_blocks,
        )
        self._counted_queries = self._counted_hits = self._counted_restores = 0
        ctx = zmq.Context()
        curve = Curve.from_file(config.curve_key_file)
        self.inbox = Inbox(ctx, config.scheduler_address, "scheduler_inbox", curve)
        self.to_worker = Outbox(ctx, config.worker_address, "scheduler_to_worker", curve)
        # The detokenizer, unless the api detokenizes (--detokenize-in api): then the api ends its own requests'
        # text when they end from outside, as it hears of every such ending (its aborts, the Error frames).
        self.to_detokenizer: Outbox | None = None
        if config.detokenize_in == "detokenizer":
            self.to_detokenizer = Outbox(ctx, config.detokenizer_address, "scheduler_to_detokenizer", curve)
        # Replies go to the api replica that owns the request (Submit.reply_to); status to every
        # api replica that announced itself recently, and to the configured api until one has.
        self.to_api = ReplyOutboxes(ctx, config.api_address, "scheduler_to_api", curve)
        self.apis: dict[str, tuple[str, float]] = {}  # api inbox address -> (its name for this engine, last heard)
        self.peers = {"worker": _Peer(), **({"detokenizer": _Peer()} if self.to_detokenizer is not None else {})}
        self.in_flight: dict[int, tuple[float, list[str]]] = {}  # step -> (sent at, rids planned in it)
        self.next_step = 0
        self.memory: MemorySplit | None = None  # the worker's split, from its heartbeats and resize answers
        self.resizing: ResizeMemory | None = None  # the resize being applied: no plan is made until the worker answers
        self.stopping = False
        self.boot = f"{os.getpid()}-{time.time_ns()}"
        # Spans of the requests that arrive traced; None without --otlp-traces-endpoint: the loop then makes no tracer call.
        tracer = tracer_for(config.otlp_traces_endpoint, "tokenyard-scheduler")
        self.traces = RequestTraces(tracer) if tracer is not None else None
        self._gauge_state()

    def _gauge_state(self) -> None:
        """The state gauges read the core when Prometheus scrapes, instead of being set on every pass of the loop:
        at one stream a pass runs per token, and each metric call costs microseconds there (its code is cold by then)."""
        core = self.core
        RUNNING.set_function(lambda: len(core.running))
        WAITING.set_function(lambda: len(core.waiting))
        KV_USAGE.set_function(lambda: core.pool.usage)  # core.pool: the worker may have resized it since (_adopt_kv_blocks)
        KV_BLOCKS_USED.set_function(lambda: core.pool.num_used)
        KV_BLOCKS_TOTAL.set_function(lambda: core.pool.num_blocks)
        GDN_SLOTS_USED.set_function(lambda: core.slots.num_used if core.slots else 0)
        GDN_SLOTS_TOTAL.set_function(lambda: core.slots.num_slots if core.slots else 0)
        CHECKPOINTS_HELD.set_function(lambda: len(core.checkpoints) if core.checkpoints is not None else 0)
        CHECKPOINTS_TOTAL.set_function(lambda: core.checkpoints.num_slots if core.checkpoints is not None else 0)
        STEP_TOKEN_CAP.set_function(lambda: core.step_cost.token_cap() or 0)
        SECONDS_PER_TOKEN.set_function(lambda: core.step_cost.seconds_per_token or 0.0)
        DECODE_STEPS_PER_PLAN.set_function(lambda: core.decode_runs.steps())

    # Readiness. ------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        timeout = self.config.engine_timeout_s
        return all(p.state == ProcessState.READY and p.alive(timeout) for p in self.peers.values())

    def stalled_for(self) -> float:
        """Seconds the oldest step in flight has gone unanswered (0 when none is)."""
        return time.monotonic() - min(self.in_flight.values(), key=lambda v: v[0])[0] if self.in_flight else 0.0

    def status(self) -> EngineStatus:
        worker = self.peers["worker"]
        stalled = self.stalled_for()
        if stalled > self.config.stall_timeout_s:
            state, detail = EngineState.UNHEALTHY, f"the worker has not answered step {min(self.in_flight)} for {stalled:.0f}s"
        elif self.ready:
            state, detail = EngineState.READY, ""
        elif any(p.state == ProcessState.FAILED for p in self.peers.values()):
            state, detail = EngineState.FAILED, "; ".join(f"{n}: {p.detail}" for n, p in self.peers.items() if p.state == ProcessState.FAILED)
        else:
            waiting_on = [n for n, p in self.peers.items() if p.state != ProcessState.READY or not p.alive(self.config.engine_timeout_s)]
            state = EngineState.LOADING
            heard = worker.detail or ("not heard from yet" if worker.state == "unknown" else worker.state)
            detail = f"waiting for {', '.join(waiting_on)}; worker: {heard}"
        return EngineStatus(
            state=state,
            boot=self.boot,
            detail=detail,
            running=len(self.core.running),
            waiting=len(self.core.waiting),
            kv_blocks_total=self.core.pool.num_blocks,
            kv_blocks_used=self.core.pool.num_used,
            memory=self.memory_split(),
        )

    def memory_split(self) -> MemorySplit | None:
        """The worker's split as the scheduler plans with it, and whether a resize is applying."""
        if self.memory is None:
            return None
        return msgspec.structs.replace(self.memory, kv_blocks=self.core.pool.num_blocks, applying=self.resizing is not None)

    def close(self) -> None:
        """Closes every socket (tests build loops they never run)."""
        for socket in (self.inbox, self.to_worker, self.to_detokenizer, self.to_api):
            if socket is not None:
                socket.close()

    # The loop. -------------------------------------------------------------------------

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        next_status = 0.0
        idle = True  # the last plan was empty: wait for a frame instead of spinning
        while not self.stopping:
            can_plan = self.can_plan and not idle
            timeout_ms = 0 if can_plan else int(self.config.heartbeat_s * 1000)
            for frame in self.inbox.recv(timeout_ms):
                idle = False
                self._handle(frame)
            if self.can_plan:
                idle = not self._plan_and_send()
            now = time.monotonic()
            if now >= next_status:
                self._check_peers()
                self._send_status()
                next_status = now + self.config.heartbeat_s
            self._count_prefix_lookups()  # once per pass, after all of its frames and its plan
        self.log.info("scheduler_stopping")

    @property
    def can_plan(self) -> bool:
        return self.ready and self.resizing is None and len(self.in_flight) < self.config.pipeline_depth

    def _plan_and_send(self) -> bool:
        started = time.perf_counter()
        plan = self.core.plan(self.next_step)
        released = self.core.take_released()
        if released:
            PREEMPTIONS.inc(len(released))
            self.to_worker.send(Release(rids=released))
        if self.traces:
            self.traces.planned(plan, released)
        if not plan.slices:
            return False
        PLAN_TIME.observe(time.perf_counter() - started)
        now = time.monotonic()
        for s in plan.slices:
            if s.sampling is not None:  # first slice since (re)admission
                request = self.core.requests[s.rid]
                QUEUE_TIME.observe(now - request.queued_at)
                self.log.info("request_admitted", rid=s.rid, step=plan.step, cached_tokens=s.start, recompute=bool(request.output_ids))
        STEPS.inc()
        STEP_TOKENS.observe(sum(s.num_tokens for s in plan.slices))
        self.to_worker.send(plan)
        self.in_flight[plan.step] = (time.monotonic(), [s.rid for s in plan.slices])
        self.next_step += 1
        return True

    def _handle(self, frame: object) -> None:
        if isinstance(frame, StepResult):
            self._on_result(frame)
        elif isinstance(frame, Submit):
            self._on_submit(frame)
        elif isinstance(frame, GrammarCompiled):
            self._on_compiled(frame)
        elif isinstance(frame, Abort):
            self._send(self.core.finish(frame.rid, FinishReason.ABORT), tell_detokenizer=True)
        elif isinstance(frame, Finish):  # a stop string ended it, where the text is made (detokenizer or api)
            self._send(self.core.finish(frame.rid, FinishReason.STOP))
        elif isinstance(frame, Heartbeat):
            self._on_heartbeat(frame)
        elif isinstance(frame, ResizeMemory):
            self._on_resize(frame)
        elif isinstance(frame, MemoryResized):
            self._on_resized(frame)
        elif isinstance(frame, ApiAnnounce):
            if frame.address not in self.apis:
                self.log.info("api_announced", api=frame.replica, address=frame.address, engine=frame.engine)
            self.apis[frame.address] = (frame.engine, time.monotonic())
        else:
            self.log.warning("unexpected_frame", frame=type(frame).__name__)
            FRAMES_UNEXPECTED.labels(self.inbox.name).inc()

    def _on_submit(self, submit: Submit) -> None:
        if not self.ready:
            self._reject(submit, 503, "the engine is not ready")
            return
        try:
            grammar = submit.sampling.grammar
            self.core.submit(submit, compiling=grammar is not None)
            if grammar is not None:  # the worker compiles it off the step's path; the request waits for it here
                self.to_worker.send(CompileGrammar(rid=submit.rid, grammar=grammar))
            self.log.info("request_queued", rid=submit.rid, prompt_tokens=len(submit.prompt_ids), max_tokens=submit.max_tokens)
            if submit.trace and self.traces is not None:
                self.traces.submitted(submit)
        except AdmissionError as exc:
            self.log.info("request_rejected", rid=submit.rid, status=exc.status, reason=exc.message)
            self._reject(submit, exc.status, exc.message)

    def _on_compiled(self, frame: GrammarCompiled) -> None:
        if frame.error:
            self._fail([frame.rid], 400, f"the request's grammar did not compile: {frame.error}")
        else:
            self.core.compiled(frame.rid)

    def _reject(self, submit: Submit, status: int, message: str) -> None:
        REJECTED.labels(str(status)).inc()
        kind = ErrorType.INVALID_REQUEST if status == 400 else ErrorType.RATE_LIMIT if status == 429 else ErrorType.SERVER
        self.to_api.send(submit.reply_to, Error(rid=submit.rid, status=status, message=message, type=kind))

    def _send_status(self) -> None:
        """EngineStatus to every api replica heard from within engine_timeout_s (or the configured api)."""
        now, status = time.monotonic(), self.status()
        for address in [a for a, (_, heard) in self.apis.items() if now - heard >= self.config.engine_timeout_s]:
            del self.apis[address]
            self._abort_owned_by(address)
        if self.config.api_address not in self.apis:
            self.to_api.send("", status)
        for address, (engine, _) in self.apis.items():
            status.engine = engine
            self.to_api.send(address, status)

    def _abort_owned_by(self, address: str) -> None:
        """An api replica went silent (killed, or stopped without draining): nobody reads its requests'
        replies any more, so they are aborted rather than left to run to max_tokens."""
        rids = [rid for rid, request in self.core.requests.items() if request.submit.reply_to == address]
        (self.log.warning if rids else self.log.info)("api_lost", address=address, aborted_requests=len(rids))
        for rid in rids:
            self._send(self.core.finish(rid, FinishReason.ABORT), tell_detokenizer=True)

    def _on_result(self, result: StepResult) -> None:
        if result.step not in self.in_flight:
            return  # a step of a worker incarnation that was declared lost
        _, rids = self.in_flight.pop(result.step)
        if not result.error:
            outcome = self.core.on_result(result)
            if self.traces:
                self.traces.stepped(result, outcome.deltas)
            self._send(outcome)
            return
        self.log.error("step_failed", step=result.step, error=result.error, requests=len(rids))
        self._fail(rids, 500, f"the worker failed the step: {result.error}")

    def _on_heartbeat(self, beat: Heartbeat) -> None:
        peer = self.peers.get(beat.process)
        if peer is None:
            return
        lost = None
        if peer.serving and beat.pid != peer.pid:  # restarted between two heartbeats
            lost = f"restarted (pid {peer.pid} -> {beat.pid})"
        elif peer.serving and beat.state == ProcessState.FAILED:  # e.g. a worker whose tensor-parallel rank died
            lost = f"failed: {beat.detail}"
        changed = peer.state != beat.state
        if changed:
            self.log.info("peer_state", peer=beat.process, state=beat.state, detail=beat.detail, pid=beat.pid)
        peer.state, peer.detail, peer.progress, peer.seen, peer.pid = beat.state, beat.detail, beat.progress, time.monotonic(), beat.pid
        if lost is not None:  # after taking the beat: the status sent before the requests' errors says what the peer said
            self._peer_lost(beat.process, lost)
        if not peer.serving:  # once it serves, its sizes change only by a resize, whose answer says them (a heartbeat may lag it)
            self.memory = beat.memory or self.memory
            if beat.kv_blocks and beat.kv_blocks != self.core.pool.num_blocks:
                self._adopt_kv_blocks(beat.kv_blocks)
            draft = self.core.draft_blocks
            if beat.draft_kv_blocks and draft is not None and beat.draft_kv_blocks != draft.pool.num_blocks:
                self._adopt_draft_blocks(beat.draft_kv_blocks)
        peer.serving = peer.serving or beat.state == ProcessState.READY
        if changed and lost is None:  # readiness changes reach the api at once, not at the next periodic status
            self._send_status()

    def _adopt_draft_blocks(self, num_blocks: int) -> None:
        """The worker's draft KV holds ``num_blocks``: the draft pool takes its count, while no request holds draft blocks."""
        if self.core.requests:
            self.log.error("draft_kv_blocks_mismatch", scheduler=self.core.draft_blocks.pool.num_blocks, worker=num_blocks)
            return
        previous = self.core.draft_blocks.pool.num_blocks
        self.core.draft_blocks = DraftBlocks(num_blocks, self.core.draft_blocks.pool.block_size)
        self.log.info("draft_kv_blocks_adopted", previous=previous, num_blocks=num_blocks)

    def _adopt_kv_blocks(self, num_blocks: int) -> None:
        """The worker sized its KV cache itself (from device memory): plan with its count. Only while
        no request holds blocks; the worker reports before it is ready, so none does yet."""
        if self.core.requests:
            self.log.error("kv_blocks_mismatch", scheduler=self.core.pool.num_blocks, worker=num_blocks)
            return
        old = self.core.pool
        self.core.pool = BlockPool(num_blocks, old.block_size, old.enable_prefix_cache)
        self._counted_queries = self._counted_hits = 0  # the new pool counts from zero
        self.log.info("kv_blocks_adopted", previous=old.num_blocks, num_blocks=num_blocks)

    def _on_resize(self, frame: ResizeMemory) -> None:
        """An api asks for a new memory split: every running request is preempted (recomputed later) and released on
        the worker, which then applies the split behind the steps in flight; no plan is made until it answers."""
        if self.resizing is not None:
            self._answer_resize(
                frame, MemoryResized(id=frame.id, status=409, error=f"a memory resize ({self.resizing.id}) is still applying; retry once it is done")
            )
            return
        if not self.ready:
            self._answer_resize(frame, MemoryResized(id=frame.id, status=503, error=f"the engine is not ready ({self.status().detail})"))
            return
        self.resizing = frame
        released = self.core.preempt_all()
        if released:
            PREEMPTIONS.inc(len(released))
            self.to_worker.send(Release(rids=released))
        self.to_worker.send(ResizeMemory(id=frame.id, kv_cache_bytes=frame.kv_cache_bytes, expert_cache_bytes=frame.expert_cache_bytes))
        self.log.info("memory_resize", id=frame.id, kv_cache_bytes=frame.kv_cache_bytes, expert_cache_bytes=frame.expert_cache_bytes, preempted=len(released))
        self._send_status()

    def _on_resized(self, answer: MemoryResized) -> None:
        """The worker applied (or refused) the split: plan with its KV blocks from now on."""
        frame, self.resizing = self.resizing, None
        if frame is None or frame.id != answer.id:
            self.log.warning("memory_resized_unasked", id=answer.id)
            self.resizing = frame
            return
        if answer.split is not None:
            self.memory = answer.split
            if answer.split.kv_blocks != self.core.pool.num_blocks:  # the worker's KV tensors are new: no cached block survives
                old = self.core.pool
                self.core.pool = BlockPool(answer.split.kv_blocks, old.block_size, old.enable_prefix_cache)
                self._counted_queries = self._counted_hits = 0
        self.log.info("memory_resize_done", id=answer.id, status=answer.status, error=answer.error, kv_blocks=self.core.pool.num_blocks)
        self._answer_resize(frame, answer)
        self._send_status()

    def _answer_resize(self, frame: ResizeMemory, answer: MemoryResized) -> None:
        self.to_api.send(frame.reply_to, msgspec.structs.replace(answer, split=self.memory_split()))

    def _check_peers(self) -> None:
        for name, peer in self.peers.items():
            if peer.serving and not peer.alive(self.config.engine_timeout_s):
                peer.state = "lost"
                self._peer_lost(name, f"silent for {self.config.engine_timeout_s:g}s")

    def _peer_lost(self, name: str, why: str) -> None:
        """A process that held request state is gone: every request fails now, none hangs. The api
        hears the status (the peer's state, already taken) before the requests' errors, on one socket."""
        self.peers[name].serving = False
        self.in_flight.clear()
        if self.resizing is not None and name == "worker":
            frame, self.resizing = self.resizing, None
            self._answer_resize(frame, MemoryResized(id=frame.id, status=503, error=f"the worker was lost ({why}) while the resize applied"))
        self.log.error("peer_lost", peer=name, why=why, failed_requests=len(self.core.requests))
        if name == "worker":  # a restarted worker holds none of the cached KV or GDN checkpoints
            self.core.clear_prefix_cache()
        self._send_status()
        self._fail(list(self.core.requests), 503, f"the {name} process was lost ({why}); retry the request")

    def _fail(self, rids: list[str], status: int, message: str) -> None:
        """Ends these requests with an error to their api replica; the worker and detokenizer drop their state of them."""
        owners = {rid: self.core.requests[rid].submit.reply_to for rid in rids if rid in self.core.requests}
        rids = self.core.fail(list(owners))
        if not rids:
            return
        FINISHED.labels(FinishReason.ERROR.value).inc(len(rids))
        if self.traces:
            self.traces.failed(rids, message)
        for rid in rids:
            self.to_api.send(owners[rid], Error(rid=rid, status=status, message=message))
        self.to_worker.send(Release(rids=rids))
        if self.to_detokenizer is not None:
            self.to_detokenizer.send(TokenBatch(deltas=[TokenDelta(rid=rid, finish=FinishReason.ERROR) for rid in rids]))

    def _send(self, outcome: Outcome, tell_detokenizer: bool = False) -> None:
        """Releases the ended requests' worker state. The text maker has their tokens from the worker and
        ends them at the same token by the same rule (shared/stream_contract.py), or ended them itself (a stop
        string): only an ending from outside (an abort) is news to a detokenizer."""
        if outcome.released:
            self.to_worker.send(Release(rids=outcome.released))
        if tell_detokenizer and outcome.deltas and self.to_detokenizer is not None:
            self.to_detokenizer.send(TokenBatch(deltas=outcome.deltas))
        if self.traces:
            self.traces.ended(outcome.deltas)
        for delta in outcome.deltas:
            if delta.finish:
                FINISHED.labels(delta.finish).inc()
                self.log.info("request_finished", rid=delta.rid, reason=delta.finish)

    def _count_prefix_lookups(self) -> None:
        pool = self.core.pool
        if pool.queries != self._counted_queries:
            PREFIX_QUERIES.inc(pool.queries - self._counted_queries)
            PREFIX_HITS.inc(pool.hits - self._counted_hits)
            self._counted_queries, self._counted_hits = pool.queries, pool.hits
        checkpoints = self.core.checkpoints
        if checkpoints is not None and checkpoints.restored != self._counted_restores:
            CHECKPOINTS_USED.inc(checkpoints.restored - self._counted_restores)
            self._counted_restores = checkpoints.restored

    # Introspection. ----------------------------------------------------------------------

    def instrumentation(self) -> dict:
        core, pool = self.core, self.core.pool
        return {
            "process": "scheduler",
            "pid": os.getpid(),
            "model": self.model.path,
            "model_revision": self.model.revision(),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            "block_size": pool.block_size,
            "kv_cache_tokens": pool.num_blocks * pool.block_size,
            "memory": None if (split := self.memory_split()) is None else {**msgspec.structs.asdict(split), "kv_cache_bytes": split.kv_cache_bytes},
            "max_num_seqs": core.max_num_seqs,
            "max_num_batched_tokens": core.max_num_batched_tokens,
            "mixed_step": {
                "target_ms": self.config.mixed_step_target_ms,
                "ms_per_token": None if core.step_cost.seconds_per_token is None else round(core.step_cost.seconds_per_token * 1000, 4),
                "token_cap": core.step_cost.token_cap(),
            },
            "decode_plan": {
                "target_ms": self.config.decode_plan_ms,
                "ms_per_step": None if core.decode_runs.seconds_per_step is None else round(core.decode_runs.seconds_per_step * 1000, 4),
                "steps": core.decode_runs.steps(),
            },
            "speculative": {
                "method": self.config.speculative_method,
                "num_speculative_tokens": core.speculation.num_tokens,
                "max_batch": core.speculation.max_batch,
                **core.speculation.describe(),
                **(core.draft_blocks.describe() if core.draft_blocks is not None else {}),
            }
            if core.speculation.enabled
            else None,
            "max_waiting": core.max_waiting,
            "pipeline_depth": self.config.pipeline_depth,
            "running": len(core.running),
            "waiting": len(core.waiting),
            "preemptions": core.num_preemptions,
            "prefix_cache": {
                "enabled": pool.enable_prefix_cache,
                "disabled_reason": self.prefix_cache_off_reason,
                "cached_blocks": pool.num_cached,
                "queries": pool.queries,
                "hits": pool.hits,
                **(
                    {
                        "gdn_checkpoints": {
                            "total": core.checkpoints.num_slots,
                            "used": len(core.checkpoints),
                            "saved": core.checkpoints.saved,
                            "restored": core.checkpoints.restored,
                            "interval": core.checkpoint_interval,
                        }
                    }
                    if core.checkpoints is not None
                    else {}
                ),
            },
            "gdn_state_slots": {"total": core.slots.num_slots, "used": core.slots.num_used} if core.slots else None,
            "peers": {name: {"state": p.state, "detail": p.detail, "progress": p.progress} for name, p in self.peers.items()},
            "addresses": {
                "inbox": self.inbox.address,
                "worker": self.to_worker.address,
                **({"detokenizer": self.to_detokenizer.address} if self.to_detokenizer is not None else {}),
                "api": self.to_api.default.address,
                "apis": {address: engine for address, (engine, _) in self.apis.items()},
            },
        }

    def health(self) -> tuple[int, dict]:
        status = self.status()
        return (200 if status.state == EngineState.READY else 503), {"state": status.state, "detail": status.detail}


def main(argv: list[str] | None = None) -> None:
    from shared.logging import setup_logging

    config = StackConfig.from_argv(argv, "tokenyard scheduler")
    log = setup_logging("scheduler", config.log_level, config.log_format)
    if (cpus := keep_off_worker_core(config)) is not None:
        log.info("cpu_placement", cpus=sorted(cpus))
    loop = SchedulerLoop(config, log)
    start_metrics_server(config.metrics_host, config.metrics_port("scheduler"), loop.instrumentation, loop.health, config.metric_labels)
    PROCESS_UP.labels("scheduler").set(1)
    log.info(
        "scheduler_started", inbox=loop.inbox.address, kv_blocks=loop.core.pool.num_blocks, gdn_state_slots=loop.core.slots.num_slots if loop.core.slots else 0
    )
    if loop.prefix_cache_off_reason and config.enable_prefix_cache:
        log.warning("prefix_cache_disabled", reason=loop.prefix_cache_off_reason)
    loop.run()
