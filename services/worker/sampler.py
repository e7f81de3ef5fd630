"""A step's logits → its tokens: penalties and logit bias, sampling where the logits are, structured
outputs' grammars, and logprobs."""

from __future__ import annotations

from typing import Any

import torch

from services.worker.kernels.sampling import SamplingTensors, sample_on_device
from services.worker.request_table import RequestState
from services.worker.sampling import process_logits, sample, token_logprobs
from services.worker.structured import GrammarState, StructuredOutputs
from shared.frames import SamplingParams, TokenLogprobs


class Sampler:
    """On the CPU the torch path, with each request's own generator; elsewhere the device sampler, whose
    noise stream is each request's (seed, draw)."""

    def __init__(self, device: torch.device, model_dir: str, vocab_size: int) -> None:
        self.name = "torch" if device.type == "cpu" else "device"
        self._sample = self._sample_torch if self.name == "torch" else self._sample_device
        self._model_dir, self._vocab_size = model_dir, vocab_size
        self._structured: StructuredOutputs | None = None  # built in warm-up (else at the first request with a grammar)

    def __call__(self, logits: torch.Tensor, requests: list[RequestState]) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """Each request's token and (where it asked) logprobs; a constrained request's grammar moves past its token."""
        params = [r.params for r in requests]
        processed = process_logits(logits, params, [r.history for r in requests], [r.bias for r in requests])
        grammars = [r.grammar for r in requests]
        constrained = any(g is not None for g in grammars)
        if constrained:
            self.structured.apply(processed, grammars)  # the tokens each grammar refuses are masked out, in one call
        chosen = self._sample(processed, requests)
        if constrained:
            for grammar, token in zip(grammars, chosen.tolist()):
                if grammar is not None:
                    grammar.accept(token)
        return chosen, token_logprobs(processed, chosen, params)

    def _sample_torch(self, logits: torch.Tensor, requests: list[RequestState]) -> torch.Tensor:
        return sample(logits, [r.params for r in requests], [r.generator for r in requests])

    def _sample_device(self, logits: torch.Tensor, requests: list[RequestState]) -> torch.Tensor:
        if all(r.params.temperature == 0 for r in requests):
            return logits.argmax(dim=-1)
        params = SamplingTensors.build(
            [r.params for r in requests], [r.noise_seed for r in requests], [r.draws for r in requests], logits.shape[-1], logits.device
        )
        return sample_on_device(logits, params)

    @property
    def structured(self) -> StructuredOutputs:
        """xgrammar's tokenizer info and compiler, built once (warm-up does it); a ``ValueError`` when the model has no tokenizer."""
        if self._structured is None:
            from shared.model_info import load_model_info

            eos = load_model_info(self._model_dir).eos_token_ids
            try:
                self._structured = StructuredOutputs.of_model(self._model_dir, self._vocab_size, eos)
            except (OSError, ValueError, TypeError) as exc:
                raise ValueError(f"structured outputs need the model's tokenizer, which did not load: {exc}") from exc
        return self._structured

    @property
    def compiling(self) -> bool:
        """Whether grammars compiled ahead (``StructuredOutputs.compile_ahead``) are still in flight."""
        return self._structured is not None and self._structured.compiling

    def check(self, params: SamplingParams) -> None:
        self.structured.check(params)

    def start(self, params: SamplingParams) -> GrammarState:
        return self.structured.start(params)

    def advance(self, state: GrammarState, token: int) -> GrammarState:
        return self.structured.advance(state, token)

    def describe_structured(self) -> dict[str, Any] | None:
        return self._structured.describe() if self._structured is not None else None
