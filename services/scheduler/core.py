"""The scheduling state machine, free of sockets: admit, plan steps, take results, finish.

A step's token budget goes first to running decodes (one token each), then to the
prefill chunks of running requests, then to new admissions; so decodes never stall
behind a long prompt; with a target step time (step_cost.py), a step that carries
decodes holds only the prefill that the target fits. Blocks are allocated as positions are
scheduled, never for a request's whole max_tokens up front; when a decode finds no free block, the most
recently admitted running request is preempted and later recomputed. Full blocks enter
the prefix cache as soon as their KV is scheduled; an admission starts after the longest
cached prefix of its tokens. For a hybrid (GDN) model each running request also holds one
state slot, taken at admission and given back when it finishes or is preempted; every slice
names it. Its prefix cache (with a ``CheckpointPool``) keeps GDN state checkpoints beside the KV: a
prefill chunk saves the state at each checkpoint position it passes (every ``checkpoint_interval``
tokens and at the blocks where the prompt's chat messages end, ``Submit.anchors``, rounded down to
whole blocks), and an admission resumes after the longest cached prefix that ends at a checkpoint,
its first slice restoring that checkpoint into the request's own slot. With a draft model
(``--speculative-method draft``) a speculating request also holds draft KV blocks (draft_blocks.py),
cut back and given back with its own.

While nothing waits or prefills, a plan of decodes alone may run several decode steps
(decode_runs.py), its result arriving once for them all.

Pipelining: plans may be sent before earlier results are back. A decode slice carries
no token (the worker feeds back its own last sample), so ``num_scheduled`` runs ahead
of the tokens known here, and a token that arrives for a finished request is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from services.scheduler.decode_runs import DecodeRuns
from services.scheduler.draft_blocks import DraftBlocks
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.requests import Phase, Request
from services.scheduler.speculation import Speculation, blocks_kept
from services.scheduler.state_slots import CheckpointPool, SlotPool
from services.scheduler.step_cost import StepCost
from shared.frames import FinishReason, Sampled, Slice, StepPlan, StepResult, Submit, TokenDelta
from shared.stream_contract import open_stream


class AdmissionError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Outcome:
    """What a scheduler event produced: the requests' new tokens and endings (the text maker hears
    the tokens from the worker and ends requests by the same rule; only endings from outside reach a
    detokenizer from the scheduler), and the worker-side state to drop."""

    deltas: list[TokenDelta] = field(default_factory=list)
    released: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_waiting: int,
        slots: SlotPool | None = None,
        mixed_step_target_s: float = 0.0,
        decode_plan_s: float = 0.0,
        checkpoints: CheckpointPool | None = None,
        checkpoint_interval: int = 512,
        speculation: Speculation | None = None,
        draft_blocks: DraftBlocks | None = None,
    ) -> None:
        self.slots = slots  # GDN state slots: hybrid models only
        self.checkpoints = checkpoints  # GDN state checkpoints: hybrid models with a prefix cache only
        self.pool = pool
        self.checkpoint_interval = -(-checkpoint_interval // pool.block_size) * pool.block_size
        self._step = 0  # the plan being made
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.step_cost = StepCost(mixed_step_target_s)  # sizes the prefill of steps that carry decodes
        self.decode_runs = DecodeRuns(decode_plan_s)  # how many steps a plan of decodes alone runs
        self.speculation = speculation or Speculation()  # which decodes verify proposed tokens (speculation.py)
        self.draft_blocks = draft_blocks  # a draft model's KV blocks: speculative_method draft only
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._released: list[str] = []  # preempted since the last take_released()

    @property
    def pool(self) -> BlockPool:
        return self._pool

    @pool.setter
    def pool(self, pool: BlockPool) -> None:
        """A hybrid model's checkpoints follow the KV cache they extend: a new pool starts them over."""
        self._pool = pool
        checkpoints = self.checkpoints
        if checkpoints is not None:
            checkpoints.clear()
            pool.on_evict, pool.retains, checkpoints.on_uncovered = checkpoints.dropped_with, checkpoints.covers, pool.demote

    def clear_prefix_cache(self) -> None:
        """Forgets every cached block and checkpoint (the worker that held them is gone)."""
        self.pool.clear()
        if self.checkpoints is not None:
            self.checkpoints.clear()

    # Admission. ----------------------------------------------------------------------

    def submit(self, submit: Submit, compiling: bool = False) -> None:
        """Queues the request; with ``compiling`` it is admitted only once ``compiled`` (its grammar)."""
        if submit.rid in self.requests:
            raise AdmissionError(400, f"request id {submit.rid!r} is already in use")
        capacity = self.pool.num_blocks * self.pool.block_size
        if len(submit.prompt_ids) + submit.max_tokens > capacity:
            raise AdmissionError(
                400,
                f"the request needs {len(submit.prompt_ids) + submit.max_tokens} tokens of KV cache "
                f"({len(submit.prompt_ids)} prompt + {submit.max_tokens} max_tokens) but the whole cache holds {capacity}",
            )
        if len(self.waiting) >= self.max_waiting:
            raise AdmissionError(429, f"the engine's waiting queue is full ({self.max_waiting} requests); retry later")
        request = Request(submit=submit, compiling=compiling)
        if self.checkpoints is not None:
            size = self.pool.block_size
            request.anchor_positions = sorted({a // size * size for a in (*submit.anchors, len(submit.prompt_ids)) if a >= size})
        self.requests[submit.rid] = request
        self.waiting.append(request)

    def compiled(self, rid: str) -> None:
        """The request's grammar is compiled: it may be admitted."""
        if rid in self.requests:
            self.requests[rid].compiling = False

    # Planning. -----------------------------------------------------------------------

    def plan(self, step: int) -> StepPlan:
        self._step = step
        slices: list[Slice] = []
        budget = self.max_num_batched_tokens
        drafts = self.speculation.drafts(self.running)
        decode_steps = 1 if drafts else self._decode_steps()
        for request in list(self.running):
            if budget == 0 or len(slices) == self.max_num_seqs:
                break
            if request.phase is Phase.RUNNING and not request.prefilling and self._wants_decode(request):
                draft = min(drafts.get(request.rid, 0), budget - 1)
                if request.verifying or (draft and request.pending_samples):
                    continue  # a verify waits for the tokens in flight, and is waited for: its positions are known from its result
                if draft and self.draft_blocks is not None and not self.draft_blocks.grow(request, request.num_scheduled + 1 + draft):
                    draft = 0  # no room for its draft's KV: a plain decode this step
                if self._grow_for_decode(request, decode_steps + draft):
                    slices.append(self._slice(request, 1 + draft, decode_steps=decode_steps))
                    request.verifying = draft
                    budget -= 1 + draft
        decodes = len(slices)
        budget = prefill_budget = self.step_cost.prefill_budget(budget, decodes)
        for request in self.running:
            if budget == 0 or len(slices) == self.max_num_seqs:
                break
            if request.prefilling and request.pending_samples == 0:
                budget -= self._schedule_prefill(request, budget, slices)
        while self.waiting and budget > 0 and len(slices) < self.max_num_seqs and len(self.running) < self.max_num_seqs:
            request = next((r for r in self.waiting if not r.compiling), None)  # one whose grammar compiles holds back no other
            if request is None or request.pending_samples:  # a preempted request whose last tokens are still in flight
                break
            scheduled = self._admit(request, budget, slices)
            if scheduled == 0:
                break
            budget -= scheduled
        # The step's tokens, one per decode; a run's time is several steps', not a sample of a step's.
        self.step_cost.planned(step, decodes + prefill_budget - budget if decode_steps == 1 else 0)
        if decodes and decodes == len(slices):
            self.speculation.position_cost.planned(step, decode_steps, decodes)
            if not drafts:
                self.decode_runs.planned(step, decode_steps, decodes)
        return StepPlan(step=step, slices=slices, decode_steps=decode_steps)

    def _decode_steps(self) -> int:
        """How many decode steps the next plan runs (decode_runs.py): several only while nothing waits or
        prefills (a run would hold them back), no request may speculate (``Speculation.drafts_possible``), each
        running request's end rule allows it (``EndRule.run_limit``), and the free blocks cover the run."""
        steps = self.decode_runs.steps()
        if steps == 1 or self.waiting or self.speculation.drafts_possible(self.running):
            return 1
        needed_blocks = 0
        for request in self.running:
            if request.prefilling or request.verifying:
                return 1
            steps = min(steps, request.end_rule.run_limit(request.outputs_promised))
            if steps == 1:
                return 1
            needed_blocks += max(0, self.pool.blocks_for(request.num_scheduled + steps) - len(request.blocks))
        return steps if needed_blocks <= self.pool.num_free else 1

    def _admit(self, request: Request, budget: int, slices: list[Slice]) -> int:
        """Starts (or restarts) the request's prefill after its cached prefix; 0 if nothing fits."""
        request.prefill_len = request.num_tokens
        if self.slots is not None:
            slot = self.slots.allocate()
            if slot is None:
                return 0
            request.slot = slot
        # At least the last token is computed, to get the logits that sample the next one.
        cached, hashes = self.pool.walk(request.tokens, request.prefill_len - 1)
        if self.slots is not None:  # a hybrid prefix resumes only where a checkpoint holds its GDN state
            checkpoint = self.checkpoints.longest(hashes, self._step) if self.checkpoints is not None and hashes else None
            keep = 0 if checkpoint is None else len(checkpoint.chain)
            cached, hashes = cached[:keep], hashes[:keep]
            request.restore = checkpoint
            if checkpoint is not None:  # first in line to stay while this plan saves others (the copy precedes the saves)
                self.checkpoints.touch(checkpoint)
        self.pool.take(cached)
        request.blocks, request.block_hashes = cached, hashes
        request.num_scheduled = len(cached) * self.pool.block_size
        restore = request.restore
        scheduled = self._schedule_prefill(request, budget, slices)
        if scheduled == 0:
            self.pool.free(cached)
            request.blocks, request.block_hashes, request.num_scheduled = [], [], 0
            request.restore = None
            self._free_slot(request)
            return 0
        if restore is not None:
            self.checkpoints.restored += 1
        self.pool.count_lookup(request.prefill_len - 1, request.num_scheduled - scheduled)
        self.waiting.remove(request)
        request.phase = Phase.RUNNING
        request.admitted_at = time.monotonic()
        self.running.append(request)
        return scheduled

    def _wants_decode(self, request: Request) -> bool:
        return request.outputs_promised < request.submit.max_tokens

    def _schedule_prefill(self, request: Request, budget: int, slices: list[Slice]) -> int:
        """Schedules the next chunk of the request's prefill that fits budget and free blocks."""
        chunk = min(request.prefill_len - request.num_scheduled, budget)
        room = (len(request.blocks) + self.pool.num_free) * self.pool.block_size - request.num_scheduled
        chunk = min(chunk, room)
        if chunk <= 0:
            return 0
        needed = self.pool.blocks_for(request.num_scheduled + chunk) - len(request.blocks)
        request.blocks.extend(self.pool.allocate(needed) or [])
        start = request.num_scheduled
        slices.append(self._slice(request, chunk, token_ids=request.tokens[start : start + chunk]))
        return chunk

    def _grow_for_decode(self, request: Request, decode_steps: int) -> bool:
        """Gives the request's next positions (one per decode step) a slot, preempting newer requests if needed.

        False if the request itself had to be preempted.
        """
        needed = self.pool.blocks_for(request.num_scheduled + decode_steps) - len(request.blocks)
        while True:
            blocks = self.pool.allocate(needed)
            if blocks is not None:
                request.blocks.extend(blocks)
                return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False

    def _slice(self, request: Request, num_tokens: int, token_ids: list[int] | None = None, decode_steps: int = 1) -> Slice:
        """``num_tokens`` prompt positions, or a decode in each of ``decode_steps`` steps: one position, or with
        ``num_tokens`` above 1 a speculative step's (speculation.py)."""
        start = request.num_scheduled
        sample = start + num_tokens >= request.prefill_len
        request.num_scheduled += num_tokens * decode_steps
        request.pending_samples += sample * decode_steps
        sampling = None if request.sampling_sent else request.submit.sampling
        request.sampling_sent = True
        opened = None if request.stream_opened else open_stream(request.submit, cached_tokens=start)  # the first admission's first slice
        request.stream_opened = True
        prompt_len, prefix_ids = 0, []
        # The worker's penalties, grammars and proposer need every token, cached ones too.
        if sampling is not None and (sampling.follows_outputs or self.speculation.enabled):
            prompt_len, prefix_ids = len(request.submit.prompt_ids), request.tokens[:start]
        stop_token_ids = [] if sampling is None else request.stop_token_ids  # for the worker's runs
        new_blocks = request.blocks[request.blocks_sent :]  # the worker's table grows by these
        request.blocks_sent = len(request.blocks)
        draft_blocks, request.draft_blocks_sent = request.draft_blocks[request.draft_blocks_sent :], len(request.draft_blocks)
        self._register_full_blocks(request)
        restore, request.restore = (-1 if request.restore is None else request.restore.slot), None
        checkpoints = self._checkpoints_of(request, start) if token_ids and self.checkpoints is not None else []
        return Slice(
            rid=request.rid,
            start=start,
            num_tokens=num_tokens,
            token_ids=token_ids or [],
            new_blocks=new_blocks,
            sample=sample,
            sampling=sampling,
            prompt_len=prompt_len,
            prefix_ids=prefix_ids,
            slot=request.slot,
            opened=opened,
            stop_token_ids=stop_token_ids,
            restore=restore,
            checkpoints=checkpoints,
            draft_blocks=draft_blocks,
        )

    def _checkpoints_of(self, request: Request, start: int) -> list[tuple[int, int]]:
        """(position, checkpoint slot) of each checkpoint the prefill chunk from ``start`` saves: the interval's
        and the anchors' positions it passes, once their blocks are cached (a prefix cached already is skipped)."""
        size, end = self.pool.block_size, min(request.num_scheduled, len(request.block_hashes) * self.pool.block_size)
        interval = self.checkpoint_interval
        positions = set(range((start // interval + 1) * interval, end + 1, interval))
        positions.update(p for p in request.anchor_positions if start < p <= end)
        saves = []
        for position in sorted(positions):
            chain = tuple(request.block_hashes[: position // size])
            if all(self.pool.is_cached(h) for h in chain):
                slot = self.checkpoints.save(chain, position, self._step, request.rid)
                if slot is not None:
                    saves.append((position, slot))
        return saves

    def _register_full_blocks(self, request: Request) -> None:
        """Enters into the prefix cache every block whose tokens are known and whose KV is scheduled.

        Plans run in order, so a later plan that reuses such a block finds its KV computed.
        """
        size = self.pool.block_size
        full = min(request.num_scheduled, request.num_tokens) // size
        if len(request.block_hashes) >= full:
            return
        tokens = request.tokens
        for i in range(len(request.block_hashes), full):
            parent = request.block_hashes[-1] if request.block_hashes else None
            request.block_hashes.append(self.pool.register(request.blocks[i], parent, tuple(tokens[i * size : (i + 1) * size])))

    def _preempt(self, request: Request) -> None:
        """Frees the request's blocks and requeues it at the front; it is recomputed when readmitted."""
        self.running.remove(request)
        self.pool.free(request.blocks)
        request.blocks, request.block_hashes, request.blocks_sent = [], [], 0
        self._free_slot(request)
        self._free_draft(request)
        request.num_scheduled = 0
        request.restore = None
        request.sampling_sent = False
        request.phase = Phase.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        self._released.append(request.rid)

    def preempt_all(self) -> list[str]:
        """Preempts every running request (a memory resize takes the KV cache from under them): they wait in their
        running order, ahead of the queue, to be recomputed. Returns the rids the worker must release."""
        for request in reversed(list(self.running)):
            self._preempt(request)
        return self.take_released()

    def _free_slot(self, request: Request) -> None:
        """Gives back the request's GDN state slot, if it holds one (a waiting request holds none)."""
        if request.slot >= 0:
            self.slots.free(request.slot)
            request.slot = -1

    def _free_draft(self, request: Request) -> None:
        if self.draft_blocks is not None:
            self.draft_blocks.free(request)

    # Results and endings. --------------------------------------------------------------

    def take_released(self) -> list[str]:
        """Requests preempted by the last plan: the worker must forget their state before running it."""
        released, self._released = self._released, []
        return released

    def on_result(self, result: StepResult) -> Outcome:
        outcome = Outcome()
        self.step_cost.observed(result.step, result.forward_s)
        self.decode_runs.observed(result.step, result.forward_s, len(result.sampled))
        self.speculation.position_cost.observed(result.step, result.forward_s, len(result.sampled), sum(result.proposed.values()))
        verified: dict[str, list[Sampled]] = {}
        no_guess = set(result.no_guess)
        for sampled in result.sampled:
            request = self.requests.get(sampled.rid)
            if request is None or request.pending_samples == 0:
                continue  # finished while this step was in flight: the extra token is dropped
            request.has_guess = sampled.rid not in no_guess
            if request.verifying:  # a speculative step's run of tokens: taken whole below
                verified.setdefault(request.rid, []).append(sampled)
                continue
            request.pending_samples -= 1
            request.output_ids.append(sampled.token_id)
            self.speculation.decoded(request)
            reason = request.end_rule.ends_at(sampled.token_id, len(request.output_ids))
            logprobs = [sampled.logprobs] if sampled.logprobs is not None else []
            outcome.deltas.append(TokenDelta(rid=request.rid, token_ids=[sampled.token_id], finish=reason, logprobs=logprobs))
            if reason is None:
                self._register_full_blocks(request)
            else:
                self._end(request, outcome)
        for rid, run in verified.items():
            request = self.requests[rid]
            self._take_verified(request, run, result.proposed.get(rid, request.verifying), outcome)
        return outcome

    def _take_verified(self, request: Request, run: list[Sampled], proposed: int, outcome: Outcome) -> None:
        """A speculative step's tokens: the request's positions end at its last accepted token (its last token is
        fed next) and the blocks past them go back, as the worker's table drops them; then its tokens up to the
        one that ends it by the end rule."""
        request.pending_samples -= 1
        draft, request.verifying = request.verifying, 0
        self.speculation.verified(request, proposed, len(run))
        if request.phase is Phase.RUNNING:  # not preempted meanwhile
            request.num_scheduled -= 1 + draft - len(run)
            keep = blocks_kept(request.num_scheduled, self.pool.block_size)
            self.pool.free(request.blocks[keep:])
            del request.blocks[keep:]
            request.blocks_sent = min(request.blocks_sent, keep)
            if self.draft_blocks is not None:
                self.draft_blocks.trim(request, keep)
        for i, sampled in enumerate(run):
            request.output_ids.append(sampled.token_id)
            reason = request.end_rule.ends_at(sampled.token_id, len(request.output_ids))
            if reason is not None or i == len(run) - 1:
                taken = run[: i + 1]
                logprobs = [s.logprobs for s in taken if s.logprobs is not None]
                outcome.deltas.append(TokenDelta(rid=request.rid, token_ids=[s.token_id for s in taken], finish=reason, logprobs=logprobs))
                if reason is None:
                    self._register_full_blocks(request)
                else:
                    self._end(request, outcome)
                return

    def fail(self, rids: list[str]) -> list[str]:
        """Ends these requests with an error (their step failed, or a process lost their state).

        Their blocks leave the prefix cache too: their KV may never have been written.
        Returns the rids that were still live.
        """
        failed = [self.requests[rid] for rid in rids if rid in self.requests]
        if self.checkpoints is not None:
            self.checkpoints.drop_owned({r.rid for r in failed})
        for request in failed:
            self.pool.forget(request.blocks)
            self._end(request, Outcome())
        return [r.rid for r in failed]

    def finish(self, rid: str, reason: FinishReason) -> Outcome:
        """Ends a request from outside (abort, stop string); unknown or finished rids are ignored."""
        outcome = Outcome()
        request = self.requests.get(rid)
        if request is not None:
            outcome.deltas.append(TokenDelta(rid=rid, finish=reason))
            self._end(request, outcome)
        return outcome

    def _end(self, request: Request, outcome: Outcome) -> None:
        """Frees the request's blocks exactly once and forgets it."""
        if request.phase is Phase.RUNNING:
            self.running.remove(request)
            outcome.released.append(request.rid)
        elif request.phase is Phase.WAITING:  # never scheduled, or preempted (already released)
            self.waiting.remove(request)
        self.pool.free(request.blocks)
        request.blocks, request.block_hashes = [], []
        self._free_slot(request)
        self._free_draft(request)
        request.phase = Phase.FINISHED
        del self.requests[request.rid]
