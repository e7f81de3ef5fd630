"""Which decoding requests speculate in a step, and how many proposed tokens each one's step verifies.

A speculating request's decode slice spans ``1 + draft`` positions (a decode slice, no tokens, ``num_tokens``
above 1): the worker feeds the request's last token and up to ``draft`` tokens its proposer guesses, computes
them in one forward in the step's batch, and answers one token per position of the longest run the target
model accepts plus its own token after it. Only the result says how many positions hold, so the request gets
no further slice while its verify is in flight (it leaves the pipeline for that step); when the result comes,
its positions end at its last accepted token and the blocks past them are given back, on both sides by one
rule (``blocks_kept``).

The rule, per request and step: it speculates when
- at most ``max_batch`` requests run: a rejected position costs a whole position of compute, which a large batch
  has no spare for, while a single stream is bound by reading the weights once per step whatever its positions;
- its end rule lets a run of ``1 + draft`` tokens go (``EndRule.run_limit``): never past ``max_tokens``, and not
  before its ``min_tokens`` are out, so a stop token inside an accepted run always ends it there;
- it has no structured output (its grammar's mask would have to follow every proposed token);
- its proposer has a guess: a result says which of its requests' proposers had none after their last token
  (``StepResult.no_guess``: prompt lookup found no n-gram), and such a request decodes plainly, pipelined and in
  runs, until one has;
- its verifies pay: one whose proposal was wholly rejected makes it decode plainly (pipelined, or in runs) for a
  number of tokens that doubles with each such verify in a row, up to ``MAX_BACKOFF_TOKENS``; one that accepts
  resets it, and one whose proposer had no guess (``StepResult.proposed``) counts as neither.
"""

from __future__ import annotations

from services.scheduler.requests import Request

MAX_BACKOFF_TOKENS = 64  # the longest a request that keeps rejecting decodes plainly before it tries again


def blocks_kept(positions: int, block_size: int) -> int:
    """The blocks a request keeps after a verify: those of its computed positions (the rest are given back)."""
    return -(-positions // block_size)


class Speculation:
    def __init__(self, num_tokens: int = 0, max_batch: int = 0) -> None:
        self.num_tokens = num_tokens  # the most tokens a step verifies per request (0: speculation off)
        self.max_batch = max_batch

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0

    def drafts(self, running: list[Request]) -> dict[str, int]:
        """The running requests that speculate in the next step, by rid, with how many proposed tokens each verifies."""
        if not self.enabled or len(running) > self.max_batch:
            return {}
        drafts = {r.rid: self.draft_len(r, len(running)) for r in running if not r.prefilling}
        return {rid: draft for rid, draft in drafts.items() if draft}

    def draft_len(self, request: Request, running: int) -> int:
        """How many proposed tokens the request's next decode verifies (0: a plain decode), with ``running`` requests."""
        if not self.enabled or running > self.max_batch:
            return 0
        params = request.submit.sampling
        if params.grammar is not None:  # a structured output
            return 0
        if request.outputs_promised < request.resume_speculation_at or not request.has_guess:
            return 0
        return max(0, min(self.num_tokens, request.end_rule.run_limit(request.outputs_promised) - 1))

    def verified(self, request: Request, proposed: int, tokens: int) -> None:
        """A verify of ``proposed`` tokens came back with ``tokens`` tokens (``tokens - 1`` accepted); with none
        proposed (its proposer had no guess) it says nothing of whether guesses pay."""
        if proposed == 0:
            return
        if tokens > 1:
            request.speculation_backoff = 0
            return
        request.speculation_backoff = min(MAX_BACKOFF_TOKENS, max(1, 2 * request.speculation_backoff))
        request.resume_speculation_at = len(request.output_ids) + tokens + request.speculation_backoff
