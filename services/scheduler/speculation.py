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
  (``StepResult.no_guess``: prompt lookup found no n-gram), and such a request decodes plainly, pipelined, until
  one has (while requests may speculate, a plain decode is a plan of one step, ``drafts_possible``: a guess is
  taken up at the next plan rather than after a run of several steps);
- a proposal pays (``best_draft``): of the proposal lengths up to k it takes the one with the most tokens per
  unit of the worker's time, zero being a plain decode, from two measured quantities. The request's acceptance
  (``Acceptance``): the share of its verified positions that held, where each later verify keeps 0.8 of an
  earlier one's weight and each plain token 0.95, so a request whose guesses stopped holding decodes plainly
  and, as that evidence fades back towards the prior (two in three), tries again. And the cost of
  a verified position (``PositionCost``): what a verifying step takes beyond a plain decode step, per proposed
  position, as a share of the plain step, from the worker's forward times (on two CPU cores ~0.1-0.2, the step
  being bound by its products; a small batch on a GPU should make it nearly 0). Until both kinds of step have
  been timed the cost is taken as 0, and every proposal as long as k. A seeded request's choice takes a fixed
  cost instead (``SEEDED_POSITION_COST``): its rejection sampler's draws depend on its proposal lengths, which
  must then depend on its tokens alone for its output to repeat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.requests import Request

PRIOR_ACCEPTED, PRIOR_VERIFIED = 0.5, 0.75  # the evidence a request starts from: two in three positions hold, worth one verify
VERIFY_WEIGHT = 0.8  # the weight an earlier verify's evidence keeps at each later verify
DECODE_WEIGHT = 0.95  # ... and at each plain token decoded after it
COST_SMOOTHING = 0.25  # weight of the newest step in the measured step times
MAX_PENDING_PLANS = 64  # plans remembered awaiting their result (results of lost steps never come)
# A seeded request's draws must repeat from run to run, so its proposal lengths may not follow measured times:
# its choice assumes a CPU's cost of a verified position instead.
SEEDED_POSITION_COST = 0.2


@dataclass
class Acceptance:
    """A request's evidence of how often its proposals hold: its verified positions and those accepted, discounted."""

    accepted: float = 0.0
    verified: float = 0.0

    @property
    def rate(self) -> float:
        """The chance that a proposed token holds once those before it did."""
        return (self.accepted + PRIOR_ACCEPTED) / (self.verified + PRIOR_VERIFIED)

    def verify(self, proposed: int, accepted: int) -> None:
        """A verify of ``proposed`` tokens accepted ``accepted``: those positions held, and the one after them (if
        proposed) did not."""
        self.accepted = VERIFY_WEIGHT * self.accepted + accepted
        self.verified = VERIFY_WEIGHT * self.verified + accepted + (accepted < proposed)

    def decoded(self) -> None:
        """A plain token: the evidence fades."""
        self.accepted *= DECODE_WEIGHT
        self.verified *= DECODE_WEIGHT


def best_draft(rate: float, position_cost: float, most: int) -> int:
    """The proposal length, 0 to ``most``, with the most expected tokens per unit of step time: each proposed token
    holding with chance ``rate`` once those before it did, a verify of j proposals gives 1 + rate + ... + rate^j
    tokens in the time of 1 + j * ``position_cost`` plain decode steps (0 proposals: a plain decode)."""
    best, best_value, tokens, held = 0, 1.0, 1.0, 1.0
    for j in range(1, most + 1):
        held *= rate
        tokens += held
        value = tokens / (1.0 + j * position_cost)
        if value > best_value:
            best, best_value = j, value
    return best


