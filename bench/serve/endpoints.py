"""The endpoints a run drives: a URL someone else serves, tokenyard's stack started for the run, or llama-server
started per level with as many slots as the level's concurrency (how the peer is meant to be configured)."""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from bench.serve.load import Level


@dataclass
class UrlEndpoint:
    name: str
    url: str
    model_path: str | None = None  # the model files behind it, for provenance

    def serving(self, level: Level) -> AbstractContextManager[str]:
        return contextlib.nullcontext(self.url)

    def close(self) -> None:
        pass


@dataclass
class StackEndpoint:
    """tokenyard's launcher on free ports, started on the first level and kept for the whole run."""

    model_path: str
    flags: str = ""
    log_path: str | None = None  # the launcher's output; dropped when None
    start_timeout_s: float = 1800  # the worker's warm-up ladder is slow on a busy 2-core machine
    name: str = "tokenyard"
    _exit: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _url: str | None = None
    _failure: RuntimeError | None = None  # a stack that failed to start is not retried at every level

    @contextlib.contextmanager
    def serving(self, level: Level) -> Iterator[str]:
        if self._failure is not None:
            raise self._failure
        if self._url is None:
            from shared.devtools.stack import running_stack

            try:
                self._url = self._exit.enter_context(
                    running_stack(self.model_path, *shlex.split(self.flags), timeout_s=self.start_timeout_s, log_path=self.log_path)
                )
            except RuntimeError as exc:
                self._failure = exc
                raise
        yield self._url

    def worker_metrics_urls(self) -> list[str]:
        """Each engine's worker /metrics once the stack runs: the launcher's ports (engine i's worker at the api's
        port + 2 + 3i)."""
        if self._url is None:
            return []
        port = int(self._url.rsplit(":", 1)[1])
        return [f"http://127.0.0.1:{port + 2 + 3 * engine}/metrics" for engine in range(_replicas(self.flags))]

    def close(self) -> None:
        self._exit.close()


def _replicas(flags: str) -> int:
    """The engine replicas launcher ``flags`` ask for (``--replicas N``; 1 by default)."""
    words = shlex.split(flags)
    for i, word in enumerate(words):
        if word == "--replicas" and i + 1 < len(words):
            return int(words[i + 1])
        if word.startswith("--replicas="):
            return int(word.split("=", 1)[1])
    return 1


@dataclass
class PeerEndpoint:
    """llama-server restarted for each level with --parallel equal to the level's concurrency."""

    model_path: str
    threads: int = 2
    log_path: str | None = None
    flags: str = ""  # extra llama-server flags, one shell-quoted string
    name: str = "llama.cpp"

    def serving(self, level: Level) -> AbstractContextManager[str]:
        from bench.serve.peer import running_llama_server

        return running_llama_server(level.parallel_slots, self.model_path, self.threads, self.log_path, extra=shlex.split(self.flags))

    def close(self) -> None:
        pass


Endpoint = UrlEndpoint | StackEndpoint | PeerEndpoint
