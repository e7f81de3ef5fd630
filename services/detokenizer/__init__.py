"""The detokenizer process (with ``--detokenize-in detokenizer``; by default the api makes the text): turns each
request's output token ids into text deltas and finishes a request when one of its stop strings appears."""