class PositionCost:
    """The worker's time for one more position in a decode step, as a share of a plain decode step's, from the times
    of plans of decodes alone: those that verify nothing (per step) and those that verify (their time beyond a plain
    step's, per position proposed)."""

    def __init__(self) -> None:
        self.plain_s: float | None = None
        self.position_s: float | None = None
        self._pending: dict[int, tuple[int, int]] = {}  # step -> (decode steps, decodes)

    @property
    def share(self) -> float:
        if self.plain_s is None or self.position_s is None or self.plain_s <= 0:
            return 0.0
        return self.position_s / self.plain_s

    def planned(self, step: int, decode_steps: int, decodes: int) -> None:
        """A plan of ``decodes`` decodes alone (some may verify), running ``decode_steps`` steps."""
        if len(self._pending) >= MAX_PENDING_PLANS:
            self._pending.pop(next(iter(self._pending)))
        self._pending[step] = (decode_steps, decodes)

    def observed(self, step: int, forward_s: float, samples: int, proposed: int) -> None:
        """The worker's time for a plan (0: not timed, or failed), the tokens it returned and the positions its
        proposers filled (``StepResult.proposed``)."""
        decode_steps, decodes = self._pending.pop(step, (0, 0))
        if forward_s <= 0 or not decode_steps:
            return
        if proposed:
            if self.plain_s is not None:
                self.position_s = _smoothed(self.position_s, max(0.0, forward_s - self.plain_s) / proposed)
        elif samples >= decode_steps * decodes:  # a run that stop tokens cut short says little of a step's time
            self.plain_s = _smoothed(self.plain_s, forward_s / decode_steps)


def _smoothed(average: float | None, sample: float) -> float:
    return sample if average is None else average + COST_SMOOTHING * (sample - average)


def blocks_kept(positions: int, block_size: int) -> int:
    """The blocks a request keeps after a verify: those of its computed positions (the rest are given back)."""
    return -(-positions // block_size)


class Speculation:
    def __init__(self, num_tokens: int = 0, max_batch: int = 0) -> None:
        self.num_tokens = num_tokens  # the most tokens a step verifies per request (0: speculation off)
        self.max_batch = max_batch
        self.position_cost = PositionCost()

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0

    def drafts(self, running: list[Request]) -> dict[str, int]:
        """The running requests that speculate in the next step, by rid, with how many proposed tokens each verifies."""
        if not self.enabled or len(running) > self.max_batch:
            return {}
        drafts = {r.rid: self.draft_len(r, len(running)) for r in running if not r.prefilling}
        return {rid: draft for rid, draft in drafts.items() if draft}

    def drafts_possible(self, running: list[Request]) -> bool:
        """Whether a request decoding plainly may speculate at its next step: then its plans run one step each, so
        that a guess its proposer finds (or evidence that fades) is taken up at once, not after a run."""
        return self.enabled and len(running) <= self.max_batch and any(r.submit.sampling.grammar is None for r in running)

    def draft_len(self, request: Request, running: int) -> int:
        """How many proposed tokens the request's next decode verifies (0: a plain decode), with ``running`` requests."""
        if not self.enabled or running > self.max_batch:
            return 0
        params = request.submit.sampling
        if params.grammar is not None or not request.has_guess:  # a structured output, or nothing to propose
            return 0
        most = min(self.num_tokens, request.end_rule.run_limit(request.outputs_promised) - 1)
        cost = self.position_cost.share if params.seed is None else SEEDED_POSITION_COST
        return best_draft(request.acceptance.rate, cost, most) if most > 0 else 0

    def verified(self, request: Request, proposed: int, tokens: int) -> None:
        """A verify of ``proposed`` tokens came back with ``tokens`` tokens (``tokens - 1`` accepted); with none
        proposed (its proposer had no guess) it says nothing of whether guesses hold."""
        if proposed:
            request.acceptance.verify(proposed, tokens - 1)

    def decoded(self, request: Request) -> None:
        """A plain decode's token came back."""
        if self.enabled:
            request.acceptance.decoded()

    def describe(self) -> dict[str, float | None]:
        cost = self.position_cost
        return {
            "plain_step_ms": None if cost.plain_s is None else round(cost.plain_s * 1000, 4),
            "position_ms": None if cost.position_s is None else round(cost.position_s * 1000, 4),
            "position_cost": round(cost.share, 4),
        }
