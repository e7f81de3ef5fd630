"""The chat turn shared by chat completions, responses and messages: render it with the template, parse its answer.

Each protocol converts its request into a ``ChatTurn``; ``ChatFormat`` (chosen once per
model at start-up) knows how this model's template takes tools and reasoning switches,
and which parsers read its answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.api.output_parsing import OutputParser
from services.api.reasoning import EFFORTS, REASONING_PARSERS, ReasoningSplitter, effort_template_kwargs, opens_reasoning
from services.api.templating import PromptBuilder, RenderedPrompt
from services.api.tool_parsers import TOOL_PARSERS, choose_tool_parser, renders_tools
from services.api.tools import ToolChoice, ToolSpec, add_system_text, choice_instruction, fallback_tool_prompt, inline_tool_turns, offered_tools

_REASONING_FAMILIES = {"qwen3", "qwen3_moe", "qwen3_next"}


@dataclass
class ChatTurn:
    """A chat request, whichever protocol it came in."""

    messages: list[dict[str, Any]]
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    effort: str | None = None  # a checked reasoning effort
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # the client's own; they win over the effort's
    add_generation_prompt: bool = True
    continue_final: bool = False

    @property
    def shown_tools(self) -> list[ToolSpec]:
        return offered_tools(self.tools, self.tool_choice)


@dataclass(frozen=True)
class ChatFormat:
    """How this model's chat template takes tools and reasoning, and how its answers are parsed."""

    tool_parser: str  # a TOOL_PARSERS name, or "none"
    reasoning_tags: tuple[str, str] | None  # None: the model does not reason (visibly)
    native_tools: bool  # the template renders tool definitions itself

    @classmethod
    def for_model(cls, family: str, chat_template: str, tool_parser_setting: str = "", reasoning_parser_setting: str = "") -> ChatFormat:
        if reasoning_parser_setting:
            if reasoning_parser_setting != "none" and reasoning_parser_setting not in REASONING_PARSERS:
                raise ValueError(f"unknown reasoning_parser {reasoning_parser_setting!r}; choose one of none, {', '.join(REASONING_PARSERS)}")
            name = reasoning_parser_setting
        else:
            thinks = "<think>" in chat_template or "enable_thinking" in chat_template or family in _REASONING_FAMILIES
            name = "think" if thinks else "none"
        return cls(
            tool_parser=choose_tool_parser(tool_parser_setting, family, chat_template),
            reasoning_tags=REASONING_PARSERS.get(name),
            native_tools=renders_tools(chat_template),
        )

    @property
    def efforts(self) -> tuple[str, ...]:
        """The reasoning efforts a client may ask for: all of them for a reasoning model, else only ``none``."""
        return EFFORTS if self.reasoning_tags else ("none",)

    async def render(self, prompts: PromptBuilder, turn: ChatTurn) -> RenderedPrompt:
        tools = turn.shown_tools
        messages = turn.messages
        system = choice_instruction(turn.tool_choice)
        if not self.native_tools:
            messages = inline_tool_turns(messages)
            if tools:
                system = f"{fallback_tool_prompt(tools)}\n\n{system}".strip()
        messages = add_system_text(messages, system)
        kwargs = effort_template_kwargs(turn.effort) | turn.template_kwargs
        template_tools = [tool.template_entry() for tool in tools] if tools and self.native_tools else None
        return await prompts.chat(messages, turn.add_generation_prompt, turn.continue_final, kwargs, template_tools)

    def parser(self, turn: ChatTurn, prompt: RenderedPrompt, id_prefix: str = "call_") -> OutputParser:
        """A fresh parser for one answer to this prompt."""
        splitter = None
        if self.reasoning_tags:
            start, end = self.reasoning_tags
            splitter = ReasoningSplitter(in_reasoning=opens_reasoning(prompt.text, start), start=start, end=end)
        tools = turn.shown_tools
        tool_parser = TOOL_PARSERS[self.tool_parser](tools, turn.tool_choice.parallel) if tools and self.tool_parser != "none" else None
        return OutputParser(splitter, tool_parser, id_prefix)
