"""Stop strings: find them in a stream of text deltas, across delta boundaries."""

from __future__ import annotations


class StopStringMatcher:
    """Passes a request's text through until one of its stop strings appears.

    The first stop string to be completed in the stream wins (if several end at the same
    character, the longest), so the result never depends on how the text was split into
    deltas. The matched stop string and everything after it are never emitted. A tail
    that could still grow into a stop string (at most ``max(len(stop)) - 1`` characters)
    is held back until it can no longer match or ``flush()`` is called.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._max_hold = max(map(len, self._stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit now, the stop string this text completed or None).

        After a match every later feed returns ``("", None)``.
        """
        if self.matched is not None:
            return "", None
        if not self._stops:
            return text, None
        buf = self._held + text
        found = [(i + len(s), i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if found:
            _, start, self.matched = min(found)
            self._held = ""
            return buf[:start], self.matched
        hold = self._partial_len(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """The held-back tail, once the request ended without completing a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_len(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that begins some stop string."""
        for n in range(min(len(buf), self._max_hold), 0, -1):
            if any(s.startswith(buf[-n:]) for s in self._stops):
                return n
        return 0
