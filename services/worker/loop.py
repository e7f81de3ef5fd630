"""The worker process: loads the model, warms it up, then runs step plans in the order they arrive.

After each step it sends the sampled tokens to the process that makes their text (or gathers them over a few steps:
token_stream.py); after each plan (one step, or a run of decode steps: plan_runs.py) the result to the
scheduler.

A heartbeat thread reports loading progress and liveness to the scheduler on its own
socket (ZMQ sockets are not shared across threads), so the scheduler hears from the
worker while the main thread is inside a long forward pass (every kernel releases the GIL while it computes).

With tensor parallelism, rank 0 (this loop) fails fast when another rank dies: it reports
``failed`` with the reason at once (the scheduler fails every request it holds), answers any
step with that error, and exits after ``RANK_LOST_EXIT_S`` so that its launcher or orchestrator
restarts the ranks together; a follower whose leader dies exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import msgspec
import structlog
import torch
import zmq
from prometheus_client import Counter, Gauge, Histogram

from services.worker.device import cpu_name, describe_device, device_memory, resolve_device, resolve_dtype
from services.worker.device_memory import GRAPH_POOL_RESERVE, ActivationProfile, KVBudget, MemoryPlan, gdn_bytes_per_slot, plan_memory
from services.worker.plan_runs import PlanRuns
from services.worker.token_stream import OwnerRoutes, TokenStream
from services.worker.traces import ForwardSpans
from shared.config import StackConfig
from shared.cpu_placement import take_worker_core
from shared.frames import (
    CompileGrammar,
    GrammarCompiled,
    Heartbeat,
    MemoryResized,
    MemorySplit,
    Process,
    ProcessState,
    Release,
    ResizeMemory,
    SamplingParams,
    Slice,
    StepPlan,
    StepResult,
)
from shared.metrics import FRAMES_UNEXPECTED, PREFIX, PROCESS_UP, start_metrics_server
from shared.model_info import kv_cache_blocks, load_model_info, resolve_kv_cache_dtype
from shared.tracing import tracer_for
from shared.transport import Curve, Inbox, Outbox, ReplyOutboxes

FORWARD_TIME = Histogram(
    f"{PREFIX}worker_forward_seconds",
    "Wall time of one step's forward pass and sampling",
    ["kind"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12),
)
BATCH_SIZE = Histogram(f"{PREFIX}worker_batch_size", "Requests in one step", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
STEP_TOKENS = Histogram(f"{PREFIX}worker_step_tokens", "Tokens computed in one step", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048))
STEPS = Counter(f"{PREFIX}worker_steps", "Steps run", ["kind"])
STEP_ERRORS = Counter(f"{PREFIX}worker_step_errors", "Steps that raised")
DECODE_STEPS = Counter(f"{PREFIX}worker_decode_steps", "Decode-only steps, replayed from a CUDA graph or run eagerly", ["mode"])
for _mode in ("graph", "eager"):  # both series exist from the start, at 0
    DECODE_STEPS.labels(_mode)
DEVICE_MEMORY_USED = Gauge(f"{PREFIX}worker_device_memory_used_bytes", "Device memory held by this worker's tensors (CUDA)")
DEVICE_MEMORY_RESERVED = Gauge(f"{PREFIX}worker_device_memory_reserved_bytes", "Device memory reserved by this worker's caching allocator (CUDA)")
RANK_LOST_EXIT_S = 1.0  # how long rank 0 reports a lost rank (health, heartbeats) before it exits
EXIT_RANK_LOST = 3  # the exit code of a rank whose peer died (the launcher restarts the group)


def step_kind(plan: StepPlan) -> str:
    decodes = sum(1 for s in plan.slices if not s.token_ids)
    if decodes == len(plan.slices):
        return "decode"
    return "prefill" if decodes == 0 else "mixed"


class WorkerLoop:
    def __init__(self, config: StackConfig, log: structlog.stdlib.BoundLogger) -> None:
        self.config = config
        self.log = log
        self.model = load_model_info(config.model)
        # Known once load() has resolved the device and the KV dtype; heartbeats carry 0 until then,
        # which the scheduler does not adopt (a byte budget in fp32 terms would be adopted, then replaced).
        self.num_blocks = self.draft_kv_blocks = 0
        self.ctx = zmq.Context()
        self.curve = Curve.from_file(config.curve_key_file)
        self.inbox = Inbox(self.ctx, config.worker_address, "worker_inbox", self.curve)
        self.to_scheduler = Outbox(self.ctx, config.scheduler_address, "worker_to_scheduler", self.curve)
        # Where the sampled tokens go: the detokenizer, or each request's api where that detokenizes.
        self.owner_routes: OwnerRoutes | None = None
        if config.detokenize_in == "api":
            self.owner_routes = OwnerRoutes(ReplyOutboxes(self.ctx, config.api_address, "worker_to_api", self.curve))
            self.tokens_to: Outbox = self.owner_routes.outboxes.default
        else:
            self.tokens_to = Outbox(self.ctx, config.detokenizer_address, "worker_to_detokenizer", self.curve)
        self.runner = None
        self.state = ProcessState.LOADING
        self.detail = ""
        self.progress = 0.0
        self.stopping = False
        self.steps_run = 0
        self.resizing = False  # a ResizeMemory is being applied
        self.device: torch.device | None = None
        self.device_info: dict = {"type": "cpu", "name": cpu_name(), "cores": os.cpu_count()}
        self.memory_plan: MemoryPlan | None = None
        self.tp = None  # the tensor-parallel group, when this is rank 0 of several
        self.rank_lost = ""  # why the group broke, once a rank is gone
        self.worker_core: int | None = None  # the CPU the main thread keeps to itself (shared/cpu_placement.py)
        self.plan_runs = PlanRuns(self._execute)
        # Spans of traced prefill chunks; None without --otlp-traces-endpoint: no tracer call then.
        tracer = tracer_for(config.otlp_traces_endpoint, "tokenyard-worker")
        self.forward_spans = ForwardSpans(tracer) if tracer is not None else None
        send_tokens = self.owner_routes.send if self.owner_routes is not None else self.tokens_to.send
        self.tokens = TokenStream(send_tokens, config.stream_interval, self.plan_runs.stop_token_ids)

    def _heartbeat(self) -> Heartbeat:
        memory = self.memory_split() if self.state == ProcessState.READY else None
        return Heartbeat(
            process=Process.WORKER,
            pid=os.getpid(),
            state=self.state,
            detail=self.detail,
            progress=self.progress,
            kv_blocks=self.num_blocks,
            draft_kv_blocks=self.draft_kv_blocks,
            memory=memory,
        )

    def memory_split(self) -> MemorySplit | None:
        if self.runner is None:
            return None
        split = self.runner.memory_split()
        return msgspec.structs.replace(split, applying=True) if self.resizing else split

    def _resize(self, frame: ResizeMemory) -> MemoryResized:
        """Applies a new memory split (the scheduler released every request first); a split the worker cannot take is a 400."""
        self.tokens.flush()
        self.resizing = True
        started = time.perf_counter()
        try:
            self.runner.resize_memory(frame.kv_cache_bytes, frame.expert_cache_bytes)
        except ValueError as exc:
            self.log.warning("memory_resize_refused", why=str(exc))
            return MemoryResized(id=frame.id, split=self.runner.memory_split(), status=400, error=str(exc))
        except Exception as exc:
            self.log.exception("memory_resize_failed")
            return MemoryResized(id=frame.id, split=self.runner.memory_split(), status=500, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.num_blocks = self.runner.num_blocks
            self.resizing = False
        split = self.runner.memory_split()
        self.log.info(
            "memory_resized", kv_blocks=split.kv_blocks, kv_cache_bytes=split.kv_cache_bytes, expert_cache_bytes=split.expert_cache_bytes,
            expert_slots=split.expert_slots, seconds=round(time.perf_counter() - started, 3),
        )  # fmt: skip
        return MemoryResized(id=frame.id, split=split)

    def _heartbeats(self) -> None:
        outbox = Outbox(self.ctx, self.config.scheduler_address, "worker_heartbeat", self.curve)
        while not self.stopping:
            outbox.send(self._heartbeat())
            time.sleep(self.config.heartbeat_s)
        outbox.close()

    def _on_rank_lost(self, why: str) -> None:
        """From the liveness thread: the group is broken for good, so report it at once, then exit.

        The main thread may be blocked in a collective that never returns (NCCL waits for the
        dead rank until its timeout), so this thread ends the process itself.
        """
        if self.stopping:
            return
        self._mark_rank_lost(why)
        self.log.error("tensor_parallel_rank_lost", why=why, exit_in_s=RANK_LOST_EXIT_S)
        outbox = Outbox(self.ctx, self.config.scheduler_address, "worker_rank_lost", self.curve)
        outbox.send(self._heartbeat())  # now, not at the next heartbeat: the scheduler fails the requests
        time.sleep(RANK_LOST_EXIT_S)
        outbox.close()
        sys.stderr.flush()
        os._exit(EXIT_RANK_LOST)

    def _mark_rank_lost(self, why: str) -> None:
        self.rank_lost = why
        self.state, self.detail = ProcessState.FAILED, f"{why}; the worker exits to be restarted with its ranks"
        PROCESS_UP.labels("worker").set(0)

    def load(self) -> None:
        from services.worker.runner import ModelRunner, RunnerConfig

        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.device = device = resolve_device(self.config.device)
        self.device_info = describe_device(device)
        cuda = device.type == "cuda"
        self.detail = f"loading weights from {self.model.path} onto {device}"
        read_ahead(self.model.path)
        started = time.perf_counter()
        tp = None
        if self.config.tensor_parallel_size > 1:
            from services.worker.tensor_parallel import init_group

            self.detail = f"waiting for {self.config.tensor_parallel_size - 1} more tensor-parallel ranks at {self.config.tensor_parallel_init}"
            self.tp = tp = init_group(0, self.config.tensor_parallel_size, self.config.tensor_parallel_init)
            tp.liveness.watch(self._on_rank_lost)
            self.detail = f"loading weights from {self.model.path} (rank 0 of {tp.size})"
        size_kv = self._kv_budget(torch.cuda.mem_get_info(device)[0]) if cuda and self.config.gpu_memory_utilization > 0 else None
        kv_dtype = resolve_kv_cache_dtype(self.config.kv_cache_dtype, device.type, resolve_dtype(self.config.dtype, device))
        self.num_blocks = kv_cache_blocks(self.model, self.config.kv_cache_tokens, self.config.kv_cache_bytes, self.config.block_size, kv_dtype)
        budget = KVBudget(size_kv, profile_tokens=self.config.max_num_batched_tokens) if size_kv else None
        self.runner = ModelRunner(RunnerConfig.of(self.config, self.num_blocks, str(device)), tp=tp, budget=budget)
        self.num_blocks = self.runner.num_blocks  # the scheduler adopts it from the heartbeats
        self.draft_kv_blocks = self.runner.draft_kv_blocks  # and its draft pool this
        if self.runner.expert_cache is not None:
            facts = self.runner.expert_cache.describe()
            self.log.info(
                "expert_cache",
                **{
                    key: facts[key]
                    for key in ("bytes", "slots", "experts", "store", "store_reads", "fill_policy", "streamed_prefill", "prefetch", "policy", "cpu_experts")
                    if key in facts
                },
            )
        if cuda:
            DEVICE_MEMORY_USED.set_function(lambda: torch.cuda.memory_allocated(device))
            DEVICE_MEMORY_RESERVED.set_function(lambda: torch.cuda.memory_reserved(device))
        loaded = time.perf_counter()
        self.state = ProcessState.WARMING
        self.warm_up()
        if self.stopping:
            return
        if self.runner.graphs is not None:
            self.detail = f"capturing CUDA graphs for decode batches {self.runner.graphs.buckets}"
            try:
                self.runner.capture_graphs(stop=lambda: self.stopping)
            except Exception:  # serving goes on eagerly: graphs are an optimisation
                self.log.exception("cuda_graph_capture_failed")
                self.runner.graphs = None
            if self.stopping:
                return
        if device.type == "cpu" and tp is None:
            self.worker_core = take_worker_core(self.config)  # once warm: every helper thread exists now
            if self.worker_core is not None:
                self.log.info("cpu_placement", worker_core=self.worker_core)
        self.log.info("worker_ready", load_s=round(loaded - started, 2), warmup_s=round(time.perf_counter() - loaded, 2), kv_blocks=self.num_blocks)
        self.state, self.detail, self.progress = ProcessState.READY, "", 1.0
        PROCESS_UP.labels("worker").set(1)

    def _kv_budget(self, free_before_load: int):
        """The ``size_kv_cache`` of the runner: the memory plan, from what loading the weights left free and
        the activation peak of the runner's profile step (run before this, its memory handed back)."""

        def size(model, profile: ActivationProfile | None, state_slots: int) -> int:
            free_after, total = torch.cuda.mem_get_info(self.device)
            per_token = model.num_kv_layers * 2 * model.num_kv_heads * model.head_dim * model.dtype.itemsize  # attention layers only
            graph_pool = GRAPH_POOL_RESERVE if self.config.cuda_graph_max_batch > 0 else 0
            state_bytes = gdn_bytes_per_slot(model.gdn_shape, model.dtype)  # hybrid families: one slot per running request (+ the dummy)
            self.memory_plan = plan_memory(
                total, free_before_load, free_after, self.config.gpu_memory_utilization, profile, graph_pool, per_token, self.config.block_size,
                state_bytes, state_slots,
            )  # fmt: skip
            self.log.info("kv_cache_sized", **self.memory_plan.describe())
            return self.memory_plan.num_blocks  # the runner keeps its dummy block (graphs) out of the scheduler's count

        return size

    def warm_up(self) -> None:
        """One prefill at each length of ``warmup_lengths``, each with a decode step, so no first request pays a one-off cost.

        A failure is logged and serving goes on: warm-up is an optimisation, not a gate.
        """
        ladder = warmup_lengths(self.config.max_num_batched_tokens, self.num_blocks * self.config.block_size, self.device.type)
        block_size = self.config.block_size
        try:
            for i, length in enumerate(ladder):
                if self.stopping:  # SIGTERM during warm-up: stop now rather than when the ladder ends
                    return
                self.detail, self.progress = f"warm-up prefill {i + 1}/{len(ladder)} ({length} tokens)", i / len(ladder)
                blocks = list(range(-(-(length + 1) // block_size)))
                first = Slice(
                    rid="warmup", start=0, num_tokens=length, token_ids=[0] * length, new_blocks=blocks, sampling=SamplingParams(temperature=0), slot=0
                )
                self.runner.execute(StepPlan(step=-1, slices=[first]))
                self.runner.execute(StepPlan(step=-1, slices=[Slice(rid="warmup", start=length, num_tokens=1, slot=0)]))
                self.runner.release(["warmup"])
        except Exception:
            self.runner.release(["warmup"])
            self.log.exception("warmup_failed", length=length)
        # xgrammar's tokenizer info for structured outputs (~0.2 s for a 49k vocabulary, ~2 s with its first
        # tokenizer import): built here, since once the worker serves nothing can pause for it.
        try:
            self.detail = "warm-up: the tokenizer info for structured outputs"
            self.runner.structured  # noqa: B018 - built on first access
        except ValueError as exc:  # a model without a tokenizer: requests with a schema are refused plans
            self.log.warning("structured_outputs_unavailable", why=str(exc))

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()
        try:
            self.load()
        except Exception as exc:
            self.state, self.detail = ProcessState.FAILED, f"{type(exc).__name__}: {exc}"
            self.log.exception("worker_load_failed")
            while not self.stopping:  # stay up so the failure is visible in /health and heartbeats
                time.sleep(0.2)
            return
        while not self.stopping:
            for frame in self.inbox.recv(5 if self.grammars_compiling else 200):  # a compiled grammar is told at once
                if isinstance(frame, StepPlan):
                    self.to_scheduler.send(self.plan_runs.run(frame, self.tokens.add))
                elif isinstance(frame, CompileGrammar):
                    self._compile_ahead(frame)
                elif isinstance(frame, ResizeMemory):
                    self.to_scheduler.send(self._resize(frame))
                elif isinstance(frame, Release):
                    self.tokens.flush()
                    self.plan_runs.release(frame.rids)
                    if self.owner_routes is not None:
                        self.owner_routes.release(frame.rids)
                    if not self.rank_lost:  # a broken group takes no more collectives
                        self.runner.release(frame.rids)
                    self.log.info("requests_released", rids=frame.rids)
                else:
                    self.log.warning("unexpected_frame", frame=type(frame).__name__)
                    FRAMES_UNEXPECTED.labels(self.inbox.name).inc()
            self.tokens.flush()  # nothing is queued: tokens gathered over a stream interval go now
            if self.grammars_compiling:
                for rid, error in self.runner.structured.compiled():
                    self.to_scheduler.send(GrammarCompiled(rid=rid, error=error))
        self._close()

    @property
    def grammars_compiling(self) -> bool:
        return self.runner.sampler.compiling

    def _compile_ahead(self, frame: CompileGrammar) -> None:
        """Compiles a queued request's grammar on the compile thread; the scheduler admits the request once told."""
        try:
            self.runner.structured.compile_ahead(frame.rid, frame.grammar)
        except ValueError as exc:  # no tokenizer: structured outputs are unavailable
            self.to_scheduler.send(GrammarCompiled(rid=frame.rid, error=str(exc)))

    def _close(self) -> None:
        """Stops the follower ranks (they leave first, so none takes the stop for the leader's death)."""
        if self.tp is None:
            self.runner.close()
            return
        self.tp.liveness.stop()  # followers leaving from now on is the stop, not a failure
        try:
            self.runner.close()
        except RuntimeError as exc:  # a follower was already gone
            self.log.warning("tensor_parallel_stop_failed", error=str(exc))
        self.tp.liveness.close(wait_s=5.0)

    def _execute(self, plan: StepPlan) -> StepResult:
        for s in plan.slices:
            if s.sampling is not None:  # a request's first slice since (re)admission
                self.log.info("request_started", rid=s.rid, step=plan.step, start=s.start, tokens=s.num_tokens)
        if self.rank_lost:
            return StepResult(step=plan.step, sampled=[], error=self.rank_lost)
        kind = step_kind(plan)
        started = time.perf_counter()
        try:
            result = self.runner.execute(plan)
            if kind == "decode":
                DECODE_STEPS.labels("graph" if self.runner.last_step_graphed else "eager").inc()
        except Exception as exc:  # a bad plan must not take the worker down
            STEP_ERRORS.inc()
            # A collective that failed because a rank died says so in the peer's terms, not gloo's.
            lost = self.tp.liveness.dead_peer(timeout_s=0.5) if self.tp is not None and isinstance(exc, RuntimeError) else None
            if lost is not None:  # the liveness thread reports it too, maybe later than this step's error
                self.log.error("step_failed", step=plan.step, why=lost)
                self._mark_rank_lost(lost)
                self.to_scheduler.send(self._heartbeat())  # ahead of the error on this socket: /health says why first
                return StepResult(step=plan.step, sampled=[], error=lost)
            self.log.exception("step_failed", step=plan.step)
            self.runner.release([s.rid for s in plan.slices])
            return StepResult(step=plan.step, sampled=[], error=f"{type(exc).__name__}: {exc}")
        forward_s = time.perf_counter() - started
        FORWARD_TIME.labels(kind).observe(forward_s)
        STEPS.labels(kind).inc()
        BATCH_SIZE.observe(len(plan.slices))
        STEP_TOKENS.observe(sum(s.num_tokens for s in plan.slices))
        self.steps_run += 1
        if self.forward_spans is not None:
            self.forward_spans.stepped(plan, kind, forward_s)
        return result

    def instrumentation(self) -> dict:
        info = {
            "process": "worker",
            "pid": os.getpid(),
            "state": self.state,
            "detail": self.detail,
            "model": self.model.path,
            "model_revision": self.model.revision(),
            "device": {**self.device_info, **(device_memory(self.device) if self.device is not None else {})},
            "memory_plan": None if self.memory_plan is None else self.memory_plan.describe(),
            "torch_threads": torch.get_num_threads(),
            "worker_core": self.worker_core,
            "torch_version": torch.__version__,
            "kv_blocks_total": self.num_blocks,
            "block_size": self.config.block_size,
            "memory": None if (split := self.memory_split()) is None else {**msgspec.structs.asdict(split), "kv_cache_bytes": split.kv_cache_bytes},
            "max_num_seqs": self.config.max_num_seqs,
            "steps_run": self.steps_run,
            "stream_interval": self.config.stream_interval,
            "warmup_lengths": warmup_lengths(
                self.config.max_num_batched_tokens, self.num_blocks * self.config.block_size, self.device.type if self.device else "cpu"
            ),
            "addresses": {"inbox": self.inbox.address, "scheduler": self.to_scheduler.address, self.config.detokenize_in: self.tokens_to.address},
        }
        if self.tp is not None:
            info["tensor_parallel"] = {"size": self.tp.size, "init_method": self.config.tensor_parallel_init, "peers": self.tp.liveness.describe()}
        if self.runner is not None:
            info["runner"] = self.runner.describe()
        return info

    def health(self) -> tuple[int, dict]:
        return (200 if self.state == ProcessState.READY else 503), {"state": self.state, "detail": self.detail, "progress": round(self.progress, 3)}


WARMUP_MAX_TOKENS = 2048  # past this a prefill's one-off costs are lost in its own run time
CPU_WARMUP_LENGTHS = (1, 2, 5, 9, 33)  # one past each row limit: BLOCK_QUANT_MAX_ROWS (4), SPLIT_MAX_ROWS (8), the takeover pool's (32)


def warmup_lengths(budget: int, capacity: int, device_type: str = "cpu") -> list[int]:
    """The prefill lengths warm-up runs, up to the step budget (and the KV capacity).

    On the CPU, one length past each row count where the kernels change path (few-row products, the split
    products, the takeover pool): a first call of a new length costs there no more than a few milliseconds.
    On a GPU, short lengths, then powers of two and their neighbours: each shape may compile kernels.
    """
    limit = min(budget, capacity - 1, WARMUP_MAX_TOKENS)
    if device_type == "cpu":
        return sorted({min(n, limit) for n in CPU_WARMUP_LENGTHS})
    lengths = {1, 2, 3, 4, 5, 6, 7, limit}
    power = 8
    while power <= limit:
        lengths |= {power - 1, power, power + 1}
        power *= 2
    return sorted(n for n in lengths if n <= limit)


def read_ahead(model_path: str) -> None:
    """Asks the kernel to start reading the weights now, so loading (and first requests) don't fault them in."""
    files = [model_path] if os.path.isfile(model_path) else [os.path.join(model_path, name) for name in os.listdir(model_path)]
    for path in files:
        if path.endswith((".safetensors", ".gguf")) and hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


def run_follower(config: StackConfig, log: structlog.stdlib.BoundLogger) -> None:
    """A tensor-parallel rank > 0: joins the group, loads its shard, runs what rank 0 broadcasts.

    Its life is rank 0's: it ignores SIGINT and SIGTERM (a Ctrl-C reaches every process of the
    terminal; stopping a follower first would look like its death to rank 0), stops when rank 0
    sends stop, and exits at once, with ``EXIT_RANK_LOST``, when rank 0 is gone.
    """
    from services.worker.runner import ModelRunner, RunnerConfig
    from services.worker.tensor_parallel import init_group

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    rank, size = config.tensor_parallel_rank, config.tensor_parallel_size
    tp = init_group(rank, size, config.tensor_parallel_init)

    def leader_lost(why: str) -> None:
        log.error("tensor_parallel_leader_lost", rank=rank, why=why)
        sys.stderr.flush()
        os._exit(EXIT_RANK_LOST)

    tp.liveness.watch(leader_lost)
    model = load_model_info(config.model)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, "cpu", resolve_dtype(config.dtype, torch.device("cpu")))
    num_blocks = kv_cache_blocks(model, config.kv_cache_tokens, config.kv_cache_bytes, config.block_size, kv_dtype)
    runner = ModelRunner(RunnerConfig.of(config, num_blocks), tp=tp)
    log.info("worker_rank_ready", rank=rank, size=size)
    try:
        runner.follow()
    except RuntimeError:  # a collective broke; when the leader is why, that can reach us before the watcher's poll does
        why = tp.liveness.dead_peer(timeout_s=5.0)
        if why is None:
            raise
        leader_lost(why)
    tp.liveness.close()  # before the leader closes its end, which it waits for
    log.info("worker_rank_stopping", rank=rank)


def main(argv: list[str] | None = None) -> None:
    from shared.logging import setup_logging

    config = StackConfig.from_argv(argv, "tokenyard worker")
    if not 0 <= config.tensor_parallel_rank < config.tensor_parallel_size:
        raise SystemExit(f"--tensor-parallel-rank {config.tensor_parallel_rank} is outside 0..{config.tensor_parallel_size - 1}")
    if config.tensor_parallel_rank > 0:
        run_follower(config, setup_logging(f"worker-rank{config.tensor_parallel_rank}", config.log_level, config.log_format))
        return
    log = setup_logging("worker", config.log_level, config.log_format)
    loop = WorkerLoop(config, log)
    start_metrics_server(config.metrics_host, config.metrics_port("worker"), loop.instrumentation, loop.health, config.metric_labels)
    log.info("worker_started", inbox=loop.inbox.address, model=config.model)
    loop.run()
