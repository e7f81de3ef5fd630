"""Chat templates and tokenization, run in a thread pool so the event loop never blocks on them.

For a hybrid model's prefix cache the builder also finds the prompt's anchors: the token positions where
its rendered chat messages end, where the scheduler checkpoints the GDN state so that a later turn resumes
at its last unchanged message (``Submit.anchors``)."""

from __future__ import annotations

import asyncio
import bisect
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from services.api.errors import ApiError
from shared.tokenizer import load_tokenizer


class RenderedPrompt(NamedTuple):
    text: str  # the rendered template (its tail tells whether the template opened a reasoning block)
    ids: list[int]
    anchors: list[int] = []  # where rendered messages end, in tokens (ascending); only when the builder finds anchors


ANCHORED_MESSAGES = 16  # the last messages whose ends become anchors: a follow-up changes the tail of a conversation


class PromptBuilder:
    def __init__(self, model_dir: str, threads: int = 2, anchors: bool = False) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.anchors = anchors and self.tokenizer.is_fast  # find each rendered prompt's message ends (offsets need a fast tokenizer)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default") or next(iter(template.values()), None)
        self.chat_template: str = template or ""
        self.has_chat_template = bool(self.chat_template)

    async def _run(self, fn, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final: bool,
        template_kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None = None,
    ) -> RenderedPrompt:
        if not self.has_chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        return await self._run(self._chat, messages, add_generation_prompt, continue_final, template_kwargs, tools)

    def _chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final: bool,
        template_kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None,
    ) -> RenderedPrompt:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final,
                continue_final_message=continue_final,
                **template_kwargs,
            )
        except Exception as exc:  # jinja raise_exception(), a bad kwarg, a role the template refuses
            raise ApiError(400, f"the chat template could not render these messages: {exc}", param="messages") from exc
        if not self.anchors:
            return RenderedPrompt(text, self.tokenizer.encode(text, add_special_tokens=False))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, ends = encoded["input_ids"], [end for _, end in encoded["offset_mapping"]]
        return RenderedPrompt(text, ids, self._anchors(messages, text, ids, ends, tools, template_kwargs))

    def _anchors(
        self, messages: list[dict[str, Any]], text: str, ids: list[int], ends: list[int], tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any]
    ) -> list[int]:
        """Token counts of the prompt's prefixes that end a message: the template rendering the messages up to it
        gives a prefix of ``text`` that ends between two of its tokens. A prefix the template renders otherwise (or
        refuses) is no anchor; the end of the prompt always is."""
        anchors = []
        for count in range(max(1, len(messages) - ANCHORED_MESSAGES + 1), len(messages) + 1):
            try:
                prefix = self.tokenizer.apply_chat_template(messages[:count], tools=tools, tokenize=False, **template_kwargs)
            except Exception:  # a template that refuses a conversation ending there
                continue
            if not text.startswith(prefix):
                continue
            tokens = bisect.bisect_right(ends, len(prefix))
            if tokens and ends[tokens - 1] == len(prefix):
                anchors.append(tokens)
        return sorted({*anchors, len(ids)})

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def count_tokens(self, text: str) -> int:
        """Tokens in a piece of output text (no special tokens added), e.g. an answer's reasoning."""
        return len(await self.encode(text, add_special_tokens=False)) if text else 0

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(self.tokenizer.decode, token_ids)

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        return await self._run(self.tokenizer.convert_ids_to_tokens, token_ids)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
