"""/openapi.json says what the api accepts: schemathesis generates requests from the document for every operation,
sends them to a real api on loopback (around the scripted engine) and checks each answer:

- ``not_a_server_error``: no 5xx, whatever is sent;
- ``positive_data_acceptance``: a request the document calls valid is not refused with a 4xx;
- ``negative_data_rejection``: a request the document calls invalid is refused with a 4xx;
- ``status_code_conformance``, ``content_type_conformance``, ``response_schema_conformance`` and the header checks:
  answers are as documented (errors in the protocol's shape, a 405 with its ``Allow``).

Its coverage phase sends each bound's edge values and its fuzzing phase random requests, from a fixed seed.
What the document does not say (services.api.openapi lists it) the api refuses with a 400 that the positive
check reports; of those, the test lets through only the context-length refusal (a prompt's length in tokens is
not a JSON Schema keyword), and brings generated values to what the api reads: a float with no fraction where
an integer goes (JSON Schema's ``integer`` takes 1.0; the api, like OpenAI's, wants 1), and the rules across
fields in ``_within_unstated_rules``. The rest are rare enough that this seed does not meet them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from aiohttp import web
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events

from services.api.app import create_app
from services.api.protocol import MAX_BATCH_CHOICES, MAX_CHOICES
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from tests.api.fakes import ScriptedEngine

EXAMPLES_PER_OPERATION = 25  # fuzzing; the coverage phase adds each bound's edge cases (about 1,900 requests in all)
CONFIG = {
    "seed": 20261205,
    "cache": {"enabled": False},  # no replay of earlier runs' failures: every run is the seed's
    "generation": {"max-examples": EXAMPLES_PER_OPERATION, "deterministic": True, "database": "none"},
    "phases": {"examples": {"enabled": False}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True}, "stateful": {"enabled": False}},
}


CONTEXT_REFUSAL = b"maximum context length"  # a valid request whose rendered prompt and max_tokens exceed the context
# /v1/admin/memory: a split the engine's current one cannot take (no expert cache here; a KV cache below max_model_len)
SPLIT_REFUSALS = (b"fewer than one request of max_model_len", b"without an expert cache")


def _serve(ready: threading.Event, address: list[str], stop: list[Any]) -> None:
    async def main() -> None:
        engine = ScriptedEngine()
        app = create_app(StackConfig(model=DEFAULT_MODEL_DIR), engine_factory=lambda config: engine)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
        address.append(f"http://{host}:{port}")
        done = asyncio.Event()
        stop.append((asyncio.get_running_loop(), done))
        ready.set()
        await done.wait()
        await runner.cleanup()

    asyncio.run(main())


@pytest.fixture(scope="module")
def api_url() -> Iterator[str]:
    """A real api process's HTTP server, on loopback, in a thread of its own (schemathesis' client blocks)."""
    ready, address, stop = threading.Event(), [], []
    thread = threading.Thread(target=_serve, args=(ready, address, stop), daemon=True)
    thread.start()
    assert ready.wait(60), "the api did not start"
    yield address[0]
    loop, done = stop[0]
    loop.call_soon_threadsafe(done.set)
    thread.join(10)


def _integral_floats_as_ints(value: Any) -> Any:
    """JSON Schema's ``integer`` takes 1.0; the api reads integers as JSON writes them (1), as OpenAI's does."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_as_ints(item) for item in value]
    if isinstance(value, dict):
        return {key: _integral_floats_as_ints(item) for key, item in value.items()}
    return value


def _within_unstated_rules(body: Any) -> Any:
    """A generated body brought within the rules across fields that the document does not state, where its values
    are otherwise in bounds (so that a body invalid for another reason stays invalid): a completions batch times n,
    ``min_tokens`` at most ``max_tokens``, ``max_completion_tokens`` equal to ``max_tokens``, and tool names unique."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    n, prompt, max_tokens, least = out.get("n"), out.get("prompt"), out.get("max_tokens"), out.get("min_tokens")
    if isinstance(n, int) and 1 <= n <= MAX_CHOICES and isinstance(prompt, list) and 1 <= len(prompt) <= MAX_BATCH_CHOICES:
        if all(isinstance(p, (str, list)) for p in prompt):
            out["n"] = min(n, MAX_BATCH_CHOICES // len(prompt))
    if isinstance(max_tokens, int) and max_tokens >= 1 and isinstance(least, int) and least > max_tokens:
        out["min_tokens"] = max_tokens
    if isinstance(max_tokens, int) and isinstance(out.get("max_completion_tokens"), int):
        out["max_completion_tokens"] = max_tokens
    if isinstance(out.get("tools"), list):
        out["tools"] = [_renamed(tool, i) for i, tool in enumerate(out["tools"])]
    return out


def _renamed(tool: Any, index: int) -> Any:
    """A tool whose (valid) name is made unique among the request's tools."""
    holder = tool.get("function", tool) if isinstance(tool, dict) else None
    name = holder.get("name") if isinstance(holder, dict) else None
    if not isinstance(name, str) or not 1 <= len(name) <= 120:
        return tool
    renamed = {**holder, "name": f"{name}_{index}"}
    return {**tool, "function": renamed} if holder is not tool else renamed


def test_the_api_accepts_what_its_document_calls_valid_and_refuses_the_rest(api_url: str) -> None:
    # schemathesis' engine (its CLI's, as a library; its pytest plugin does not run under pytest 9): the coverage and
    # fuzzing phases over every operation, with every check
    schema = schemathesis.openapi.from_url(f"{api_url}/openapi.json", config=SchemathesisConfig.from_dict(CONFIG))

    @schema.hook
    def map_body(context, body):  # noqa: ANN001, ANN202
        return _within_unstated_rules(_integral_floats_as_ints(body))

    cases, context_refusals, failures, errors = 0, 0, [], []
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, (events.ScenarioFinished, events.FuzzScenarioFinished)):
            cases += len(event.recorder.cases)
            for case_id, checks in event.recorder.checks.items():
                for check in checks:
                    if check.failure_info is not None:
                        interaction = event.recorder.interactions.get(case_id)
                        request = interaction.request if interaction else None
                        response = interaction.response if interaction else None
                        if check.name == "positive_data_acceptance" and response is not None and CONTEXT_REFUSAL in (response.content or b""):
                            context_refusals += 1  # the prompt's length in tokens: no JSON Schema can state it
                            continue
                        if (
                            check.name == "positive_data_acceptance"
                            and request is not None
                            and request.uri.endswith("/v1/admin/memory")
                            and any(words in (response.content or b"") for words in SPLIT_REFUSALS)
                        ):
                            continue  # the engine's split bounds it, not the document
                        failures.append(
                            f"{check.name}: {check.failure_info.failure.title} {request.method if request else ''} {request.uri if request else ''}"
                            f" {request.body[:300] if request and request.body else ''!r} -> {response.status_code if response else ''}"
                            f" {response.content[:300] if response and response.content else ''!r}"
                        )
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            errors.append(repr(getattr(event, "value", event)))
    assert not errors, errors
    assert not failures, "\n".join(sorted(set(failures))[:20])
    assert cases > 1000 and context_refusals < cases / 100, (cases, context_refusals)
