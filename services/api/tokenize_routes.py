"""vLLM's /tokenize and /detokenize: a prompt or a chat (rendered exactly as /v1/chat/completions renders it) to token ids, and back."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec
from aiohttp import web

from services.api.chat import ChatTurn
from services.api.protocol import ChatMessage, ChatTool, chat_message, chat_tool, check, check_model, read_body, schema
from services.api.state import API_STATE, ApiState
from services.api.tools import ToolChoice, check_tools

routes = web.RouteTableDef()


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Either ``prompt`` (text) or ``messages`` (a chat, with the chat-only fields)."""

    REQUIRED: ClassVar[tuple[str, ...]] = ()  # see services.api.protocol._Body
    RULES: ClassVar[tuple[dict[str, Any], ...]] = (
        {
            "oneOf": [
                {
                    "properties": {
                        "prompt": {"type": "string"},
                        "messages": {"type": "null"},
                        "tools": {"type": "null"},
                        "chat_template_kwargs": {"type": "null"},
                    },
                    "required": ["prompt"],
                },
                {"properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}, "required": ["messages"]},
            ]
        },
    )

    model: Annotated[str | None, schema("model_or_null")] = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage] | None, schema(minItems=1)] = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for a chat (its template adds them)
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    REQUIRED: ClassVar[tuple[str, ...]] = ("tokens",)
    RULES: ClassVar[tuple[dict[str, Any], ...]] = ()

    tokens: Annotated[list[int], schema("token_ids")]
    model: Annotated[str | None, schema("model_or_null")] = None


def _model(state: ApiState, model: str | None) -> None:
    if model is not None:
        check_model(model, state.model_id)


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    state = request.app[API_STATE]
    body: TokenizeRequest = await read_body(request, TokenizeRequest)
    _model(state, body.model)
    check((body.prompt is None) != (body.messages is None), "prompt", "send either prompt or messages")
    if body.prompt is not None:
        check(body.tools is None and body.chat_template_kwargs is None, "tools", "tools and chat_template_kwargs need messages")
        ids = await state.prompts.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        check(len(body.messages or []) > 0, "messages", "messages must be a non-empty list")
        tools = [chat_tool(tool, i) for i, tool in enumerate(body.tools or [])]
        choice = ToolChoice("auto" if tools else "none")
        check_tools(tools, choice, "tools", "tool_choice", name_field="function.name")  # as chat completions does
        turn = ChatTurn(
            messages=[chat_message(m, i) for i, m in enumerate(body.messages or [])],
            tools=tools,
            tool_choice=choice,
            template_kwargs=dict(body.chat_template_kwargs or {}),
            add_generation_prompt=body.add_generation_prompt,
            continue_final=body.continue_final_message,
        )
        prompt = await state.chat_format.render(state.prompts, turn)
        ids = await state.prompts.encode(prompt.text, add_special_tokens=True) if body.add_special_tokens else prompt.ids
    strs = await state.prompts.token_strings(ids) if body.return_token_strs else None
    return web.json_response({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs})


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    state = request.app[API_STATE]
    body: DetokenizeRequest = await read_body(request, DetokenizeRequest)
    _model(state, body.model)
    vocab = state.model.vocab_size
    check(all(0 <= t < vocab for t in body.tokens), "tokens", f"token ids must lie in the vocabulary [0, {vocab})")
    return web.json_response({"prompt": await state.prompts.decode(body.tokens)})
