"""The api's request metrics, under the names vLLM dashboards already use (prefix ``tokenyard:``)."""

from __future__ import annotations

import functools
import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from shared.metrics import PREFIX

_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)

TTFT = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to first token", ["model_name"], buckets=_TTFT_BUCKETS)
ITL = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between consecutive output deltas", ["model_name"], buckets=_ITL_BUCKETS)
E2E = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Request latency from arrival to finish", ["model_name"], buckets=_LATENCY_BUCKETS)
PROMPT_TOKENS_HIST = Histogram(f"{PREFIX}request_prompt_tokens", "Prompt tokens per request", ["model_name"], buckets=_TOKEN_BUCKETS)
GENERATION_TOKENS_HIST = Histogram(f"{PREFIX}request_generation_tokens", "Generated tokens per request", ["model_name"], buckets=_TOKEN_BUCKETS)
PROMPT_TOKENS = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens processed", ["model_name"])
GENERATION_TOKENS = Counter(f"{PREFIX}generation_tokens", "Tokens generated", ["model_name"])
REQUEST_SUCCESS = Counter(f"{PREFIX}request_success", "Requests finished, by reason", ["model_name", "finished_reason"])
HTTP_REQUESTS = Counter(f"{PREFIX}http_requests", "HTTP requests answered", ["route", "status"])
IN_FLIGHT = Gauge(f"{PREFIX}requests_in_flight", "Generation requests being served", ["model_name"])

# Per engine replica (the router's view).
ROUTED = Counter(f"{PREFIX}router_requests", "Engine requests routed to each replica", ["replica"])
REPLICA_READY = Gauge(f"{PREFIX}engine_replica_ready", "1 while the replica is in rotation (ready and heard from)", ["replica"])
REPLICA_IN_FLIGHT = Gauge(f"{PREFIX}engine_replica_in_flight", "This api's engine requests in flight on each replica", ["replica"])
REPLICA_FAILED = Counter(f"{PREFIX}engine_replica_failed_requests", "Requests failed because their replica left rotation", ["replica"])
REPLICA_LATENCY = Histogram(
    f"{PREFIX}engine_replica_request_latency_seconds", "Engine request latency from submit to finish, by replica", ["replica"], buckets=_LATENCY_BUCKETS
)


@functools.cache
def _itl_of(model_name: str) -> Any:
    return ITL.labels(model_name)


class RequestTimer:
    """Records one engine request's latencies as its deltas arrive."""

    def __init__(self, model_name: str, prompt_tokens: int) -> None:
        self.model = model_name
        self.prompt_tokens = prompt_tokens
        self.arrival = time.perf_counter()
        self.last: float | None = None
        self.itl = _itl_of(model_name)  # observed every token: its labelled child looked up once

    def on_delta(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            TTFT.labels(self.model).observe(now - self.arrival)
        else:
            self.itl.observe(now - self.last)
        self.last = now

    def on_finish(self, reason: str, completion_tokens: int) -> None:
        E2E.labels(self.model).observe(time.perf_counter() - self.arrival)
        PROMPT_TOKENS.labels(self.model).inc(self.prompt_tokens)
        GENERATION_TOKENS.labels(self.model).inc(completion_tokens)
        PROMPT_TOKENS_HIST.labels(self.model).observe(self.prompt_tokens)
        GENERATION_TOKENS_HIST.labels(self.model).observe(completion_tokens)
        REQUEST_SUCCESS.labels(self.model, reason).inc()
