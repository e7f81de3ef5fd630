"""Fan-out of one HTTP request into engine requests (one per prompt and sample), merged back.

Choice ``index`` is ``prompt_index * n + sample_index``, as in the OpenAI API. Every
engine request is aborted if the merged stream is closed before it finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import msgspec

from services.api.admission import Ticket
from services.api.engine_client import Engine
from services.api.errors import ApiError
from services.api.metrics import IN_FLIGHT, RequestTimer
from services.api.output_parsing import Event, OutputParser
from services.api.protocol import Generation
from services.api.reasoning import thinks
from services.api.structured_outputs import check_grammar, tool_call_grammar, tool_parameters_grammar
from shared.frames import Grammar, Submit, TextDelta, TextLogprobs

if TYPE_CHECKING:
    from services.api.chat import ChatTurn
    from services.api.state import ApiState
    from services.api.templating import RenderedPrompt


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TextLogprobs] = field(default_factory=list)  # every output token's, when asked for


def context_limit(prompt_len: int, generation: Generation, max_model_len: int, prompt_param: str) -> int:
    """The request's max_tokens, checked against the model's context."""
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has {prompt_len} tokens, "
            "which leaves no room for output. Please reduce the length of the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if generation.max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + generation.max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + generation.max_tokens} tokens ({prompt_len} in the prompt, {generation.max_tokens} in the completion). "
            "Please reduce the length of the prompt or the completion.",
            param=generation.max_tokens_param,
            code="context_length_exceeded",
        )
    return generation.max_tokens


def build_submits(generation: Generation, prompts: list[list[int]], max_tokens: list[int], eos_ids: list[int], reply_to: str) -> list[Submit]:
    submits = []
    now = time.time()
    for prompt_ids, limit in zip(prompts, max_tokens):
        for sample in range(generation.n):
            sampling = generation.sampling
            if sampling.seed is not None and sample:  # n seeded samples must differ from each other
                sampling = type(sampling)(**{**{f: getattr(sampling, f) for f in sampling.__struct_fields__}, "seed": sampling.seed + sample})
            submits.append(
                Submit(
                    rid=uuid.uuid4().hex,
                    prompt_ids=prompt_ids,
                    max_tokens=limit,
                    sampling=sampling,
                    stop_token_ids=sorted(set(eos_ids) | set(generation.stop_token_ids)),
                    stop=generation.stop,
                    ignore_eos=generation.ignore_eos,
                    min_tokens=generation.min_tokens,
                    skip_special_tokens=generation.skip_special_tokens,
                    arrival_time=now,
                    reply_to=reply_to,
                )
            )
    return submits


async def merged_stream(engine: Engine, submits: list[Submit], model_name: str, ticket: Ticket) -> AsyncIterator[tuple[int, TextDelta]]:
    """(choice index, delta) pairs from every engine request until all have finished.

    An ApiError from any engine request is raised here (and the others are aborted); the admission
    gate's interrupt (a drain) fails every engine request still running with its error.
    """

    def interrupt(error: ApiError) -> None:
        for submit in submits:
            engine.interrupt(submit.rid, error)

    ticket.on_interrupt = interrupt
    if len(submits) == 1:  # read in place: a task between the engine's stream and the handler costs a hop per token
        async with contextlib.aclosing(_timed(engine, submits[0], model_name, ticket)) as deltas:  # closed with this one: aborted
            async for delta in deltas:
                yield 0, delta
        return

    queue: asyncio.Queue[tuple[int, TextDelta | ApiError]] = asyncio.Queue()

    async def pump(index: int, submit: Submit) -> None:
        try:
            async for delta in _timed(engine, submit, model_name, ticket):
                queue.put_nowait((index, delta))
        except ApiError as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(submits)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, ApiError):
                raise item
            if item.finish:
                remaining -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _timed(engine: Engine, submit: Submit, model_name: str, ticket: Ticket) -> AsyncIterator[TextDelta]:
    """One engine request's deltas, timed for the latency metrics; raises an interrupt that came before it
    started (from then on ``engine.interrupt`` reaches it: nothing awaits between the check and its start)."""
    if ticket.error is not None:
        raise ticket.error
    timer = RequestTimer(model_name, len(submit.prompt_ids))
    async with contextlib.aclosing(engine.generate(submit)) as deltas:
        async for delta in deltas:
            timer.on_delta()
            if delta.finish:
                timer.on_finish(delta.finish, delta.completion_tokens)
            yield delta


@contextlib.asynccontextmanager
async def engine_run(state: ApiState, submits: list[Submit]) -> AsyncIterator[AsyncIterator[tuple[int, TextDelta]]]:
    """One HTTP request's engine requests as one merged stream, admitted (429 when full, 503 when draining),
    counted in flight, and aborted if the answer ends early."""
    model_name = state.model_id
    with state.admission.admit(len(submits)) as ticket:
        stream = merged_stream(state.engine, submits, model_name, ticket)
        answer = stream if state.tracing is None else state.tracing.follow(stream, submits)
        IN_FLIGHT.labels(model_name).inc()
        try:
            yield answer
        finally:
            IN_FLIGHT.labels(model_name).dec()
            await answer.aclose()
            await stream.aclose()


async def collect(stream: AsyncIterator[tuple[int, TextDelta]], count: int) -> list[ChoiceResult]:
    """Every choice's full text, for non-streaming responses."""
    choices = [ChoiceResult(index=i) for i in range(count)]
    parts: list[list[str]] = [[] for _ in range(count)]
    async for index, delta in stream:
        parts[index].append(delta.text)
        choices[index].logprobs += delta.logprobs
        if delta.finish:
            choices[index].finish_reason = delta.finish
            choices[index].completion_tokens = delta.completion_tokens
            choices[index].cached_tokens = delta.cached_tokens
    for choice, texts in zip(choices, parts):
        choice.text = "".join(texts)
    return choices


