"""The draft model's KV blocks (``--speculative-method draft``): a second pool beside the target's, from which a
speculating request's draft KV gets its blocks.

A request's draft blocks hold the same positions as its target blocks, with the same block size. They grow only
when the request speculates (to cover that step's positions, as its target blocks do), are cut back after a
verify as its target blocks are (``speculation.blocks_kept``), and all go back when it finishes, is aborted, fails
or is preempted (its draft is recomputed with it). A pool without the free blocks a step needs makes the request
decode plainly in that step: the draft never preempts. No prefix cache: the worker's draft catches up from the
positions it has computed.
"""

from __future__ import annotations

from services.scheduler.kv_blocks import BlockPool
from services.scheduler.requests import Request


class DraftBlocks:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_cache=False)

    def grow(self, request: Request, positions: int) -> bool:
        """Gives the request's draft blocks for its first ``positions`` positions; False (nothing taken) if they do not fit."""
        needed = self.pool.blocks_for(positions) - len(request.draft_blocks)
        blocks = self.pool.allocate(max(0, needed))
        if blocks is None:
            return False
        request.draft_blocks.extend(blocks)
        return True

    def trim(self, request: Request, keep: int) -> None:
        """Keeps the request's first ``keep`` draft blocks (the worker's table drops the same)."""
        self.pool.free(request.draft_blocks[keep:])
        del request.draft_blocks[keep:]
        request.draft_blocks_sent = min(request.draft_blocks_sent, keep)

    def free(self, request: Request) -> None:
        self.pool.free(request.draft_blocks)
        request.draft_blocks, request.draft_blocks_sent = [], 0

    def describe(self) -> dict[str, int]:
        return {"draft_kv_blocks_total": self.pool.num_blocks, "draft_kv_blocks_used": self.pool.num_used}
