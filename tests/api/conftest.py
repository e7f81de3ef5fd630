"""The api in-process around a scripted engine, reached through aiohttp and the official SDKs.

``api_for(model_dir)`` serves a model directory; ``qwen3_like_dir`` is the embedded
tokenizer with a Qwen3-style chat template (tools, tool results, ``enable_thinking``), so
tool and reasoning paths run without a model that was trained for them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import anthropic
import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from services.api.app import create_app
from services.api.state import API_STATE
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from tests.api.fakes import ScriptedEngine

QWEN3_LIKE_TEMPLATE = """
{%- if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function with <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif open_think is defined and open_think %}<think>
{% endif %}
{%- endif %}
"""


def model_dir_with_template(path: str, template: str, family: str) -> str:
    """The embedded model's tokenizer and config, with another chat template and model family."""
    os.makedirs(path, exist_ok=True)
    for name in ("tokenizer.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(os.path.join(DEFAULT_MODEL_DIR, name), path)
    with open(os.path.join(DEFAULT_MODEL_DIR, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    tokenizer_config["chat_template"] = template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f)
    with open(os.path.join(DEFAULT_MODEL_DIR, "config.json")) as f:
        config = json.load(f)
    config["model_type"] = family
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@dataclass
class Api:
    engine: ScriptedEngine
    client: TestClient
    model: str
    _openai: openai.AsyncOpenAI | None = None
    _anthropic: anthropic.AsyncAnthropic | None = None

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")

    @property
    def state(self):
        return self.client.app[API_STATE]

    def openai(self) -> openai.AsyncOpenAI:
        # One client per server, closed with it: an SDK client dropped unclosed stalls servers started after it.
        if self._openai is None:
            self._openai = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=30)
        return self._openai

    def anthropic(self) -> anthropic.AsyncAnthropic:
        if self._anthropic is None:
            self._anthropic = anthropic.AsyncAnthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=30)
        return self._anthropic

    async def close(self) -> None:
        for sdk in (self._openai, self._anthropic):
            if sdk is not None:
                await sdk.close()
        await self.client.close()

    async def post(self, path: str, body: dict, **kwargs) -> tuple[int, dict | str]:
        response = await self.client.post(path, json=body, **kwargs)
        text = await response.text()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text

    def prompt(self, index: int = -1) -> str:
        """The text of a submitted prompt, as the engine received it."""
        return self.state.prompts.tokenizer.decode(self.engine.submits[index].prompt_ids)


async def start_api(model_dir: str, **settings) -> Api:
    """The api on ``model_dir`` around a fresh scripted engine; ``settings`` are further StackConfig fields."""
    engine = ScriptedEngine()
    app = create_app(StackConfig(model=model_dir, **settings), engine_factory=lambda config: engine)
    client = TestClient(TestServer(app, handler_cancellation=True))  # as in production: a client gone cancels its handler
    await client.start_server()
    return Api(engine=engine, client=client, model=os.path.basename(os.path.normpath(model_dir)))


@pytest.fixture(scope="session")
def qwen3_like_dir(tmp_path_factory) -> str:
    return model_dir_with_template(str(tmp_path_factory.mktemp("models") / "Qwen3-Like"), QWEN3_LIKE_TEMPLATE, "qwen3")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def smol_server() -> Api:
    api = await start_api(DEFAULT_MODEL_DIR)
    yield api
    await api.close()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def qwen_server(qwen3_like_dir: str) -> Api:
    api = await start_api(qwen3_like_dir)
    yield api
    await api.close()


def _fresh(api: Api) -> Api:
    """Each test starts with no queued scripts and no recorded submits."""
    api.engine.scripts.clear()
    api.engine.submits.clear()
    api.state.keepalive_s = 10.0
    return api


@pytest_asyncio.fixture(loop_scope="module")
async def smol(smol_server: Api) -> Api:
    """The embedded SmolLM2: no tools and no reasoning in its template."""
    return _fresh(smol_server)


@pytest_asyncio.fixture(loop_scope="module")
async def qwen(qwen_server: Api) -> Api:
    """A Qwen3-style template (tools, tool results, enable_thinking) on the embedded tokenizer."""
    return _fresh(qwen_server)
