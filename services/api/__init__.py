"""The api process: the OpenAI-compatible HTTP surface in front of the engine."""
