"""One streamed request against an OpenAI-compatible endpoint (``shared.devtools.sse``), recorded with every
chunk's arrival time.

Tokens are counted from the usage the server reports (``stream_options.include_usage``), never from the
chunks: one chunk may carry several tokens (llama.cpp does this) or a token may carry no text yet. The
chunk times are recorded as they arrived; inter-token latency is the gap between text-bearing chunks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from bench.serve.workload import Workload
from shared.devtools.sse import stream


@dataclass
class RequestRecord:
    endpoint: str
    level: dict  # {"mode": "concurrency" | "rate", "value": ...}
    phase: str  # "warmup" (recorded, not counted) or "measured"
    index: int  # order within the level's phase
    prompt_index: int
    expected_tokens: int
    ignore_eos: bool
    start_s: float = 0.0  # perf_counter seconds at send, relative to the run's clock origin
    chunk_offsets_s: list[float] = field(default_factory=list)  # each text-bearing chunk, seconds after start
    chunk_chars: list[int] = field(default_factory=list)
    end_s: float | None = None  # seconds after start when the stream closed
    http_status: int | None = None
    error: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    round: int = 0  # which of the level's interleaved rounds sent it (warm-up: 0)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def count_problem(self) -> str | None:
        """Why the token count cannot be trusted, or None when it matches what was asked."""
        if self.completion_tokens is None:
            return "no usage reported"
        if self.ignore_eos and self.completion_tokens != self.expected_tokens:
            return f"{self.completion_tokens} tokens, {self.expected_tokens} asked with ignore_eos"
        if self.completion_tokens > self.expected_tokens:
            return f"{self.completion_tokens} tokens, more than max_tokens {self.expected_tokens}"
        if self.completion_tokens > 0 and not self.chunk_offsets_s:
            return f"{self.completion_tokens} tokens reported but no text streamed"
        return None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_offsets_s[0] if self.chunk_offsets_s else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_offsets_s, self.chunk_offsets_s[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1), as vLLM's benchmark defines it."""
        if self.ttft_s is None or self.end_s is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.end_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_json(self) -> dict:
        row = asdict(self)
        row.update(ok=self.ok, count_problem=self.count_problem)
        return row


def request_body(workload: Workload, model: str, prompt: str) -> tuple[str, dict]:
    """The route and body of one request of this workload."""
    body: dict = {
        "model": model,
        "max_tokens": workload.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **workload.sampling,
    }
    if workload.ignore_eos:
        body["ignore_eos"] = True
    if workload.api == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def stream_request(url: str, path: str, body: dict, record: RequestRecord, clock_origin: float, timeout_s: float | None = None) -> RequestRecord:
    """Sends one streamed request and fills in the record; every failure ends up in record.error, never raised."""
    result = await stream(url, path, body, timeout_s)
    record.start_s = result.start - clock_origin
    record.http_status = result.status
    record.error = result.error
    record.chunk_offsets_s = [t - result.start for t in result.chunk_times]
    record.chunk_chars = result.chunk_chars
    record.finish_reason = result.finish_reason
    record.prompt_tokens = result.usage.get("prompt_tokens")
    record.completion_tokens = result.usage.get("completion_tokens")
    if result.status == 200:
        record.end_s = result.end - result.start
    return record
