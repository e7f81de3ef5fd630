"""Speculative decoding in the worker: proposers guess a request's next tokens (``ngram``, ``draft``, ``mtp``), and
the verifier keeps the longest run of them the target model accepts (``verifier``); ``speculator`` ties them to the runner."""
