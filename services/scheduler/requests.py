"""A request as the scheduler tracks it: tokens known, positions scheduled, blocks and state slot held."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.scheduler.speculation import Acceptance
from services.scheduler.state_slots import Checkpoint
from shared.frames import Submit
from shared.stream_contract import EndRule, stop_token_ids


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    submit: Submit
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the leading full blocks
    blocks_sent: int = 0  # how many of ``blocks`` the worker's block table has
    draft_blocks: list[int] = field(default_factory=list)  # the draft model's blocks while it speculates (draft_blocks.py)
    draft_blocks_sent: int = 0  # how many of ``draft_blocks`` the worker's draft table has
    num_scheduled: int = 0  # positions whose KV is computed or in a plan already sent
    prefill_len: int = 0  # positions to prefill since admission: the prompt, plus outputs when recomputed
    pending_samples: int = 0  # sampling slices sent whose token has not come back
    sampling_sent: bool = False  # the worker has this request's sampling params
    stream_opened: bool = False  # a slice carried its StreamOpen (once, at the first admission)
    slot: int = -1  # GDN state slot while running (hybrid models), else -1
    verifying: int = 0  # proposed tokens of the speculative step in flight (speculation.py), 0: none
    acceptance: Acceptance = field(default_factory=Acceptance)  # how often its proposals held (speculation.py)
    has_guess: bool = True  # its proposer had a guess after its last token that came back (StepResult.no_guess)
    restore: Checkpoint | None = None  # the GDN checkpoint the next slice restores (hybrid models, after a prefix hit)
    anchor_positions: list[int] = field(default_factory=list)  # where its prefill saves GDN checkpoints besides the interval's
    phase: Phase = Phase.WAITING
    compiling: bool = False  # its grammar is being compiled: it waits, and the requests behind it may pass it
    admitted_at: float = 0.0
    queued_at: float = field(default_factory=time.monotonic)
    end_rule: EndRule = field(init=False)

    def __post_init__(self) -> None:
        self.end_rule = EndRule.of_submit(self.submit)

    @property
    def rid(self) -> str:
        return self.submit.rid

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokens that end the request (after its min_tokens): none with ignore_eos."""
        return stop_token_ids(self.submit)

    @property
    def tokens(self) -> list[int]:
        return self.submit.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Known tokens: the prompt and every output token received so far."""
        return len(self.submit.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        """Known tokens still need their KV computed (the prompt, or a recomputation).

        Afterwards each decode slice computes one position whose input token is the
        one sampled last, which only the worker may know yet.
        """
        return self.num_scheduled < self.prefill_len

    @property
    def outputs_promised(self) -> int:
        """Output tokens received plus those that plans already sent will produce."""
        return len(self.output_ids) + self.pending_samples
