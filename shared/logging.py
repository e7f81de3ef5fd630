"""structlog set-up shared by every process: one line per event, tagged with the process name.

JSON lines by default (console text on a terminal). Events about a request carry its ``rid``,
so one request can be followed through the logs of every process.
"""

from __future__ import annotations

import logging
import sys

import structlog

from shared.choices import LOG_FORMATS


def setup_logging(process: str, level: str = "info", fmt: str = "auto") -> structlog.stdlib.BoundLogger:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=level.upper())
    json_lines = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)

    def add_process(logger: object, method: str, event: dict) -> dict:
        event.setdefault("process", process)  # on every line, from any module-level logger too
        return event

    structlog.configure(
        processors=[
            add_process,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger()
