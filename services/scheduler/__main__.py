"""Runs the scheduler process."""

from services.scheduler.loop import main

main()
