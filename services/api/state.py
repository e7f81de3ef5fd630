"""What the api's handlers share: configuration, model facts, the tokenizer and the engine client."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.api.admission import Admission
from services.api.chat import ChatFormat
from services.api.engine_client import Engine
from services.api.templating import PromptBuilder
from services.api.tracing import ApiTracing
from shared.config import StackConfig
from shared.model_info import ModelInfo


@dataclass
class ApiState:
    config: StackConfig
    model: ModelInfo
    prompts: PromptBuilder
    engine: Engine
    chat_format: ChatFormat
    admission: Admission
    keepalive_s: float = 10.0  # Anthropic streams send a ping after this long without an event
    tracing: ApiTracing | None = None  # with --otlp-traces-endpoint
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_id(self) -> str:
        return self.config.model_id

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len or self.model.max_position_embeddings

    @property
    def eos_token_ids(self) -> list[int]:
        ids = set(self.model.eos_token_ids)
        if self.prompts.tokenizer.eos_token_id is not None:
            ids.add(self.prompts.tokenizer.eos_token_id)
        return sorted(ids)

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "tokenyard",
            "root": self.model.path,
            "max_model_len": self.max_model_len,
            "context_length": self.max_model_len,
            "reasoning_efforts": list(self.chat_format.efforts),
            "tool_call_parser": self.chat_format.tool_parser,
        }


API_STATE = web.AppKey("api_state", ApiState)
"""Where the application keeps its ApiState."""
