"""The worker's compute core: runs one ``StepPlan`` through the model and samples its tokens.

``ModelRunner`` owns the weights (``weights_loading``), the fixed-size KV cache, the GDN state slots of
hybrid models (and their prefix cache's checkpoints), each running request's state (``request_table``) and the sampler (``sampler``). It makes
no scheduling decision: it executes plans in the order they arrive, a decode slice is fed the token
this runner sampled last for its request, and a hybrid model's slice runs in the state slot it names.

Its life: load the weights → plan memory (when a device budget sizes the KV cache, one profile step at
the largest step size runs first, through scratch blocks and slots, to measure the activation peak:
``device_memory``) → warm up (and, on CUDA, capture decode graphs: ``cuda_graphs``) → execute plans.
Decode-only steps that fit a captured bucket replay a graph; everything else runs eagerly.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from services.worker.attention import AttentionMetadata, KVCache
from services.worker.cpu_kernels import cpu_kernels
from services.worker.cuda_graphs import Capture, CudaGraphCapture, DecodeGraphs
from services.worker.decoder_backends import select_decoder_backend
from services.worker.device import resolve_dtype
from services.worker.device_expert_cache import DeviceExpertCache, DeviceExpertSpill
from services.worker.device_memory import ActivationProfile, CudaMemoryProbe, KVBudget, MemoryProbe, profile_step
from services.worker.expert_cache import ExpertSpill, default_store_dir
from services.worker.gdn_state import GDNStateCache, SlotMetadata
from services.worker.kernel_settings import CpuKernelSettings
from services.worker.linear import held_bytes, linears_of, resolve_weight_quant
from services.worker.request_table import PlanLimits, RequestState, RequestTable
from services.worker.sampler import Sampler
from services.worker.speculative.draft import DraftProposer
from services.worker.speculative.mtp import MTPProposer
from services.worker.speculative.speculator import Speculator, Verify
from services.worker.structured import StructuredOutputs
from services.worker.tensor_parallel import TensorParallelGroup
from services.worker.weights_loading import load_model
from shared.choices import DTYPE_NAMES, keyed_by
from shared.config import StackConfig
from shared.frames import MemorySplit, Release, Sampled, SamplingParams, Slice, StepPlan, StepResult
from shared.model_info import HYBRID_PREFIX_CACHE_OFF, KV_Q8_BLOCK, gdn_checkpoints, load_model_info, resolve_kv_cache_dtype

DTYPES = keyed_by(DTYPE_NAMES, {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16})
KV_DTYPES = {**DTYPES, "int8": torch.int8}  # int8: codes and fp16 scales per head vector (csrc/kv_q8.h)


@dataclass(frozen=True)
class RunnerConfig:
    """What a runner serves and how. ``dtype`` "auto" is bfloat16 on CUDA, float32 on the CPU;
    ``cuda_graph_max_batch`` > 0 captures decode graphs up to that batch at ``capture_graphs()``, over
    contexts up to ``max_model_len`` (0: the model's); ``weight_prefetch`` (auto, keep or stream): whether the
    CPU int4 products' prefetch keeps the weights in the caches (``cpu_cache.py``)."""

    model: str
    num_blocks: int  # the KV cache's, unless a ``KVBudget`` sizes it
    block_size: int
    dtype: str = "float32"
    max_num_seqs: int = 64
    weight_quant: str = "none"
    kv_cache_dtype: str = "model"
    device: str = "cpu"
    cuda_graph_max_batch: int = 0
    max_model_len: int = 0
    weight_prefetch: str = "auto"
    gdn_checkpoint_slots: int = 0  # a hybrid model's prefix cache: GDN state checkpoints past the running slots
    speculative_method: str = ""  # "": decode slices verify nothing (services/worker/speculative/)
    verify_states: int = 0  # a hybrid model's GDN states a step's verifies roll back to: speculative_max_batch × k (gdn_state.py)
    ngram: tuple[int, int] = (2, 4)  # the n-gram lengths prompt lookup matches
    draft_model: str = ""  # speculative_method "draft": the draft model's directory (speculative/draft.py)
    draft_kv_blocks: int = 0  # its KV cache's blocks (0: num_blocks, the KV cache's as configured), which the scheduler's draft pool adopts
    expert_cache_bytes: str = "0"  # a MoE model's experts in a bank of slots over a spill file (expert_cache.py); "0": all resident
    expert_cache_dir: str = ""  # where the spill file goes ("": expert_cache.default_store_dir())
    expert_cache_policy: str = "lfu"  # which expert the bank evicts (expert_cache.POLICIES)
    expert_cache_fill: str = "auto"  # how a step reads the experts it misses (expert_cache.ExpertCache.fill_mode)
    expert_cache_prefetch: str = "on"  # whether the cache reads a layer's predicted experts ahead (expert_cache.ExpertCache.prefetch)
    expert_cache_cpu_experts: str = "auto"  # a GPU worker's: whether missed experts may run on the CPU (device_expert_cache.CoExecution)

    @classmethod
    def of(cls, config: StackConfig, num_blocks: int, device: str = "cpu") -> RunnerConfig:
        """A worker's runner on ``device``, with a KV cache of ``num_blocks`` (CUDA graphs only on CUDA)."""
        return cls(
            config.model, num_blocks, config.block_size, config.dtype, config.max_num_seqs, config.weight_quant, config.kv_cache_dtype, device,
            config.cuda_graph_max_batch if torch.device(device).type == "cuda" and config.speculative_method != "mtp" else 0, config.max_model_len, config.weight_prefetch,
            gdn_checkpoint_slots=gdn_checkpoints(load_model_info(config.model), config), speculative_method=config.speculative_method, ngram=(config.ngram_min, config.ngram_max),
            verify_states=min(config.speculative_max_batch, config.max_num_seqs) * config.num_speculative_tokens if config.speculative_method else 0,
            expert_cache_bytes=config.expert_cache_bytes, expert_cache_dir=config.expert_cache_dir, expert_cache_policy=config.expert_cache_policy,
            expert_cache_fill=config.expert_cache_fill, expert_cache_prefetch=config.expert_cache_prefetch, expert_cache_cpu_experts=config.expert_cache_cpu_experts, draft_model=config.draft_model,
        )  # fmt: skip


class ModelRunner:
    """With ``tp`` (a tensor-parallel group), this runner holds one rank's shard; the leader's
    ``execute`` and ``release`` drive the followers, which run ``follow()``."""

    def __init__(self, config: RunnerConfig, tp: TensorParallelGroup | None = None, budget: KVBudget | None = None, capture: Capture | None = None) -> None:
        """``budget``, when given, sizes the KV cache from device memory once the weights are loaded (it overrides
        ``config.num_blocks``); ``capture`` records the decode graphs (CUDA graphs by default on CUDA; tests pass
        ``eager_capture``)."""
        self.config = config
        self.device = torch.device(config.device)
        dtype = resolve_dtype(config.dtype, self.device)
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (supported: auto, {', '.join(DTYPES)})")
        weight_quant = resolve_weight_quant(config.weight_quant, self.device, DTYPES[dtype])
        kv_dtype = KV_DTYPES[resolve_kv_cache_dtype(config.kv_cache_dtype, self.device.type, dtype)]
        num_blocks, block_size, max_num_seqs = config.num_blocks, config.block_size, config.max_num_seqs
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"the KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.tp = tp
        self.graphs: DecodeGraphs | None = None
        self.last_step_graphed = False
        self.activation_profile: ActivationProfile | None = None
        self.requests = RequestTable()
        if config.speculative_method and tp is not None:
            raise ValueError("speculative decoding does not run with tensor parallelism")

        store_dir = config.expert_cache_dir or default_store_dir()
        if self.device.type == "cpu":
            spill = ExpertSpill.plan(
                config.expert_cache_bytes,
                store_dir,
                config.expert_cache_policy,
                self.device,
                tp is not None,
                config.expert_cache_fill,
                config.expert_cache_prefetch,
            )
        else:
            spill = DeviceExpertSpill.plan(config.expert_cache_bytes, config.expert_cache_policy, config.expert_cache_cpu_experts, self.device, tp is not None)
        model_config, self.model, self.weight_quant, self.quantized_linears = load_model(config.model, DTYPES[dtype], self.device, weight_quant, tp, spill)
        self.family = model_config.get("model_type", "llama")
        self.expert_cache = None if spill is None else spill.attach(self.model)
        draft = None
        if config.speculative_method == "draft":  # before a device budget sizes the KV cache: the draft's weights and KV come off it
            draft_blocks = config.draft_kv_blocks or num_blocks
            draft = DraftProposer.load(
                config.draft_model, config.model, self.model, self.requests, DTYPES[dtype], weight_quant, kv_dtype, draft_blocks, block_size
            )
        self._mtp = None  # the MTP layer hears every step's hidden states (speculative/mtp.py)
        if config.speculative_method == "mtp":
            if config.cuda_graph_max_batch > 0:
                raise ValueError("speculative method 'mtp' reads every step's hidden states, which a decode graph does not give: leave CUDA graphs off")
            self._mtp = MTPProposer.load(config.model, self.family, self.model, self.requests, block_size)
        self.speculator = Speculator(config.speculative_method, *config.ngram, block_size, draft, self._mtp) if config.speculative_method else None
        self.draft_kv_blocks = 0 if draft is None else draft.num_blocks
        self.sampler = Sampler(self.device, config.model, self.model.vocab_size)
        self._grammars = self.sampler if tp is None or tp.leader else None  # only the leader samples
        self.decoder = select_decoder_backend(self.model, sharded=tp is not None)  # the weights are in their final form
        self.kernel_settings = None
        if self.device.type == "cpu":
            self.kernel_settings = CpuKernelSettings.for_model(self.model, self.decoder.one_call, config.weight_prefetch)
        self.apply_kernel_settings()
        self._attention_backend = self.model.attention_backend
        if kv_dtype == torch.int8 and self._attention_backend != "cpp":
            why = cpu_kernels()[1] or f"the {self._attention_backend} attention backend was chosen"
            raise ValueError(f"kv_cache_dtype 'int8' needs the C++ CPU attention kernel ({why})")
        if kv_dtype == torch.int8 and self.model.head_dim % KV_Q8_BLOCK:
            raise ValueError(f"kv_cache_dtype 'int8' needs a head_dim divisible by {KV_Q8_BLOCK} (this model's: {self.model.head_dim})")

        # One GDN state slot per request the scheduler may run at once; it hands out ids 0..max_num_seqs-1.
        # With graphs, slot max_num_seqs past them is the dummy slot that padding rows run in.
        # An expert cache in device memory reads each layer's routing on the host: decode steps run eagerly.
        graphed = config.cuda_graph_max_batch > 0 and not isinstance(self.expert_cache, DeviceExpertCache)
        shape = self.model.gdn_shape
        self._dummy_slot = max_num_seqs if graphed and shape is not None else None
        pool_slots = max_num_seqs + (self._dummy_slot is not None)
        if budget is not None:
            fit = self._plan_memory(budget, pool_slots + config.gdn_checkpoint_slots + config.verify_states if shape is not None else 0, DTYPES[dtype])
            if self._mtp is not None:  # the MTP layer's KV is one more layer per block
                fit = fit * self.model.num_kv_layers // (self.model.num_kv_layers + 1)
            num_blocks = fit - 1 if graphed else fit  # the scheduler's share: the dummy block is the worker's
            if num_blocks < 1:
                raise ValueError(f"the device memory budget leaves room for {fit} KV blocks; raise --gpu-memory-utilization")
        self.num_blocks = num_blocks
        with torch.inference_mode():
            self.states = None
            if shape is not None:
                self.states = GDNStateCache(shape, pool_slots, DTYPES[dtype], self.model.embed.device, config.gdn_checkpoint_slots, config.verify_states)
            self._limits = self._plan_limits()
            # With graphs, one block past the scheduler's is the dummy block that padding rows write.
            cache_blocks = num_blocks + 1 if graphed else num_blocks
            self.kv_cache = KVCache(self.model.num_kv_layers, cache_blocks, block_size, self.model.num_kv_heads, self.model.head_dim, kv_dtype, self.device)
            self.kv_block_bytes = self.kv_cache.nbytes // cache_blocks
            if self._mtp is not None:
                self._mtp.allocate(cache_blocks, kv_dtype)
        if graphed:
            context = config.max_model_len or model_config.get("max_position_embeddings", 2048)
            width = min(-(-context // block_size), num_blocks)
            if capture is None:
                capture = CudaGraphCapture(self.device) if self.device.type == "cuda" else None
            if capture is None:
                raise ValueError("CUDA graphs need a CUDA device (or an injected capture)")
            self.graphs = DecodeGraphs(
                self._decode_step, min(config.cuda_graph_max_batch, max_num_seqs), width, self.model.vocab_size, num_blocks, self.device, self.model.dtype, capture,
                self._dummy_slot,
            )  # fmt: skip

    def apply_kernel_settings(self) -> None:
        """Make the C++ kernels' process-wide settings this runner's (``kernel_settings.py``): done at load;
        again only where a process holds runners of several formats."""
        if self.kernel_settings is not None:
            self.kernel_settings.apply()

    def _plan_memory(self, budget: KVBudget, state_slots: int, dtype: torch.dtype) -> int:
        """The KV blocks the device memory budget leaves, after a profile step where one is asked for."""
        if budget.profile_tokens > 0 and self.tp is None:  # under TP every rank would have to join the profile step
            self.activation_profile = self._profile_activations(budget.profile_tokens, budget.probe or CudaMemoryProbe(self.device), dtype)
        return budget.size(self.model, self.activation_profile, state_slots)

    def _profile_activations(self, tokens: int, probe: MemoryProbe, dtype: torch.dtype) -> ActivationProfile:
        """The memory of one step at the largest a plan may be (``device_memory.profile_step``), run through
        scratch KV blocks and state slots that are freed afterwards (the cache does not exist yet)."""
        step = profile_step(tokens, self.max_num_seqs, self.block_size, self.model.vocab_size)
        weights = probe.allocated()
        model, device = self.model, self.device
        with torch.inference_mode():
            self.kv_cache = KVCache(model.num_kv_layers, step.blocks, self.block_size, model.num_kv_heads, model.head_dim, dtype, device)
            self.states = None if model.gdn_shape is None else GDNStateCache(model.gdn_shape, step.sequences, dtype, model.embed.device)
        self.num_blocks = step.blocks
        self._limits = self._plan_limits()
        scratch = probe.allocated() - weights
        probe.reset_peak()
        try:
            self.execute(StepPlan(-1, step.slices))
            peak = probe.peak()
        except torch.OutOfMemoryError as exc:
            raise ValueError(
                f"one step of {tokens} tokens over {step.sequences} sequences does not fit beside the weights; lower --max-num-batched-tokens or --max-num-seqs"
            ) from exc
        finally:
            self.release([s.rid for s in step.slices])
            self.kv_cache = self.states = None
            probe.release()
        return ActivationProfile(tokens, step.sequences, weights, scratch, peak)

    @property
    def structured(self) -> StructuredOutputs:
        """xgrammar's tokenizer info and compiler, built once (warm-up does it); a ``ValueError`` when the model has no tokenizer."""
        return self.sampler.structured

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, gdn_slots: torch.Tensor) -> torch.Tensor:
        """A decode-only step from device tensors alone: what a graph records (metadata built inside)."""
        meta = AttentionMetadata.for_decode(positions, block_tables, self.block_size, self.model.dtype, self._attention_backend)
        slots = None
        if self.states is not None:
            # Padding rows read the dummy slot's state before they write it: reinitialised on every replay.
            self.states.zero_slot_(self._dummy_slot)
            slots = SlotMetadata.for_decode(self.states, gdn_slots)
        return self.model.compute_logits(self.decoder(input_ids, positions, meta, self.kv_cache, slots))

    def capture_graphs(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Capture the decode graphs (part of warm-up, before the worker reports ready)."""
        if self.graphs is not None:
            with torch.inference_mode():
                self.graphs.capture_all(stop)

    def _plan_limits(self) -> PlanLimits:
        """What plans must stay within, for the cache and state pool of now."""
        slots, checkpoints = (None, 0) if self.states is None else (self.num_slots, self.states.num_checkpoints)
        draft = None if self.speculator is None else self.speculator.draft
        return PlanLimits(
            self.max_num_seqs, self.block_size, self.num_blocks, self.model.vocab_size, slots, checkpoints, 0 if draft is None else draft.num_blocks
        )

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
        with torch.inference_mode():
            rids, requests, logits, verifies = self._forward(plan.slices)
            by_rid: dict[str, list[Sampled]] = {}
            if rids:
                if self.tp is None or self.tp.leader:
                    chosen, logprobs = self.sampler(logits, requests)
                else:
                    chosen, logprobs = None, [None] * len(rids)
                if self.tp is not None:  # every rank feeds the leader's tokens to the next decode
                    chosen = self.tp.share_tokens(chosen, len(rids))
                tokens = chosen.tolist()
                for request, token in zip(requests, tokens):
                    request.record_sampled(token)
                if self.speculator is not None:
                    self.speculator.sampled(rids, tokens)
                by_rid = {rid: [Sampled(rid, token, lp)] for rid, token, lp in zip(rids, tokens, logprobs)}
            if verifies:
                for rid, verified in self.speculator.verify(*verifies).items():
                    by_rid[rid] = [Sampled(rid, token, lp) for token, lp in zip(verified.tokens, verified.logprobs)]
            sampled = [x for s in plan.slices if s.sample for x in by_rid.get(s.rid, ())]
            proposed, no_guess = {}, []
            if self.speculator is not None:
                proposed = self.speculator.proposed(plan.slices, verifies[0] if verifies else [])
                no_guess = self.speculator.no_guess([x.rid for x in sampled])
        return StepResult(step=plan.step, sampled=sampled, forward_s=time.perf_counter() - began, proposed=proposed, no_guess=no_guess)

    def memory_split(self) -> MemorySplit:
        """The KV cache and expert cache as they are now, with what a new split must hold to."""
        cache = self.expert_cache
        split = MemorySplit(kv_blocks=self.num_blocks, kv_block_bytes=self.kv_block_bytes)
        if cache is None:
            return split
        return msgspec.structs.replace(
            split,
            expert_cache_bytes=cache.budget,
            expert_slots=cache.slots,
            expert_slot_bytes=cache.slot_bytes,
            expert_top_k=cache.top_k,
            experts=cache.experts,
        )

    def resize_memory(self, kv_cache_bytes: int = -1, expert_cache_bytes: int = -1) -> None:
        """A new split of memory (-1 keeps a size): the KV cache rebuilt at ``kv_cache_bytes`` (its contents gone; the same
        block count keeps it), the expert cache's bank at ``expert_cache_bytes``; the weights stay. Only while no request
        is held (the scheduler released them all); checks everything (ValueError, naming why) before changing anything."""
        if len(self.requests):
            raise ValueError(f"{len(self.requests)} requests still hold the KV cache: a resize runs once every request is released")
        if self.graphs is not None or self.tp is not None:
            raise ValueError("memory is resized on a CPU worker without tensor parallelism only")
        if expert_cache_bytes >= 0 and isinstance(self.expert_cache, DeviceExpertCache):
            raise ValueError("a GPU worker's expert cache keeps the size it started with")
        split = self.memory_split()
        blocks = self.num_blocks if kv_cache_bytes < 0 else kv_cache_bytes // split.kv_block_bytes
        if blocks < 1:
            raise ValueError(f"kv_cache_bytes {kv_cache_bytes} holds no KV block of {split.kv_block_bytes} bytes")
        if expert_cache_bytes >= 0:
            if self.expert_cache is None:
                raise ValueError("this worker has no expert cache (--expert-cache-bytes 0, or a model without routed experts)")
            self.expert_cache.slots_for(expert_cache_bytes)
        with torch.inference_mode():
            if blocks != self.num_blocks:
                dtype, self.kv_cache = self.kv_cache.tensor.dtype, None  # the old tensor goes before the new one is made
                model = self.model
                self.kv_cache = KVCache(model.num_kv_layers, blocks, self.block_size, model.num_kv_heads, model.head_dim, dtype, self.device)
                if self._mtp is not None:
                    self._mtp.allocate(blocks, dtype)
                self.num_blocks = blocks
                self._limits = self._plan_limits()
            if expert_cache_bytes >= 0:
                self.expert_cache.resize(expert_cache_bytes)

    def logits(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """Run ``plan`` like ``execute``, KV writes included, but return its sampling slices' logits, unsampled."""
        if self.tp is not None:
            raise RuntimeError("logits() runs on one rank alone; with tensor parallelism use execute()")
        with torch.inference_mode():
            rids, _, logits, _ = self._forward(plan.slices)
        return dict(zip(rids, logits)) if rids else {}

    def release(self, rids: list[str]) -> None:
        """Forget these requests (unknown ones are ignored: a release may follow a failed step)."""
        if self.tp is not None and self.tp.leader:
            self.tp.send_frame(Release(rids=rids))
        self.requests.release(rids)
        if self.speculator is not None:
            self.speculator.release(rids)

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

    def _forward(
        self, slices: list[Slice]
    ) -> tuple[list[str], list[RequestState], torch.Tensor | None, tuple[list[Verify], list[torch.Tensor], SlotMetadata | None] | None]:
        """The rids and states of the slices that sample, and their logits [N, vocab]; and the step's verifies
        (speculative slices with a proposal) with each one's logits [its positions, vocab] and the GDN slots they roll back."""
        if not slices:
            return [], [], None, None
        verifies: dict[str, Verify] = {}
        if self.speculator is not None:
            self.speculator.check(slices, self.requests)
            if self.states is not None:  # the most positions its verifies may save to roll back to
                self.states.check_verifies(sum(s.num_tokens - 1 for s in slices if not s.token_ids))
            speculative, slices = slices, self.speculator.as_decodes(slices)
        elif any(not s.token_ids and s.num_tokens > 1 for s in slices):
            raise ValueError("a decode slice of several positions verifies proposed tokens, but this worker runs no speculative method")
        self.requests.validate(slices, self._limits, self._grammars)
        self.requests.admit(slices, self.states is not None, self._grammars)
        if self.states is not None:  # a hybrid prefix-cache hit starts from a copy of its checkpoint
            for s in slices:
                if s.restore >= 0:
                    self.states.restore_(s.restore, s.slot)
        if self.speculator is not None:
            self.speculator.observe(slices)
            verifies = self.speculator.propose(speculative, self.requests)

        # Decode slices first: attention batches them in one call; verifies and prefill chunks follow.
        plain = [s for s in slices if not s.token_ids and s.rid not in verifies]
        ordered = plain + [s for s in slices if s.rid in verifies] + [s for s in slices if s.token_ids]
        num_decodes = len(slices) - len(verifies) - sum(1 for s in slices if s.token_ids)
        requests = [self.requests[s.rid] for s in ordered]
        input_ids = [r.last_token for r in requests[:num_decodes]]
        self.last_step_graphed = False
        if self.graphs is not None and num_decodes == len(slices) and all(s.sample for s in slices):
            tables = [r.table for r in requests]
            bucket = self.graphs.fits(num_decodes, tables)
            if bucket is not None:
                self.last_step_graphed = True
                slots = [s.slot for s in ordered] if self.states is not None else ()
                logits = self.graphs.run(bucket, input_ids, [s.start for s in ordered], tables, slots)
                return [s.rid for s in ordered], requests, logits, None  # a decode slice always samples
            self.graphs.eager += 1
        for s in ordered[num_decodes:]:
            input_ids += verifies[s.rid].token_ids if s.rid in verifies else s.token_ids
        lens = [len(verifies[s.rid].token_ids) if s.rid in verifies else s.num_tokens for s in ordered]
        starts = [s.start for s in ordered]
        meta = AttentionMetadata.build(
            starts, lens, [r.table for r in requests], num_decodes, self.block_size, self.model.dtype, self.device, self._attention_backend
        )
        slots = None
        if self.states is not None:  # prefill chunks that save GDN checkpoints run their GDN layers in rounds cut there
            first_prefill = num_decodes + len(verifies)
            slots = SlotMetadata.build(
                self.states, [s.slot for s in ordered], starts, lens, num_decodes, [s.checkpoints for s in ordered[first_prefill:]], len(verifies)
            )
        hidden = self.decoder(torch.tensor(input_ids, device=self.device), meta.positions, meta, self.kv_cache, slots)
        if self._mtp is not None:  # the MTP layer's inputs: the target's hidden state at every position
            self._mtp.keep_hidden([(s.rid, s.start, n) for s, n in zip(ordered, lens)], hidden)

        to_sample = [j for j, s in enumerate(ordered) if s.sample and s.rid not in verifies]
        ends = list(itertools.accumulate(lens))
        verified = None
        if verifies:  # every position of a verify: the logits its proposal is checked against
            spans = [(ends[j] - lens[j], ends[j]) for j, s in enumerate(ordered) if s.rid in verifies]
            rows = torch.tensor([r for a, b in spans for r in range(a, b)], device=self.device)
            verify_logits = self.model.compute_logits(hidden.index_select(0, rows)).split([b - a for a, b in spans])
            verified = ([verifies[s.rid] for s in ordered if s.rid in verifies], list(verify_logits), slots)
        if not to_sample:
            return [], [], None, verified
        if len(to_sample) == hidden.shape[0]:  # a decode step: every row is a request's last
            logits = self.model.compute_logits(hidden)
        else:
            # index_select, not hidden[rows]: torch's advanced indexing wakes OpenMP's threads even for a few rows
            last_rows = torch.tensor([ends[j] - 1 for j in to_sample], device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, last_rows))
        return [ordered[j].rid for j in to_sample], [requests[j] for j in to_sample], logits, verified

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
            "attention_backend": self.model.attention_backend,
            "decoder_backend": self.decoder.name,
            **({"cpu_kernels": cpu_kernels()[1] or "built"} if self.device.type == "cpu" else {}),
            # takeover_pool: few-row calls' pool (csrc/takeover_pool.h), items taken over from a helper that was not running;
            # block_quant_isa: the integer block products' instructions (csrc/block_quant_gemm.cpp), avx512-vnni, avx2 or portable;
            # weight_prefetch: whether their prefetch keeps the weights in the caches, and why (cpu_cache.py);
            # pair_tiles: from how many rows their tiles take two panels in 512-bit vectors, and why (kernel_settings.py)
            **(
                {
                    "takeover_pool": kernels.takeover_pool_stats(),
                    "block_quant_isa": kernels.block_quant_gemm_isa(),
                    "weight_prefetch": self.kernel_settings.weight_prefetch if self.kernel_settings else None,
                    "pair_tiles": self.kernel_settings.pair_tiles if self.kernel_settings else None,
                }
                if self.device.type == "cpu" and (kernels := cpu_kernels()[0]) is not None
                else {}
            ),
            "fusion_kernels": getattr(getattr(self.model, "fusions", None), "names", None),
            "sampler": self.sampler.name,
            "speculative": None if self.speculator is None else self.speculator.describe(),
            "structured_outputs": self.sampler.describe_structured(),
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
            "requests": len(self.requests),
            "expert_cache": None if self.expert_cache is None else self.expert_cache.describe(),
            **self.model.describe(),
            **self._describe_slots(),
        }

    def _describe_slots(self) -> dict[str, Any]:
        if self.states is None:
            return {}
        return {
            "gdn_state": {
                "slots_total": self.num_slots,
                "slots_used": len(self.requests.slot_holders),
                "dummy_slot": self._dummy_slot,  # graph padding's, past the scheduler's slots
                "bytes": self.states.nbytes,
                "bytes_per_slot": self.states.bytes_per_slot,
                "checkpoints_total": self.states.num_checkpoints,  # the prefix cache's, past the running slots
                "checkpoint_bytes": self.states.checkpoint_bytes,
                "verify_states": self.states.num_verify_states,  # what speculative verifies roll back to, past the checkpoints
                "verify_state_bytes": self.states.verify_state_bytes,
            },
            "prefix_cache": {"enabled": True} if self.states.num_checkpoints else {"enabled": False, "reason": HYBRID_PREFIX_CACHE_OFF},
        }
