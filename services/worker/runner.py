"""The worker's compute core: runs one ``StepPlan`` through the model and samples its tokens.

``ModelRunner`` owns the weights, the fixed-size KV cache, the GDN state slots of hybrid models
and each running request's state (block table, last sampled token, sampling params, rng). It makes
no scheduling decision: it executes plans in the order they arrive, a decode slice is fed the token
this runner sampled last for its request, and a hybrid model's slice runs in the state slot it names.

On CUDA, decode-only steps that fit a captured bucket replay a CUDA graph (``cuda_graphs``);
everything else runs eagerly. When the device memory budget sizes the KV cache, one profile step at
the largest step size runs first, through scratch blocks and slots, to measure the activation peak
(``device_memory``).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from services.worker.attention import AttentionMetadata, KVCache
from services.worker.cpu_cache import keep_weights_cached, l3_cache_bytes
from services.worker.cpu_kernels import cpu_kernels
from services.worker.cuda_graphs import Capture, CudaGraphCapture, DecodeGraphs
from services.worker.device import resolve_dtype
from services.worker.device_memory import ActivationProfile, CudaMemoryProbe, MemoryProbe
from services.worker.gdn_state import GDNStateCache, SlotMetadata
from services.worker.kernels.sampling import SamplingTensors, sample_on_device
from services.worker.linear import convert_weights, held_bytes, linears_of, resolve_weight_quant
from services.worker.models import model_family
from services.worker.sampling import LogitBias, TokenHistory, process_logits, sample, token_logprobs
from services.worker.structured import StructuredOutputs, Vocabulary
from services.worker.tensor_parallel import TensorParallelGroup, parallelize, shard_config, shard_weights
from services.worker.weights import load_weights
from shared.choices import DTYPE_NAMES, keyed_by
from shared.frames import Release, Sampled, SamplingParams, Slice, StepPlan, StepResult
from shared.json_grammar import Matcher
from shared.model_info import HYBRID_PREFIX_CACHE_OFF, KV_Q8_BLOCK, resolve_kv_cache_dtype

ALL_PROMPT = 1 << 62  # a prompt_len no prefill reaches: every prefilled token is prompt
POOL_FEW_ROWS = 8  # the takeover pool's limit where only few-row steps run all layers in one call (int4-a8)

DTYPES = keyed_by(DTYPE_NAMES, {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})
KV_DTYPES = {**DTYPES, "int8": torch.int8}  # int8: codes and fp16 scales per head vector (csrc/kv_q8.h)


@dataclass
class _Request:
    params: SamplingParams
    generator: torch.Generator | None
    history: TokenHistory | None = None  # only for requests with penalties
    bias: LogitBias | None = None
    prompt_len: int = 0  # prefill positions before this are prompt, later ones recomputed outputs
    table: list[int] = field(default_factory=list)
    last_token: int | None = None
    end: int = 0  # positions computed so far: where the next slice must start
    slot: int = -1  # GDN state slot (hybrid models)
    noise_seed: int = 0  # the device sampler's noise stream (the params' seed, else random)
    draws: int = 0  # tokens sampled so far
    grammar: Matcher | None = None  # structured outputs: where the output is in its JSON grammar

    def record_prefill(self, start: int, token_ids: list[int], structured: StructuredOutputs | None) -> None:
        """Tells the penalty history and the grammar about a prefill chunk: prompt tokens, then (after a
        preemption) earlier outputs."""
        if self.history is None and self.grammar is None:
            return
        split = max(0, min(len(token_ids), self.prompt_len - start))
        if self.history is not None:
            self.history.add_prompt(token_ids[:split])
            self.history.add_outputs(token_ids[split:])
        if self.grammar is not None and structured is not None:
            for token in token_ids[split:]:
                self.grammar = structured.advance(self.grammar, token)


class ModelRunner:
    """With ``tp`` (a tensor-parallel group), this runner holds one rank's shard; the leader's
    ``execute`` and ``release`` drive the followers, which run ``follow()``."""

    def __init__(
        self,
        model_dir: str,
        num_blocks: int,
        block_size: int,
        dtype: str = "float32",
        max_num_seqs: int = 64,
        weight_quant: str = "none",
        tp: TensorParallelGroup | None = None,
        kv_cache_dtype: str = "model",
        device: str = "cpu",
        cuda_graph_max_batch: int = 0,
        capture: Capture | None = None,
        max_model_len: int = 0,
        size_kv_cache: Callable[[Any, ActivationProfile | None, int], int] | None = None,
        profile_tokens: int = 0,
        memory_probe: MemoryProbe | None = None,
        weight_prefetch: str = "auto",
    ) -> None:
        """``dtype`` "auto" is bfloat16 on CUDA, float32 on the CPU. ``cuda_graph_max_batch`` > 0 captures
        decode graphs up to that batch at ``capture_graphs()`` (with ``capture``: CUDA graphs by default
        on CUDA; tests pass ``eager_capture``).

        The device memory budget: ``size_kv_cache(model, profile, state_slots)``, when given, is asked once
        the weights are loaded how many KV blocks fit (graphs' dummy block included) beside ``state_slots``
        GDN state slots, and overrides ``num_blocks``. With ``profile_tokens`` > 0 (and no tensor
        parallelism) it first gets the ``ActivationProfile`` of one step of that many tokens, measured by
        ``memory_probe`` (the CUDA allocator's by default). ``weight_prefetch`` (auto, keep or stream): whether
        the CPU int4 products' prefetch keeps the weights in the caches (``services/worker/cpu_cache.py``)."""
        self.device = torch.device(device)
        dtype = resolve_dtype(dtype, self.device)
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (supported: auto, {', '.join(DTYPES)})")
        weight_quant = resolve_weight_quant(weight_quant, self.device, DTYPES[dtype])
        kv_dtype = KV_DTYPES[resolve_kv_cache_dtype(kv_cache_dtype, self.device.type, dtype)]
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"the KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        self.family = config.get("model_type", "llama")
        family = model_family(self.family)
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.tp = tp
        graphed = cuda_graph_max_batch > 0
        self._requests: dict[str, _Request] = {}
        self._model_dir = model_dir
        self._structured: StructuredOutputs | None = None  # built at the first request with a json_schema
        self._slot_holders: dict[int, str] = {}  # GDN slot -> the live request computing in it
        # Sampling where the logits are: the torch path with per-request generators on the CPU.
        self.sampler = "torch" if self.device.type == "cpu" else "device"
        self._sample = self._sample_torch if self.sampler == "torch" else self._sample_device
        self.graphs: DecodeGraphs | None = None
        self.last_step_graphed = False
        self.activation_profile: ActivationProfile | None = None
        with torch.inference_mode():
            weights = load_weights(model_dir, DTYPES[dtype], self.device)
            if tp is not None:
                config, weights = shard_config(config, tp.size), shard_weights(weights, tp.rank, tp.size)
            self.model = family(config, weights)
            self.weight_quant, self.quantized_linears = convert_weights(self.model, weight_quant) if weight_quant != "none" else ("none", 0)
            if tp is not None:  # after quantization, which finds the layers' linears unwrapped
                parallelize(self.model, tp)
            if hasattr(self.model, "bind_dense_decoder"):  # weights final: steps may run all layers in one call
                self.model.bind_dense_decoder()
            self._takeover_pool: tuple[bool, int] | None = None  # (on, max rows): set again at each step
            self._weight_prefetch: tuple[bool, str] | None = None  # (keep in the caches, why): set again at each step
            if (kernels := cpu_kernels()[0]) is not None and self.device.type == "cpu":
                # Decode-sized steps on the takeover pool (csrc/takeover_pool.h) where all their parallel kernels run on
                # it: steps up to the pool's limit where every step runs all layers in one call; only few-row steps
                # where the rest take the per-layer path (int4-a8), whose torch glue may wake OpenMP's threads.
                one_call_rows = getattr(self.model, "dense_decoder_max_rows", 0)
                pool_rows = kernels.TAKEOVER_POOL_MAX_ROWS if one_call_rows >= kernels.TAKEOVER_POOL_MAX_ROWS else POOL_FEW_ROWS
                self._takeover_pool = (one_call_rows > 0, pool_rows)
                kernels.set_takeover_pool(*self._takeover_pool)
                panels = sum(held_bytes(linear)["panels"] for linear in linears_of(self.model))
                self._weight_prefetch = keep_weights_cached(weight_prefetch, panels, l3_cache_bytes())
                kernels.set_weight_prefetch_keep(self._weight_prefetch[0])
            self._attention_backend = getattr(self.model, "attention_backend", "torch")
            if kv_dtype == torch.int8 and self._attention_backend != "cpp":
                why = cpu_kernels()[1] or f"the {self._attention_backend} attention backend was chosen"
                raise ValueError(f"kv_cache_dtype 'int8' needs the C++ CPU attention kernel ({why})")
            if kv_dtype == torch.int8 and self.model.head_dim % KV_Q8_BLOCK:
                raise ValueError(f"kv_cache_dtype 'int8' needs a head_dim divisible by {KV_Q8_BLOCK} (this model's: {self.model.head_dim})")
            # One GDN state slot per request the scheduler may run at once; it hands out ids 0..max_num_seqs-1.
            # With graphs, slot max_num_seqs past them is the dummy slot that padding rows run in.
            shape = self.model.gdn_shape
            self._dummy_slot = max_num_seqs if graphed and shape is not None else None
            pool_slots = max_num_seqs + (self._dummy_slot is not None)
            if size_kv_cache is not None:
                if profile_tokens > 0 and tp is None:  # under TP every rank would have to join the profile step
                    probe = memory_probe or CudaMemoryProbe(self.device)
                    self.activation_profile = self._profile_activations(profile_tokens, probe, DTYPES[dtype])
                fit = size_kv_cache(self.model, self.activation_profile, pool_slots if shape is not None else 0)
                num_blocks = fit - 1 if graphed else fit  # the scheduler's share: the dummy block is the worker's
                if num_blocks < 1:
                    raise ValueError(f"the device memory budget leaves room for {fit} KV blocks; raise --gpu-memory-utilization")
            self.num_blocks = num_blocks
            self.states = None if shape is None else GDNStateCache(shape, pool_slots, DTYPES[dtype], self.model.embed.device)
            # With graphs, one block past the scheduler's is the dummy block that padding rows write.
            cache_blocks = num_blocks + 1 if graphed else num_blocks
            self.kv_cache = KVCache(self.model.num_kv_layers, cache_blocks, block_size, self.model.num_kv_heads, self.model.head_dim, kv_dtype, self.device)
        if graphed:
            context = max_model_len or config.get("max_position_embeddings", 2048)
            width = min(-(-context // block_size), num_blocks)
            if capture is None:
                capture = CudaGraphCapture(self.device) if self.device.type == "cuda" else None
            if capture is None:
                raise ValueError("CUDA graphs need a CUDA device (or an injected capture)")
            self.graphs = DecodeGraphs(
                self._decode_step, min(cuda_graph_max_batch, max_num_seqs), width, self.model.vocab_size, num_blocks, self.device, self.model.dtype, capture,
                self._dummy_slot,
            )  # fmt: skip

    def _profile_activations(self, tokens: int, probe: MemoryProbe, dtype: torch.dtype) -> ActivationProfile:
        """The memory of one step at the largest a plan may be: ``tokens`` prompt tokens over as many
        sequences as a step may hold, every one sampled (top-k/top-p, so the sampler's buffers count), run
        through scratch KV blocks and state slots that are freed afterwards (the cache does not exist yet)."""
        seqs = max(1, min(self.max_num_seqs, tokens))
        lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        blocks = [-(-n // self.block_size) for n in lens]
        weights = probe.allocated()
        model, device = self.model, self.device
        self.kv_cache = KVCache(model.num_kv_layers, sum(blocks), self.block_size, model.num_kv_heads, model.head_dim, dtype, device)
        self.states = None if model.gdn_shape is None else GDNStateCache(model.gdn_shape, seqs, dtype, model.embed.device)
        self.num_blocks = sum(blocks)
        scratch = probe.allocated() - weights
        rids, first, slices = [f"__profile{i}__" for i in range(seqs)], 0, []
        for i, (rid, n) in enumerate(zip(rids, lens)):
            params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=i)
            prompt = [(first + j) % model.vocab_size for j in range(n)]
            slices.append(Slice(rid, 0, n, prompt, list(range(first, first + blocks[i])), sampling=params, slot=i))
            first += blocks[i]
        probe.reset_peak()
        try:
            self.execute(StepPlan(-1, slices))
            peak = probe.peak()
        except torch.OutOfMemoryError as exc:
            raise ValueError(
                f"one step of {tokens} tokens over {seqs} sequences does not fit beside the weights; lower --max-num-batched-tokens or --max-num-seqs"
            ) from exc
        finally:
            self.release(rids)
            self.kv_cache = self.states = None
            probe.release()
        return ActivationProfile(tokens, seqs, weights, scratch, peak)

    def _sample_torch(self, logits: torch.Tensor, requests: list[_Request]) -> torch.Tensor:
        return sample(logits, [r.params for r in requests], [r.generator for r in requests])

    def _sample_device(self, logits: torch.Tensor, requests: list[_Request]) -> torch.Tensor:
        if all(r.params.temperature == 0 for r in requests):
            return logits.argmax(dim=-1)
        params = SamplingTensors.build(
            [r.params for r in requests], [r.noise_seed for r in requests], [r.draws for r in requests], logits.shape[-1], logits.device
        )
        return sample_on_device(logits, params)

    @property
    def structured(self) -> StructuredOutputs:
        """The vocabulary as bytes, built once (warm-up does it); a ``ValueError`` when the model has no tokenizer."""
        if self._structured is None:
            from shared.model_info import load_model_info

            eos = load_model_info(self._model_dir).eos_token_ids
            try:
                vocabulary = Vocabulary.of_model(self._model_dir, self.model.vocab_size, eos)
            except (OSError, ValueError, TypeError) as exc:
                raise ValueError(f"structured outputs need the model's tokenizer, which did not load: {exc}") from exc
            self._structured = StructuredOutputs(vocabulary)
        return self._structured

    def _hold_to_grammars(self, logits: torch.Tensor, chosen: torch.Tensor, requests: list[_Request]) -> torch.Tensor:
        """``chosen`` with each constrained row's token one its grammar allows (``StructuredOutputs.enforce``); each
        constrained request's grammar moves past its token."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]

        def resample(row: int, masked: torch.Tensor) -> int:
            return int(sample(masked, [requests[row].params], [requests[row].generator])[0])

        tokens, afters = self.structured.enforce(logits, chosen.tolist(), rows, [requests[i].grammar for i in rows], resample)
        for i, after in zip(rows, afters):
            requests[i].grammar = after
        return torch.tensor(tokens, dtype=chosen.dtype, device=chosen.device)

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, gdn_slots: torch.Tensor) -> torch.Tensor:
        """A decode-only step from device tensors alone: what a graph records (metadata built inside)."""
        meta = AttentionMetadata.for_decode(positions, block_tables, self.block_size, self.model.dtype, self._attention_backend)
        slots = None
        if self.states is not None:
            # Padding rows read the dummy slot's state before they write it: reinitialised on every replay.
            self.states.zero_slot_(self._dummy_slot)
            slots = SlotMetadata.for_decode(self.states, gdn_slots)
        return self.model.compute_logits(self.model.forward(input_ids, positions, meta, self.kv_cache, slots))

    def capture_graphs(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Capture the decode graphs (part of warm-up, before the worker reports ready)."""
        if self.graphs is not None:
            with torch.inference_mode():
                self.graphs.capture_all(stop)

    @property
    def num_slots(self) -> int:
        """GDN state slots the scheduler may hand out (0 for models without GDN layers, which ignore
        ``Slice.slot``); the graphs' dummy slot, when there is one, is past them."""
        return 0 if self.states is None else self.max_num_seqs

    def execute(self, plan: StepPlan) -> StepResult:
        """Run every slice of ``plan`` as one flat batch; a ``ValueError`` leaves all state untouched."""
        if self.tp is not None and self.tp.leader:
            self.tp.send_frame(plan)
        began = time.perf_counter()
        sampled = []
        if self._takeover_pool is not None:  # these settings are per process: a process may hold runners of several formats
            cpu_kernels()[0].set_takeover_pool(*self._takeover_pool)
            cpu_kernels()[0].set_weight_prefetch_keep(self._weight_prefetch[0])
        with torch.inference_mode():
            rids, requests, logits = self._forward(plan.slices)
            if rids:
                params = [r.params for r in requests]
                if self.tp is None or self.tp.leader:
                    processed = process_logits(logits, params, [r.history for r in requests], [r.bias for r in requests])
                    chosen = self._sample(processed, requests)
                    if any(r.grammar is not None for r in requests):
                        chosen = self._hold_to_grammars(processed, chosen, requests)
                    logprobs = token_logprobs(processed, chosen, params)
                else:
                    chosen, logprobs = None, [None] * len(rids)
                if self.tp is not None:  # every rank feeds the leader's tokens to the next decode
                    chosen = self.tp.share_tokens(chosen, len(rids))
                tokens = chosen.tolist()
                for request, token in zip(requests, tokens):
                    request.last_token = token
                    request.draws += 1
                    if request.history is not None:
                        request.history.add_outputs([token])
                by_rid = {rid: (token, lp) for rid, token, lp in zip(rids, tokens, logprobs)}
                sampled = [Sampled(s.rid, *by_rid[s.rid]) for s in plan.slices if s.sample]
        return StepResult(step=plan.step, sampled=sampled, forward_s=time.perf_counter() - began)

    def logits(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """Run ``plan`` like ``execute``, KV writes included, but return its sampling slices' logits, unsampled."""
        if self.tp is not None:
            raise RuntimeError("logits() runs on one rank alone; with tensor parallelism use execute()")
        with torch.inference_mode():
            rids, _, logits = self._forward(plan.slices)
        return dict(zip(rids, logits)) if rids else {}

    def release(self, rids: list[str]) -> None:
        """Forget these requests (unknown ones are ignored: a release may follow a failed step)."""
        if self.tp is not None and self.tp.leader:
            self.tp.send_frame(Release(rids=rids))
        for rid in rids:
            request = self._requests.pop(rid, None)
            if request is not None and self._slot_holders.get(request.slot) == rid:
                del self._slot_holders[request.slot]

    def follow(self) -> None:
        """A follower rank: runs the frames the leader broadcasts until it sends stop."""
        while (frame := self.tp.receive_frame()) is not None:
            if isinstance(frame, Release):
                self.release(frame.rids)
                continue
            try:
                self.execute(frame)
            except ValueError:  # a bad plan: the leader refused it at the same check, before any collective
                pass

    def close(self) -> None:
        """The leader releases its followers (they return from ``follow``)."""
        if self.tp is not None and self.tp.leader:
            self.tp.send_frame(None)

    def _forward(self, slices: list[Slice]) -> tuple[list[str], list[_Request], torch.Tensor | None]:
        """The rids and states of the slices that sample, and their logits [N, vocab]."""
        if not slices:
            return [], [], None
        self._validate(slices)
        for s in slices:
            request = self._requests.get(s.rid)
            if request is None:
                params = s.sampling or SamplingParams()
                generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
                history = TokenHistory(params) if params.penalised else None
                request = self._requests[s.rid] = _Request(params, generator, history, LogitBias.of(params.logit_bias), s.prompt_len or ALL_PROMPT)
                request.noise_seed = random.getrandbits(62) if params.seed is None else params.seed
                if params.json_schema is not None and (self.tp is None or self.tp.leader):  # only the leader samples
                    request.grammar = self.structured.grammar(params.json_schema, params.json_prefix, params.json_suffix).start()
                request.record_prefill(0, s.prefix_ids, self._structured)
            request.table.extend(s.new_blocks)
            request.record_prefill(s.start, s.token_ids, self._structured)
            request.end = s.start + s.num_tokens
            if self.states is not None:
                request.slot = s.slot
                self._slot_holders[s.slot] = s.rid

        # Decode slices first: attention batches them in one call and prefill chunks follow.
        ordered = [s for s in slices if not s.token_ids] + [s for s in slices if s.token_ids]
        num_decodes = len(slices) - sum(1 for s in slices if s.token_ids)
        requests = [self._requests[s.rid] for s in ordered]
        input_ids = [r.last_token for r in requests[:num_decodes]]
        self.last_step_graphed = False
        if self.graphs is not None and num_decodes == len(slices) and all(s.sample for s in slices):
            tables = [r.table for r in requests]
            bucket = self.graphs.fits(num_decodes, tables)
            if bucket is not None:
                self.last_step_graphed = True
                slots = [s.slot for s in ordered] if self.states is not None else ()
                logits = self.graphs.run(bucket, input_ids, [s.start for s in ordered], tables, slots)
                return [s.rid for s in ordered], requests, logits  # a decode slice always samples
            self.graphs.eager += 1
        for s in ordered[num_decodes:]:
            input_ids += s.token_ids
        lens = [s.num_tokens for s in ordered]
        starts = [s.start for s in ordered]
        meta = AttentionMetadata.build(
            starts, lens, [r.table for r in requests], num_decodes, self.block_size, self.model.dtype, self.device, self._attention_backend
        )
        slots = None if self.states is None else SlotMetadata.build(self.states, [s.slot for s in ordered], starts, lens, num_decodes)
        hidden = self.model.forward(torch.tensor(input_ids, device=self.device), meta.positions, meta, self.kv_cache, slots)

        to_sample = [j for j, s in enumerate(ordered) if s.sample]
        if not to_sample:
            return [], [], None
        if len(to_sample) == hidden.shape[0]:  # a decode step: every row is a request's last
            logits = self.model.compute_logits(hidden)
        else:
            # index_select, not hidden[rows]: torch's advanced indexing wakes OpenMP's threads even for a few rows
            ends = list(itertools.accumulate(lens))
            last_rows = torch.tensor([ends[j] - 1 for j in to_sample], device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, last_rows))
        return [ordered[j].rid for j in to_sample], [requests[j] for j in to_sample], logits

    def _validate(self, slices: list[Slice]) -> None:
        if len(slices) > self.max_num_seqs:
            raise ValueError(f"a step of {len(slices)} slices exceeds max_num_seqs={self.max_num_seqs}")
        if len({s.rid for s in slices}) != len(slices):
            raise ValueError("a step holds more than one slice of the same request")
        if self.states is not None and len({s.slot for s in slices}) != len(slices):
            raise ValueError("a step holds two slices in the same GDN state slot")
        for s in slices:
            request = self._requests.get(s.rid)
            if not s.token_ids:
                if request is None:
                    raise ValueError(f"decode slice for unknown request {s.rid!r}: it was never prefilled here or was released")
                if request.last_token is None:
                    raise ValueError(f"decode slice for request {s.rid!r}, which has not sampled a token yet")
                if s.num_tokens != 1:
                    raise ValueError(f"decode slice for {s.rid!r} has num_tokens={s.num_tokens}, expected 1")
            elif len(s.token_ids) != s.num_tokens:
                raise ValueError(f"slice for {s.rid!r} carries {len(s.token_ids)} token ids but num_tokens={s.num_tokens}")
            elif min(s.token_ids) < 0 or max(s.token_ids) >= self.model.vocab_size:
                raise ValueError(f"slice for {s.rid!r} carries token ids outside the vocabulary of {self.model.vocab_size}")
            if s.start < 0 or s.num_tokens < 1:
                raise ValueError(f"slice for {s.rid!r} has start={s.start}, num_tokens={s.num_tokens}")
            if request is not None and s.start != request.end:
                raise ValueError(f"slice for {s.rid!r} starts at {s.start} but the request has computed {request.end} positions")
            if s.sampling is not None and any(not 0 <= t < self.model.vocab_size for t in [*s.sampling.logit_bias, *s.prefix_ids]):
                raise ValueError(f"slice for {s.rid!r} names token ids (logit_bias or prefix_ids) outside the vocabulary of {self.model.vocab_size}")
            if self.states is not None:
                self._validate_slot(s, request)
            if s.sampling is not None and s.sampling.json_schema is not None and (self.tp is None or self.tp.leader):
                self.structured.grammar(s.sampling.json_schema, s.sampling.json_prefix, s.sampling.json_suffix)  # a schema it cannot take: a bad plan
            if any(not 0 <= b < self.num_blocks for b in s.new_blocks):
                raise ValueError(f"slice for {s.rid!r} names blocks outside 0..{self.num_blocks - 1}: {s.new_blocks}")
            capacity = (len(request.table) if request else 0) + len(s.new_blocks)
            if s.start + s.num_tokens > capacity * self.block_size:
                raise ValueError(
                    f"slice for {s.rid!r} reaches position {s.start + s.num_tokens - 1} but its "
                    f"{capacity} blocks of {self.block_size} hold {capacity * self.block_size} tokens"
                )

    def _validate_slot(self, s: Slice, request: _Request | None) -> None:
        if not 0 <= s.slot < self.num_slots:
            raise ValueError(f"slice for {s.rid!r} names GDN state slot {s.slot}, outside 0..{self.num_slots - 1}")
        if request is None and s.start > 0:
            raise ValueError(f"slice for {s.rid!r} starts at {s.start} but the worker holds no GDN state of it (a new request starts at 0)")
        if request is not None and request.slot != s.slot:
            raise ValueError(f"slice for {s.rid!r} names GDN state slot {s.slot} but the request holds slot {request.slot}")
        holder = self._slot_holders.get(s.slot, s.rid)
        if holder != s.rid:
            raise ValueError(f"slice for {s.rid!r} names GDN state slot {s.slot}, which request {holder!r} holds")

    def warmup(self) -> None:
        """One short prefill and one decode through blocks 0.., then release: allocator and kernels warm."""
        tokens = min(2 * self.block_size, self.num_blocks * self.block_size - 1, 16)
        blocks = list(range(-(-(tokens + 1) // self.block_size)))
        rid, params = "__warmup__", SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=0)
        try:
            prompt = [i % self.model.vocab_size for i in range(tokens)]
            self.execute(StepPlan(-1, [Slice(rid, 0, tokens, prompt, blocks, sampling=params, slot=0)]))
            self.execute(StepPlan(-1, [Slice(rid, tokens, 1, slot=0)]))
        finally:
            self.release([rid])

    def describe(self) -> dict[str, Any]:
        """Read-only facts for the instrumentation endpoint, read off the live objects."""
        tensors = self.model.tensors()
        held = [held_bytes(linear) for linear in linears_of(self.model)]
        return {
            "family": self.family,
            "device": str(self.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "attention_backend": getattr(self.model, "attention_backend", "torch"),
            **({"cpu_kernels": cpu_kernels()[1] or "built"} if self.device.type == "cpu" else {}),
            # takeover_pool: few-row calls' pool (csrc/takeover_pool.h), items taken over from a helper that was not running;
            # block_quant_isa: the integer block products' instructions (csrc/block_quant_gemm.cpp), avx512-vnni, avx2 or portable;
            # weight_prefetch: whether their prefetch keeps the weights in the caches, and why (cpu_cache.py)
            **(
                {
                    "takeover_pool": kernels.takeover_pool_stats(),
                    "block_quant_isa": kernels.block_quant_gemm_isa(),
                    "weight_prefetch": self._weight_prefetch[1] if self._weight_prefetch else None,
                }
                if self.device.type == "cpu" and (kernels := cpu_kernels()[0]) is not None
                else {}
            ),
            "fusion_kernels": getattr(getattr(self.model, "fusions", None), "names", None),
            "sampler": self.sampler,
            "structured_outputs": self._structured.describe() if self._structured is not None else None,
            "cuda_graphs": None if self.graphs is None else self.graphs.describe(),
            "num_layers": self.model.num_layers,
            "num_kv_heads": self.model.num_kv_heads,
            "head_dim": self.model.head_dim,
            "vocab_size": self.model.vocab_size,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "kv_cache_bytes": self.kv_cache.nbytes,
            "kv_cache_dtype": str(self.kv_cache.tensor.dtype).removeprefix("torch."),
            "kv_bytes_per_token": self.kv_cache.nbytes // (self.kv_cache.num_blocks * self.block_size),
            "param_count": sum(t.numel() for t in tensors),
            # a converted linear's weight is a storage-less placeholder: its pack and blocks are counted apart
            "param_bytes": sum(t.numel() * t.element_size() for t in tensors if not t.is_meta) + sum(h["packed"] for h in held),
            "threads": torch.get_num_threads(),
            "max_num_seqs": self.max_num_seqs,
            "weight_quant": self.weight_quant,
            "quantized_linears": self.quantized_linears,
            "block_quant_bytes": sum(h["panels"] for h in held),  # int4's panels beside any fp16 packs
            "requests": len(self._requests),
            **self.model.describe(),
            **self._describe_slots(),
        }

    def _describe_slots(self) -> dict[str, Any]:
        if self.states is None:
            return {}
        return {
            "gdn_state": {
                "slots_total": self.num_slots,
                "slots_used": len(self._slot_holders),
                "dummy_slot": self._dummy_slot,  # graph padding's, past the scheduler's slots
                "bytes": self.states.nbytes,
                "bytes_per_slot": self.states.nbytes // self.states.num_slots,
            },
            "prefix_cache": {"enabled": False, "reason": HYBRID_PREFIX_CACHE_OFF},
        }
