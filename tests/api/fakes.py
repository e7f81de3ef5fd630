"""A scripted engine for the api's tests: each request is answered with the text pieces a test queued."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from services.api.errors import ApiError
from shared.frames import EngineStatus, MemoryResized, MemorySplit, Submit, TextDelta, TextLogprobs, TokenText


class MatchedDelta(TextDelta):
    """A finishing delta that names the stop string, as ``TextDelta.matched`` will once the frame has it."""

    matched: str = ""


@dataclass
class Script:
    pieces: list[str]
    finish: str = "stop"
    matched: str = ""
    cached_tokens: int = 0
    delay_s: float = 0.0  # before each piece
    error: ApiError | None = None  # raised after the pieces instead of finishing


@dataclass
class ScriptedEngine:
    """Implements ``services.api.engine_client.Engine``; answers requests in order with the queued scripts."""

    scripts: list[Script] = field(default_factory=list)
    submits: list[Submit] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    status: EngineStatus = field(default_factory=lambda: EngineStatus(state="ready", detail="scripted"))
    streams: dict = field(default_factory=dict)
    running: dict = field(default_factory=dict)  # rid -> a future an interrupt sets to its error
    memory: MemorySplit = field(default_factory=lambda: MemorySplit(kv_blocks=2048, kv_block_bytes=8 * 30 * 2 * 3 * 64 * 2))  # SmolLM2's, no expert cache
    resizes: list[tuple[int, int]] = field(default_factory=list)  # (kv_cache_bytes, expert_cache_bytes) asked for
    resize_answer: MemoryResized | None = None  # the engine's answer (default: the split applied)

    def script(self, *pieces: str, **options) -> ScriptedEngine:
        self.scripts.append(Script(list(pieces), **options))
        return self

    @property
    def ready(self) -> bool:
        return self.status.state == "ready"

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def describe_state(self) -> tuple[str, str]:
        return self.status.state, self.status.detail

    def addresses(self) -> dict[str, str]:
        return {"inbox": "scripted://"}

    def describe_replicas(self) -> list[dict]:
        return [{"name": "scripted", "state": self.status.state}]

    def memory_splits(self) -> dict[str, MemorySplit]:
        return {"scripted": self.memory} if self.ready else {}

    async def resize_memory(self, kv_cache_bytes: int, expert_cache_bytes: int) -> dict[str, MemoryResized]:
        self.resizes.append((kv_cache_bytes, expert_cache_bytes))
        if self.resize_answer is not None:
            return {"scripted": self.resize_answer}
        split = self.memory
        if kv_cache_bytes >= 0:
            split = msgspec.structs.replace(split, kv_blocks=kv_cache_bytes // split.kv_block_bytes)
        if expert_cache_bytes >= 0:
            split = msgspec.structs.replace(
                split, expert_cache_bytes=expert_cache_bytes, expert_slots=min(expert_cache_bytes // split.expert_slot_bytes, split.experts)
            )
        self.memory = split
        return {"scripted": MemoryResized(id="scripted", split=split)}

    def interrupt(self, rid: str, error: ApiError) -> None:
        interrupted = self.running.get(rid)
        if interrupted is not None and not interrupted.done():
            self.aborted.append(rid)  # as EngineClient tells the replica to stop
            interrupted.set_result(error)

    async def generate(self, submit: Submit) -> AsyncIterator[TextDelta]:
        if not self.ready:
            raise ApiError(503, "the engine is not ready (scripted)", headers={"Retry-After": "1"})
        self.submits.append(submit)
        script = self.scripts.pop(0) if self.scripts else Script(["Hello", " world"])
        finished = False
        wanted = submit.sampling.logprobs
        interrupted = self.running[submit.rid] = asyncio.get_running_loop().create_future()
        try:
            for i, piece in enumerate(script.pieces):
                if script.delay_s:
                    await asyncio.wait({interrupted}, timeout=script.delay_s)
                if interrupted.done():
                    finished = True  # the interrupt recorded the abort
                    raise interrupted.result()
                last = i == len(script.pieces) - 1 and script.error is None
                tokens = min(i + 1, submit.max_tokens)
                logprobs = [] if wanted is None else [scripted_logprobs(piece, i, wanted)]
                if last:
                    finished = True
                    finish = "length" if script.finish == "length" else script.finish
                    yield MatchedDelta(
                        rid=submit.rid,
                        text=piece,
                        completion_tokens=tokens,
                        finish=finish,
                        prompt_tokens=len(submit.prompt_ids),
                        cached_tokens=script.cached_tokens,
                        matched=script.matched,
                        logprobs=logprobs,
                    )
                else:
                    yield TextDelta(rid=submit.rid, text=piece, completion_tokens=tokens, prompt_tokens=len(submit.prompt_ids), logprobs=logprobs)
            if script.error is not None:
                finished = True
                raise script.error
        finally:
            del self.running[submit.rid]
            if not finished:
                self.aborted.append(submit.rid)


def scripted_logprobs(piece: str, position: int, top: int) -> TextLogprobs:
    """Each piece is one token with logprob -(position + 1) / 10; its ``top`` alternatives are the piece then ``alt1``, ``alt2``…"""
    logprob = -(position + 1) / 10
    alternatives = [TokenText(piece, piece.encode(), logprob)] + [TokenText(f"alt{k}", f"alt{k}".encode(), logprob - k) for k in range(1, top)]
    return TextLogprobs(TokenText(piece, piece.encode(), logprob), alternatives[:top])
