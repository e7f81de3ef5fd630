"""Detokenization, for whichever process does it (the detokenizer, or the api with ``--detokenize-in api``):
incremental text, stop strings, and the bookkeeping of every open request."""
