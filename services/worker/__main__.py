"""Runs the worker process."""

from services.worker.loop import main

main()
