"""The detokenizer process: turns each request's output token ids into text deltas and
finishes a request when one of its stop strings appears (incremental decode, stop strings)."""
