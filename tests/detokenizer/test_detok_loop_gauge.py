"""The detokenizer's gauge of tracked requests is read when Prometheus scrapes: opened and finished requests show at once."""

from __future__ import annotations

import structlog
from prometheus_client import REGISTRY

from services.detokenizer.loop import DetokenizerLoop
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import StreamOpen, TokenBatch, TokenDelta


def test_the_tracked_requests_gauge_follows_opening_and_finishing(tmp_path) -> None:
    loop = DetokenizerLoop(StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path)), structlog.get_logger())
    loop.load_tokenizer()
    tracked = lambda: REGISTRY.get_sample_value("tokenyard:detokenizer_requests")  # noqa: E731
    assert tracked() == 0
    hi = loop.tokenizer.encode("Hi")
    loop.handle(TokenBatch(opened=[StreamOpen(rid=f"r{i}", prompt_tokens=3, max_tokens=len(hi)) for i in range(3)]))
    assert tracked() == 3
    loop.handle(TokenBatch(deltas=[TokenDelta(rid="r1", token_ids=hi)]))  # its max_tokens: the request ends
    assert tracked() == 2
    loop.to_api.close()
    loop.to_scheduler.close()
    loop.inbox.close()
