"""Runs the api process."""

from services.api.app import main

main()
