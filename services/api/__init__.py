"""The api process: the OpenAI- and Anthropic-compatible HTTP surface in front of the engine."""
