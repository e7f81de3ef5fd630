"""The scheduler's state gauges read its state when Prometheus scrapes: no pass of the loop has to set them."""

from __future__ import annotations

import structlog
from prometheus_client import REGISTRY

from services.scheduler.loop import SchedulerLoop
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import FinishReason, Submit

log = structlog.get_logger()


def _scraped(name: str) -> float:
    return REGISTRY.get_sample_value(f"tokenyard:{name}")


def test_the_state_gauges_follow_admission_and_finishing_without_a_loop_pass(tmp_path) -> None:
    loop = SchedulerLoop(StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path)), log)
    for peer in loop.peers.values():
        peer.state, peer.seen, peer.serving = "ready", 1e18, True
    assert (_scraped("num_requests_running"), _scraped("num_requests_waiting"), _scraped("kv_blocks_used")) == (0, 0, 0)
    assert _scraped("kv_blocks_total") == loop.core.pool.num_blocks > 0

    loop._handle(Submit(rid="r1", prompt_ids=list(range(1, 40)), max_tokens=8))
    assert (_scraped("num_requests_running"), _scraped("num_requests_waiting")) == (0, 1)
    loop._plan_and_send()  # admitted: its prompt's blocks are held
    assert (_scraped("num_requests_running"), _scraped("num_requests_waiting")) == (1, 0)
    assert _scraped("kv_blocks_used") == len(loop.core.requests["r1"].blocks) > 0
    assert _scraped("kv_cache_usage_perc") == loop.core.pool.usage > 0

    loop._send(loop.core.finish("r1", FinishReason.ABORT))
    assert (_scraped("num_requests_running"), _scraped("kv_blocks_used")) == (0, 0)
    loop.close()
