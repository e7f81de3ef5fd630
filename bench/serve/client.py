"""One streamed request against an OpenAI-compatible endpoint, recorded with every chunk's arrival time.

Tokens are counted from the usage the server reports (``stream_options.include_usage``), never from the
chunks: one chunk may carry several tokens (llama.cpp does this) or a token may carry no text yet. The
chunk times are recorded as they arrived; inter-token latency is the gap between text-bearing chunks.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from bench.serve.workload import Workload


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


def _chunk_text(choice: dict) -> str:
    delta = choice.get("delta")
    if delta is not None:  # chat
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def stream_request(session: aiohttp.ClientSession, url: str, path: str, body: dict, record: RequestRecord, clock_origin: float) -> RequestRecord:
    """Sends one streamed request and fills in the record; every failure ends up in record.error, never raised."""
    started = time.perf_counter()
    record.start_s = started - clock_origin
    try:
        async with session.post(url.rstrip("/") + path, json=body) as response:
            record.http_status = response.status
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return record
            done = False
            async for raw_line in response.content:
                now = time.perf_counter()
                line = raw_line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    record.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return record
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    record.completion_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    text = _chunk_text(choice)
                    if text:
                        record.chunk_offsets_s.append(now - started)
                        record.chunk_chars.append(len(text))
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
            record.end_s = time.perf_counter() - started
            if not done:
                record.error = "the stream ended without [DONE]"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    return record
