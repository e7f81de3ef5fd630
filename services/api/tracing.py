"""The api's spans (with ``--otlp-traces-endpoint``): a server span per POST request, continuing the client's W3C
``traceparent`` (a new trace without one); under it a ``preprocess`` span (validation, chat template and
tokenization, up to the engine requests) and one ``llm_request`` span per engine request, from its arrival to
its finish, with the GenAI attributes. An ``llm_request``'s context travels in ``Submit.trace`` to the scheduler,
whose spans are its children. Without the flag none of this is installed (create_app and engine_run choose once).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from services.api.errors import ApiError
from shared import tracing
from shared.frames import Submit, TextDelta


@dataclass
class _Preprocess:
    span: Span | None  # ended when the engine requests are built


_PREPROCESS: ContextVar[_Preprocess | None] = ContextVar("tokenyard_preprocess_span", default=None)


class ApiTracing:
    def __init__(self, tracer: trace.Tracer, model_id: str) -> None:
        self.tracer = tracer
        self.model_id = model_id

    def middleware(self) -> Callable[[web.Request, Callable[[web.Request], Awaitable[web.StreamResponse]]], Awaitable[web.StreamResponse]]:
        tracer = self.tracer

        @web.middleware
        async def tracing_middleware(request: web.Request, handler) -> web.StreamResponse:
            if request.method != "POST":  # health, metrics and the like stay untraced
                return await handler(request)
            route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
            attributes = {"http.request.method": request.method, "http.route": route, tracing.MODEL: self.model_id}
            with tracer.start_as_current_span(
                f"POST {route}", context=tracing.context_of(request.headers), kind=SpanKind.SERVER, attributes=attributes
            ) as span:
                preprocess = _Preprocess(tracer.start_span("preprocess"))
                token = _PREPROCESS.set(preprocess)
                try:
                    response = await handler(request)
                    span.set_attribute("http.response.status_code", response.status)
                    if response.status >= 400:
                        span.set_status(Status(StatusCode.ERROR, f"HTTP {response.status}"))
                    return response
                finally:
                    _PREPROCESS.reset(token)
                    if preprocess.span is not None:  # refused before any engine request
                        preprocess.span.end()

        return tracing_middleware

    def prompt_rendered(self, prompt_tokens: int) -> None:
        """The chat template applied and the prompt tokenized."""
        if (preprocess := _PREPROCESS.get()) is not None and preprocess.span is not None:
            preprocess.span.add_event("chat_template_applied", {tracing.INPUT_TOKENS: prompt_tokens})

    def follow(self, stream: AsyncIterator[tuple[int, TextDelta]], submits: list[Submit]) -> AsyncIterator[tuple[int, TextDelta]]:
        """Ends the preprocess span, opens each engine request's span (its context into ``submit.trace``) and
        returns ``stream`` observed: each span ends at its request's finish, or when the stream ends without one."""
        if (preprocess := _PREPROCESS.get()) is not None and preprocess.span is not None:
            preprocess.span.set_attribute("tokenyard.engine_requests", len(submits))
            preprocess.span.end()
            preprocess.span = None
        spans = []
        for submit in submits:
            span = self.tracer.start_span(
                "llm_request",
                start_time=int(submit.arrival_time * 1e9),
                attributes={
                    tracing.MODEL: self.model_id,
                    tracing.REQUEST_ID: submit.rid,
                    tracing.INPUT_TOKENS: len(submit.prompt_ids),
                    tracing.MAX_TOKENS: submit.max_tokens,
                    tracing.TEMPERATURE: submit.sampling.temperature,
                    tracing.TOP_P: submit.sampling.top_p,
                },
            )
            if span.is_recording():  # a trace the client's sampling decision dropped costs the engine nothing
                submit.trace = tracing.traceparent(span)
            spans.append(span)
        return self._observe(stream, submits, spans)

    async def _observe(self, stream: AsyncIterator[tuple[int, TextDelta]], submits: list[Submit], spans: list[Span]) -> AsyncIterator[tuple[int, TextDelta]]:
        first_token = [0.0] * len(spans)
        unfinished = set(range(len(spans)))
        try:
            async for index, delta in stream:
                if not first_token[index] and (delta.completion_tokens or delta.finish):
                    first_token[index] = time.time()
                    spans[index].set_attribute(tracing.TIME_TO_FIRST_TOKEN, first_token[index] - submits[index].arrival_time)
                if delta.finish:
                    span = spans[index]
                    span.set_attribute(tracing.OUTPUT_TOKENS, delta.completion_tokens)
                    span.set_attribute(tracing.FINISH_REASONS, [str(delta.finish)])
                    span.set_attribute(tracing.E2E, time.time() - submits[index].arrival_time)
                    span.end()
                    unfinished.discard(index)
                yield index, delta
        except ApiError as exc:
            for index in unfinished:
                spans[index].set_status(Status(StatusCode.ERROR, exc.message))
            raise
        finally:
            for index in unfinished:  # failed, or the answer ended early (the client went away)
                spans[index].add_event("ended_unfinished")
                spans[index].end()
