"""structlog set-up shared by every process: one line per event, tagged with the process name."""

from __future__ import annotations

import logging
import sys

import structlog


def setup_logging(process: str, level: str = "info", json_lines: bool = False) -> structlog.stdlib.BoundLogger:
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=level.upper())
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
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
    return structlog.get_logger().bind(process=process)
