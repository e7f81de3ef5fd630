"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step of ``n`` requests is staged into static input buffers (token ids, positions,
block tables, and for hybrid models the GDN state slots), padded up to the next bucket (1, 2, 4, 8,
then multiples of 8) with dummy requests that sit at position 0 of a dummy KV block no request owns
and run in a dummy GDN state slot no request owns, and the bucket's graph is replayed; its logits
rows ``[:n]`` are the step's. Larger batches, prefills and mixed steps run eagerly.

Invariants that make replay N equal eager step N:
- staging rewrites every row of the bucket (real rows and dummy rows), so a row left by an
  earlier, larger batch is never read;
- everything a captured kernel reads is either a static input, a weight, the KV cache or a live
  request's GDN state, or computed inside the captured region from those (KV slot indices, masks,
  query offsets, the GDN slot metadata: ``step`` builds them on every replay), so no kernel reads a
  buffer that was written once, outside the graph. The dummy GDN slot, which padding rows read
  before they write it, is zeroed inside the captured region (the runner's step does it).

The capture is injectable: ``CudaGraphCapture`` records a ``torch.cuda.CUDAGraph``;
``eager_capture`` returns the step itself, so on the CPU the same staging path runs eagerly and
can be compared with the unpadded eager step.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

# (input_ids [B], positions [B], block_tables [B, W] int32, gdn_slots [B] int32) -> logits [B, vocab];
# models without GDN layers ignore the slots.
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to ``max_batch`` (0: none)."""
    return [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 8))


def bucket_for(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``batch`` requests; None when the batch is larger than all."""
    at = bisect.bisect_left(buckets, batch)
    return buckets[at] if at < len(buckets) and batch > 0 else None


class Capture(Protocol):
    def __call__(self, step: Callable[[], None]) -> Callable[[], None]:
        """Record ``step`` (it reads and writes only static tensors) and return what replays it."""
        ...


def eager_capture(step: Callable[[], None]) -> Callable[[], None]:
    """No graph: 'replay' runs the step again (the CPU, and tests of the staging path)."""
    return step


class CudaGraphCapture:
    """Records each step as a ``torch.cuda.CUDAGraph``; all graphs share one memory pool, so
    capture the largest bucket first."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, step: Callable[[], None]) -> Callable[[], None]:
        # Warm up on a side stream first (lazy initialisation, autotuning and the rotary table
        # must not happen during capture), then record on it.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph.replay


class StaticDecodeInputs:
    """The buffers a captured decode step reads, sized for the largest bucket."""

    def __init__(self, max_batch: int, table_width: int, dummy_block: int, device: torch.device, dummy_slot: int = 0) -> None:
        self.table_width, self.dummy_block, self.dummy_slot = table_width, dummy_block, dummy_slot
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.block_tables = torch.full((max_batch, table_width), dummy_block, dtype=torch.int32, device=device)
        self.slots = torch.full((max_batch,), dummy_slot, dtype=torch.int32, device=device)
        self._pinned = device.type == "cuda"

    def stage(self, tokens: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]], bucket: int, slots: Sequence[int] = ()) -> None:
        """Rows ``[:n]`` get the real requests, rows ``[n:bucket]`` a dummy request (token 0 at
        position 0 of the dummy block, in the dummy GDN slot); table entries past a request's blocks
        name the dummy block. ``slots``: the requests' GDN state slots (hybrid models; else dummies)."""
        n = len(tokens)
        ids = torch.zeros(bucket, dtype=torch.int64, pin_memory=self._pinned)
        pos = torch.zeros(bucket, dtype=torch.int64, pin_memory=self._pinned)
        table = torch.full((bucket, self.table_width), self.dummy_block, dtype=torch.int32, pin_memory=self._pinned)
        slot = torch.full((bucket,), self.dummy_slot, dtype=torch.int32, pin_memory=self._pinned)
        ids[:n] = torch.tensor(tokens, dtype=torch.int64)
        pos[:n] = torch.tensor(positions, dtype=torch.int64)
        for row, blocks in enumerate(tables):
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slot[: len(slots)] = torch.tensor(slots, dtype=torch.int32)
        self.input_ids[:bucket].copy_(ids, non_blocking=True)
        self.positions[:bucket].copy_(pos, non_blocking=True)
        self.block_tables[:bucket].copy_(table, non_blocking=True)
        self.slots[:bucket].copy_(slot, non_blocking=True)


class DecodeGraphs:
    """One captured decode step per bucket, and the counters of replayed vs eager decode steps."""

    def __init__(
        self,
        step: DecodeStep,
        max_batch: int,
        table_width: int,
        vocab_size: int,
        dummy_block: int,
        device: torch.device,
        dtype: torch.dtype,
        capture: Capture,
        dummy_slot: int | None = None,
    ) -> None:
        """``dummy_slot``: the GDN state slot of padding rows (hybrid models; None: the model has none)."""
        self.buckets = graph_buckets(max_batch)
        self.table_width = table_width
        self.has_slots = dummy_slot is not None
        self.inputs = StaticDecodeInputs(max(self.buckets, default=0), table_width, dummy_block, device, dummy_slot or 0)
        self.logits = torch.zeros(max(self.buckets, default=0), vocab_size, dtype=dtype, device=device)
        self._step, self._capture = step, capture
        self._replays: dict[int, Callable[[], None]] = {}
        self.replayed = 0
        self.eager = 0

    def capture_all(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Capture every bucket, largest first (the graphs share one memory pool); ``stop`` ends early."""
        for bucket in sorted(self.buckets, reverse=True):
            if stop():
                return
            self.inputs.stage([], [], [], bucket)  # dummies only: capture writes nothing a request owns
            self._replays[bucket] = self._capture(self._recorded(bucket))

    def _recorded(self, bucket: int) -> Callable[[], None]:
        ids, positions, tables = self.inputs.input_ids[:bucket], self.inputs.positions[:bucket], self.inputs.block_tables[:bucket]
        slots = self.inputs.slots[:bucket]
        out = self.logits[:bucket]

        def step() -> None:
            out.copy_(self._step(ids, positions, tables, slots))

        return step

    @property
    def captured(self) -> list[int]:
        return sorted(self._replays)

    def fits(self, batch: int, tables: Sequence[Sequence[int]]) -> int | None:
        """The captured bucket this decode batch replays in, or None (run it eagerly)."""
        bucket = bucket_for(batch, self.captured)
        if bucket is None or any(len(t) > self.table_width for t in tables):
            return None
        return bucket

    def run(self, bucket: int, tokens: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]], slots: Sequence[int] = ()) -> torch.Tensor:
        """Logits [n, vocab] of a decode step of ``n = len(tokens)`` requests (a copy: the next replay overwrites the buffer)."""
        self.inputs.stage(tokens, positions, tables, bucket, slots)
        self._replays[bucket]()
        self.replayed += 1
        return self.logits[: len(tokens)].clone()

    def describe(self) -> dict[str, Any]:
        return {
            "buckets": self.buckets,
            "captured_buckets": self.captured,
            "table_width": self.table_width,
            "dummy_block": self.inputs.dummy_block,
            "dummy_gdn_slot": self.inputs.dummy_slot if self.has_slots else None,
            "replayed_steps": self.replayed,
            "eager_decode_steps": self.eager,
        }
