"""Tests of the worker's compute core (a package, so the test modules can share ``harness``)."""
