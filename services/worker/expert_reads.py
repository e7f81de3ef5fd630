"""The expert cache's reads from its store into its bank, in flight while a step goes on: ``start`` queues reads, each
of adjacent records into their slots, and gives each one's handle (or the OSError that kept it from being queued),
``wait`` gives (bytes read, whether the caller had to wait for it) and raises OSError where the read failed. Every
started read is waited for before its slots are reused.

- ``AioReads``: Linux native AIO (``csrc/direct_reads.cpp``), where the store reads with O_DIRECT: a layer-step's reads
  are queued by one syscall and their completion wakes no thread. On a 2-core machine a reader thread that wakes takes
  a core from the compute kernels, and each Python handoff costs tens of microseconds; random expert records read this
  way, four in flight, come at about the storage's sequential rate.
- ``ThreadReads``: ``READERS`` threads calling the store's ``preadv`` (a store read through the page cache, where
  native AIO would block in its submit, or where the kernel refuses AIO contexts: a seccomp profile, aio-max-nr).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from services.worker.cpu_kernels import cpu_kernels

if TYPE_CHECKING:
    from services.worker.expert_cache import ExpertStore

READERS = 4  # ThreadReads: reads in flight at once (storage answers a few random records at once faster than one)
AIO_DEPTH = 512  # AioReads: reads in flight at most (a streamed layer's few long reads, a step's misses and reads ahead)


class StoreReads(ABC):
    """Reads of ``store``'s records into the slots of a bank (``bank``: its [slots, record] uint8 rows)."""

    how: str  # for /instrumentation

    def __init__(self, store: ExpertStore) -> None:
        self.store = store
        self.records: torch.Tensor | None = None

    def bank(self, records: torch.Tensor) -> None:
        """Reads land in ``records`` from now on (a resized bank's); none may be in flight."""
        self.records = records

    @abstractmethod
    def start(self, reads: list[tuple[int, int, list[int]]]) -> list[Any]:
        """Queues each read (layer, first, slots) of ``layer``'s experts ``first``, ``first + 1``, ... into ``slots``, in
        order; each one's handle, or the OSError that kept it from being queued (which ``wait`` raises)."""

    @abstractmethod
    def wait(self, handle: Any) -> tuple[int, bool]:
        """(bytes read, whether it was still in flight) of a started read; OSError where it failed."""

    @staticmethod
    def of(store: ExpertStore) -> StoreReads:
        """Native AIO where the store reads with O_DIRECT and the kernel gives an AIO context, else threads."""
        if not store.direct:
            return ThreadReads(store, "threads (the store reads through the page cache)")
        kernels, why = cpu_kernels()
        if kernels is None:
            return ThreadReads(store, f"threads (no C++ kernels: {why})")
        try:
            return AioReads(store, kernels.DirectReads(AIO_DEPTH))
        except RuntimeError as exc:  # io_setup refused: a seccomp profile, aio-max-nr
            return ThreadReads(store, f"threads (native AIO: {exc})")


class AioReads(StoreReads):
    how = "native AIO"

    def __init__(self, store: ExpertStore, reads: Any) -> None:
        """``reads``: a ``DirectReads`` of the C++ kernels (``direct``: the expert bank's fills read through it too)."""
        super().__init__(store)
        self._reads = self.direct = reads

    def start(self, reads: list[tuple[int, int, list[int]]]) -> list[Any]:
        assert self.records is not None, "bank() before start()"
        store, record, base = self.store, self.store.record, self.records.data_ptr()
        tickets = self._reads.submit(
            store.fd, [(store.offset(layer, first), [base + slot * record for slot in slots]) for layer, first, slots in reads], record
        )
        return [
            (ticket, layer, first, len(slots) * record)
            if ticket >= 0
            else OSError(-ticket, f"queueing a read of the expert store {store.path}: {os.strerror(-ticket)}")
            for ticket, (layer, first, slots) in zip(tickets, reads)
        ]

    def wait(self, handle: Any) -> tuple[int, bool]:
        if isinstance(handle, OSError):
            raise handle
        ticket, layer, first, size = handle
        read, waited = self._reads.wait(ticket)
        if read < 0:
            raise OSError(-read, f"reading layer {layer}'s experts from {first} in the expert store {self.store.path}: {os.strerror(-read)}")
        if read != size:
            raise OSError(f"the expert store {self.store.path} gave {read} of {size} bytes of layer {layer}'s experts from {first}")
        return read, waited


class ThreadReads(StoreReads):
    def __init__(self, store: ExpertStore, how: str) -> None:
        super().__init__(store)
        self.how = how
        self._threads = ThreadPoolExecutor(READERS, thread_name_prefix="expert-read")

    def start(self, reads: list[tuple[int, int, list[int]]]) -> list[Any]:
        assert self.records is not None, "bank() before start()"
        records = self.records
        return [
            self._threads.submit(self.store.read_into, layer, first, [memoryview(records[slot].numpy()) for slot in slots]) for layer, first, slots in reads
        ]

    def wait(self, handle: Future[int]) -> tuple[int, bool]:
        waited = not handle.done()
        return handle.result(), waited
