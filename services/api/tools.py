"""Tools as the chat template sees them: definitions, the tool choice, and the prompt for templates that know no tools.

The three protocols (chat completions, responses, messages) describe tools differently;
each converts its own into ``ToolSpec`` and ``ToolChoice``, and from there on one path
renders them and parses the model's calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from services.api.errors import ApiError


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool = False  # a call's arguments are held to ``parameters`` (structured_outputs.tool_call_grammar)

    def template_entry(self) -> dict[str, Any]:
        """The OpenAI/Hugging Face shape that chat templates iterate over."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters or {"type": "object", "properties": {}}}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def parameter_type(self, parameter: str) -> str | None:
        """The JSON-schema type the tool declares for one parameter, if any."""
        properties = (self.parameters or {}).get("properties")
        spec = properties.get(parameter) if isinstance(properties, dict) else None
        kind = spec.get("type") if isinstance(spec, dict) else None
        return kind if isinstance(kind, str) else None


@dataclass(frozen=True)
class ToolChoice:
    """``none``: no tools reach the model; ``auto``: it may call; ``required``/``named``: it is told to call.

    ``required`` and ``named`` are held by the grammar where the tool parser's format has one
    (``structured_outputs.tool_call_grammar``: the answer is then one call of an offered tool, after any reasoning);
    with another parser's format they are instructions, and an answer without a call is returned as it is, with the
    finish reason ``stop``.
    """

    mode: Literal["none", "auto", "required", "named"] = "auto"
    name: str = ""
    parallel: bool = True  # False: only the first call of an answer is kept


def check_tools(tools: list[ToolSpec], choice: ToolChoice, param: str, choice_param: str, name_field: str = "name") -> None:
    names = [tool.name for tool in tools]
    for i, name in enumerate(names):
        if not name or len(name) > 128 or any(c.isspace() or c in "<>\"'" for c in name):
            raise ApiError(
                400, f"invalid tool name {name!r}: use 1-128 characters without spaces, quotes or angle brackets", param=f"{param}[{i}].{name_field}"
            )
    if len(set(names)) != len(names):
        raise ApiError(400, "tool names must be unique", param=param)
    if choice.mode in ("required", "named") and not tools:
        raise ApiError(400, f"tool_choice {choice.mode!r} needs at least one tool", param=choice_param)
    if choice.mode == "named" and choice.name not in names:
        raise ApiError(400, f"tool_choice names {choice.name!r}, which is not among the tools", param=choice_param)


def offered_tools(tools: list[ToolSpec], choice: ToolChoice) -> list[ToolSpec]:
    """The tools the model is shown: none for ``none``, the named one for a named choice."""
    if choice.mode == "none":
        return []
    if choice.mode == "named":
        return [tool for tool in tools if tool.name == choice.name]
    return tools


def choice_instruction(choice: ToolChoice) -> str:
    if choice.mode == "required":
        return "You must answer by calling one or more of the provided tools."
    if choice.mode == "named":
        return f"You must answer by calling the tool `{choice.name}`."
    return ""


def add_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """Appends to the first system message (templates accept a system message only first), or starts one."""
    if not text:
        return messages
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def fallback_tool_prompt(tools: list[ToolSpec]) -> str:
    """Tool definitions for a template that renders none, in the widely trained Hermes format."""
    definitions = "\n".join(json.dumps(tool.template_entry(), ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to assist with the user query. The function signatures are:\n"
        f"<tools>\n{definitions}\n</tools>\n"
        "To call a function, answer with one JSON object per call inside <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
    )


def inline_tool_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates that render no tools: assistant calls become Hermes text, tool results user turns."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False) + "\n</tool_call>"
                for c in message["tool_calls"]
            )
            content = f"{message.get('content') or ''}\n{calls}".strip()
            out.append({k: v for k, v in message.items() if k != "tool_calls"} | {"content": content})
        elif message.get("role") == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("from_tool"):
                out[-1] = out[-1] | {"content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response, "from_tool": True})
        else:
            out.append(message)
    return [{k: v for k, v in m.items() if k != "from_tool"} for m in out]


def template_call(call_id: str, name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call as templates expect it: arguments as an object when they parse as one."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
