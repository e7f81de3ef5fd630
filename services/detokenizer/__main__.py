"""Runs the detokenizer process."""

from services.detokenizer.loop import main

main()