async def parsed_stream(stream: AsyncIterator[tuple[int, TextDelta]], parsers: list[OutputParser]) -> AsyncIterator[tuple[int, list[Event], TextDelta]]:
    """(choice index, parsed events, delta): each choice's text through its own parser, flushed at its finish."""
    async for index, delta in stream:
        events = parsers[index].feed(delta.text)
        if delta.finish:
            events += parsers[index].finish()
        yield index, events, delta


async def collect_parsed(stream: AsyncIterator[tuple[int, TextDelta]], parsers: list[OutputParser]) -> list[ChoiceResult]:
    """Every choice's finish and counts for a non-streaming response; the text is in each parser."""
    choices = [ChoiceResult(index=i) for i in range(len(parsers))]
    async for index, _, delta in parsed_stream(stream, parsers):
        choices[index].logprobs += delta.logprobs
        if delta.finish:
            choices[index].finish_reason = delta.finish
            choices[index].completion_tokens = delta.completion_tokens
            choices[index].cached_tokens = delta.cached_tokens
    for choice, parser in zip(choices, parsers):
        choice.text = parser.content
    return choices


async def chat_submits(state: ApiState, turn: ChatTurn, generation: Generation, prompt_param: str) -> tuple[RenderedPrompt, list[Submit]]:
    """A conversation's rendered prompt and its engine requests, checked against the context limit."""
    prompt = await state.chat_format.render(state.prompts, turn)
    if state.tracing is not None:
        state.tracing.prompt_rendered(len(prompt.ids))
    max_tokens = context_limit(len(prompt.ids), generation, state.max_model_len, prompt_param)
    generation = await _with_grammar(state, turn, generation)
    submits = build_submits(generation, [prompt.ids], [max_tokens], state.eos_token_ids, state.config.api_address)
    for submit in submits:  # where a hybrid model checkpoints its GDN state (none unless the builder finds anchors)
        submit.anchors = prompt.anchors
    return prompt, submits


async def _with_grammar(state: ApiState, turn: ChatTurn, generation: Generation) -> Generation:
    """The chat's grammar: the answer's (``response_format`` and the like), or the structural tag that holds its tool
    calls; from the end of the reasoning block on where the model thinks first; parsed in the api's thread pool."""
    sampling, param = generation.sampling, generation.grammar_param
    for i, tool in enumerate(turn.tools):
        if tool.strict:
            await check_grammar_off_loop(state, tool_parameters_grammar(tool, f"tools[{i}]"), f"tools[{i}]")
    calls = tool_call_grammar(turn.shown_tools, turn.tool_choice, state.chat_format.tool_parser, sampling.grammar)
    if calls is not None:
        sampling, param = msgspec.structs.replace(sampling, grammar=calls), param or "tools"
    if sampling.grammar is not None and state.chat_format.reasoning_tags and thinks(turn.effort, state.chat_format.efforts):
        end = state.chat_format.reasoning_tags[1]
        sampling = msgspec.structs.replace(sampling, grammar_after=state.prompts.tokenizer.encode(end, add_special_tokens=False))
    if sampling.grammar is not None:
        await check_grammar_off_loop(state, sampling.grammar, param)
    return replace(generation, sampling=sampling, grammar_param=param)


async def check_grammar_off_loop(state: ApiState, grammar: Grammar | None, param: str) -> None:
    """``check_grammar`` in the api's thread pool: a schema that takes long to parse holds up no other request."""
    if grammar is not None:
        await asyncio.get_running_loop().run_in_executor(state.prompts.pool, check_grammar, grammar, param or "structured_outputs")
