"""Several api replicas share one engine: the scheduler and the detokenizer answer each request's
owner (``Submit.reply_to``), and every api replica that announced itself gets the engine's status."""

from __future__ import annotations

import structlog
import zmq

from services.detokenizer.loop import DetokenizerLoop
from services.scheduler.loop import SchedulerLoop
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import ApiAnnounce, EngineStatus, Error, StreamOpen, Submit, TextBatch, TokenBatch, TokenDelta
from shared.transport import Inbox

log = structlog.get_logger()


def _drain(inbox: Inbox) -> list:
    frames = []
    for _ in range(20):
        got = list(inbox.recv(50))
        frames += got
        if not got and frames:
            break
    return frames


def _apis(tmp_path) -> tuple[zmq.Context, dict[str, Inbox]]:
    ctx = zmq.Context()
    return ctx, {name: Inbox(ctx, f"ipc://{tmp_path}/{name}.sock", name) for name in ("api-a", "api-b")}


def test_scheduler_errors_go_to_the_owner_and_status_to_every_announced_api(tmp_path) -> None:
    ctx, apis = _apis(tmp_path)
    loop = SchedulerLoop(StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path / "run")), log)
    for name, inbox in apis.items():
        loop._handle(ApiAnnounce(replica=name, address=inbox.address, engine=f"engine-as-seen-by-{name}"))
    loop._send_status()
    loop._handle(Submit(rid="r-b", prompt_ids=[1, 2], max_tokens=4, reply_to=apis["api-b"].address))  # not ready: refused
    got = {name: _drain(inbox) for name, inbox in apis.items()}
    assert [f.engine for f in got["api-a"] if isinstance(f, EngineStatus)] == ["engine-as-seen-by-api-a"]
    assert [f.engine for f in got["api-b"] if isinstance(f, EngineStatus)] == ["engine-as-seen-by-api-b"]
    assert [f.rid for f in got["api-b"] if isinstance(f, Error)] == ["r-b"]
    assert not [f for f in got["api-a"] if isinstance(f, Error)]
    ctx.destroy(0)


def test_detokenizer_sends_each_request_text_to_its_owner(tmp_path) -> None:
    ctx, apis = _apis(tmp_path)
    loop = DetokenizerLoop(StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path / "run")), log)
    loop.load_tokenizer()
    hello = loop.tokenizer.encode("Hello there")
    opened = [StreamOpen(rid=f"r-{name}", prompt_tokens=1, max_tokens=len(hello), reply_to=inbox.address) for name, inbox in apis.items()]
    opened.append(StreamOpen(rid="r-bad", prompt_tokens=1, max_tokens=len(hello), reply_to="not-an-address"))  # refused, not raised
    loop.handle(TokenBatch(opened=opened, deltas=[TokenDelta(rid=o.rid, token_ids=hello) for o in opened]))
    for name, inbox in apis.items():
        (batch,) = _drain(inbox)
        assert isinstance(batch, TextBatch) and [(d.rid, d.text) for d in batch.deltas] == [(f"r-{name}", "Hello there")]
    ctx.destroy(0)


def test_detokenizer_leaves_a_failed_request_to_the_schedulers_error(tmp_path) -> None:
    ctx, apis = _apis(tmp_path)
    loop = DetokenizerLoop(StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path / "run")), log)
    loop.load_tokenizer()
    opened = StreamOpen(rid="r-failed", prompt_tokens=1, max_tokens=10, reply_to=apis["api-a"].address)
    loop.handle(TokenBatch(opened=[opened], deltas=[TokenDelta(rid="r-failed", token_ids=loop.tokenizer.encode("Hello"))]))
    assert [d.text for d in _drain(apis["api-a"])[0].deltas] == ["Hello"]
    loop.handle(TokenBatch(deltas=[TokenDelta(rid="r-failed", finish="error")]))  # the api got the reason from the scheduler
    assert list(apis["api-a"].recv(200)) == [] and not loop.detokenization.requests
    ctx.destroy(0)
