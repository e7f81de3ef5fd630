"""Reasoning: the accepted effort levels, and the splitter that separates ``<think>…</think>`` text from the answer.

The splitter is incremental and chunk-invariant: whatever boundaries the text arrives in,
the reasoning and the content it yields concatenate to the same strings as when it is fed
the whole output at once.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from services.api.errors import ApiError
from shared.choices import REASONING_PARSER_NAMES, keyed_by

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""Every reasoning effort a client may ask for, least to most (OpenAI's list)."""


def thinks(effort: str | None, efforts: tuple[str, ...]) -> bool:
    """Whether the model thinks before it answers: a reasoning model (``efforts`` beyond ``none``), unless told ``none``."""
    return efforts != ("none",) and effort != "none"


def check_effort(effort: str | None, accepted: tuple[str, ...], param: str) -> str | None:
    """The effort, if this model accepts it; a 400 naming ``param`` otherwise."""
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise ApiError(400, f"unknown {param} {effort!r}; expected one of {', '.join(EFFORTS)}", param=param)
    if effort not in accepted:
        raise ApiError(400, f"this model does not reason, so {param} {effort!r} cannot be honoured; it accepts {', '.join(accepted)}", param=param)
    return effort


def effort_template_kwargs(effort: str | None) -> dict[str, object]:
    """What the chat template is told: qwen3-style ``enable_thinking``, plus the effort itself for templates that read it."""
    if effort is None:
        return {}
    if effort == "none":
        return {"enable_thinking": False}
    return {"enable_thinking": True, "reasoning_effort": effort}


class Reasoning(NamedTuple):
    text: str


class Content(NamedTuple):
    text: str


class _Mode(enum.Enum):
    START = "start"  # nothing decided yet: the output may open with the start tag
    REASONING = "reasoning"
    CONTENT = "content"


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (it may become the tag)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def opens_reasoning(prompt_text: str, start: str = "<think>") -> bool:
    """Whether the rendered prompt ends inside an opened reasoning block (the template wrote the start tag)."""
    return prompt_text.rstrip().endswith(start)


class ReasoningSplitter:
    """Splits one output's text into Reasoning and Content pieces.

    The output is reasoning when it opens with the start tag (after optional whitespace),
    or when the prompt already opened it (``in_reasoning``). Reasoning lasts until the end
    tag, or to the end of the output if none comes. Whitespace right after either tag is
    dropped; the tags themselves never reach the client.
    """

    def __init__(self, in_reasoning: bool = False, start: str = "<think>", end: str = "</think>") -> None:
        self.start, self.end = start, end
        self.mode = _Mode.REASONING if in_reasoning else _Mode.START
        self.strip_leading = in_reasoning
        self.pending = ""

    def feed(self, text: str) -> list[Reasoning | Content]:
        self.pending += text
        out: list[Reasoning | Content] = []
        while self.pending:
            if self.strip_leading:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    break
                self.strip_leading = False
            if self.mode is _Mode.START:
                head = self.pending.lstrip()
                if not head or (len(head) < len(self.start) and self.start.startswith(head)):
                    break  # only whitespace or part of the start tag so far
                if head.startswith(self.start):
                    self.pending = head[len(self.start) :]
                    self.mode, self.strip_leading = _Mode.REASONING, True
                else:
                    self.mode = _Mode.CONTENT
            elif self.mode is _Mode.REASONING:
                at = self.pending.find(self.end)
                if at < 0:
                    keep = held_prefix(self.pending, self.end)
                    if len(self.pending) > keep:
                        out.append(Reasoning(self.pending[: len(self.pending) - keep]))
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                if at:
                    out.append(Reasoning(self.pending[:at]))
                self.pending = self.pending[at + len(self.end) :]
                self.mode, self.strip_leading = _Mode.CONTENT, True
            else:
                out.append(Content(self.pending))
                self.pending = ""
        return out

    def finish(self) -> list[Reasoning | Content]:
        """What is still held back: a cut tag is text after all; reasoning never closed stays reasoning."""
        pending, self.pending = self.pending, ""
        if not pending or (self.strip_leading and not pending.strip()):
            return []
        return [Reasoning(pending)] if self.mode is _Mode.REASONING else [Content(pending)]


REASONING_PARSERS = keyed_by(REASONING_PARSER_NAMES, {"think": ("<think>", "</think>")})
"""Reasoning parsers by name (the ``reasoning_parser`` setting); ``none`` turns parsing off."""
