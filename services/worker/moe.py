"""The sparse Mixture-of-Experts MLP: a softmax router sends each token to its top-k SwiGLU experts.

Each layer's experts are stacked into one ``[E, 2I, H]`` gate_up and one ``[E, H, I]`` down tensor.
The torch path (the reference of the other two) groups the (token, expert) pairs by expert: one sort,
one pair of GEMMs per active expert, one weighted ``index_add`` back. The fused Triton path
(``services/worker/kernels``) is chosen once, at load, when the weights live on CUDA.

Experts in q4_0 / q4_1 / q8_0 blocks (``block_quant``: a GGUF's, or quantized at load by
``--weight-quant``) run on a CPU as one C++ call per layer (``csrc/grouped_moe.cpp``): routing, every
active expert's gate/up with the SwiGLU fused, down, and the weighted sum added into the residual in
place, with a layer's shared expert (Qwen3-Next) as one more expert that every token takes. Activations
are rounded to int16 per block of 32 (int8 beyond ``BLOCK_QUANT_MAX_ROWS`` rows under ``int4-a8``), as
the dense block kernels round them. The router's logits there are the C++ ``router_logits`` (each dot
product in one fixed order), which the one-call decoder (``decoder_backends.py``) computes alike. With an
expert cache (``expert_cache.py``) the call runs over its bank of slots, the layer's misses filled once the
kernel's own routing has named them; on a GPU worker's (``device_expert_cache.py``) the float experts' kernel runs
over a bank in device memory, each expert read at its slot (``expert_slots``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from services.worker import block_quant
from services.worker.block_quant import BlockQuantized
from services.worker.cpu_kernels import cpu_kernels
from services.worker.linear import BLOCK_QUANT_MAX_ROWS

if TYPE_CHECKING:
    from services.worker.device_expert_cache import DeviceExpertCache
    from services.worker.expert_cache import ExpertCache

Weight = torch.Tensor | BlockQuantized

# (x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], topk_weights [T, k], topk_ids [T, k], residual [T, H] | None) -> [T, H];
# keyword expert_slots (int32 [E]): the weights' row of each expert, where they are a bank of slots (device_expert_cache.py)
ExpertsFn = Callable[..., torch.Tensor]


class MLP(Protocol):
    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor: ...

    def tensors(self) -> list[torch.Tensor]: ...


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (in fp32) over the experts, top-k, optionally renormalised to sum to 1:
    ``(weights [T, k] in the logits' dtype, expert ids [T, k])``, as transformers' Qwen3-MoE router."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def experts_torch(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    residual: torch.Tensor | None = None,
    expert_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + Σ_j topk_weights[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t))`` with ``e = topk_ids[t, j]``,
    expert e's weights at row ``expert_slots[e]`` of the stacks where given (a bank of slots), else at row e.

    The T·k pairs are sorted by expert (stable: within an expert, in token order) so each active
    expert runs as two GEMMs over its contiguous rows; experts that receive no token cost nothing.
    """
    top_k, inter = topk_ids.shape[1], w_down.shape[2]
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0] if expert_slots is None else expert_slots.numel()).tolist()
    rows_of = range(len(counts)) if expert_slots is None else expert_slots.tolist()
    token = order // top_k
    rows_in = x.index_select(0, token)
    rows_out = torch.empty_like(rows_in)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            gate_up = F.linear(rows_in[rows], w_gate_up[rows_of[expert]])
            act = F.silu(gate_up[:, :inter], inplace=True).mul_(gate_up[:, inter:])
            torch.mm(act, w_down[rows_of[expert]].t(), out=rows_out[rows])
            start += n
    rows_out.mul_(topk_weights.flatten()[order, None].to(rows_out.dtype))
    return (torch.zeros_like(x) if residual is None else residual).index_add(0, token, rows_out)


def _experts_triton() -> ExpertsFn:
    from services.worker.kernels.fused_moe import fused_moe  # imports triton: only on the GPU path

    return fused_moe


MOE_BACKENDS: dict[str, Callable[[], ExpertsFn]] = {"torch": lambda: experts_torch, "triton": _experts_triton}


def select_moe_backend(device: torch.device) -> str:
    """The fused Triton kernels where the weights are on CUDA, else the grouped torch path (experts in
    blocks: ``grouped-cpp``, once ``SparseMoE.hold_blocks`` has them)."""
    return "triton" if device.type == "cuda" else "torch"


def interleave_gate_up(rows: torch.Tensor) -> torch.Tensor:
    """[..., 2I, X] rows [gate | up] → per group i of 8 channels, gate's 8i .. 8i+7 then up's: the order
    in which ``csrc/grouped_moe.cpp`` finds both halves of a channel group in adjacent panels."""
    *lead, two_inter, width = rows.shape
    grouped = rows.reshape(*lead, 2, two_inter // 2 // block_quant.PANEL, block_quant.PANEL, width)
    return grouped.transpose(-4, -3).reshape(rows.shape).contiguous()


class ExpertPanels(NamedTuple):
    """Experts in blocks as ``csrc/grouped_moe.cpp`` multiplies them."""

    formats: tuple[str, str]  # gate_up's, down's
    gate_up: torch.Tensor  # [E, 2I / 8, H / 32, record]: gate and up panels alternating (``interleave_gate_up``)
    down: torch.Tensor  # [E, ceil(H / 8), I / 32, record]

    @classmethod
    def of(cls, gate_up: BlockQuantized, down: BlockQuantized) -> ExpertPanels:
        interleaved = BlockQuantized(gate_up.fmt, interleave_gate_up(gate_up.data), gate_up.in_features)
        return cls((gate_up.fmt, down.fmt), interleaved.panels(), down.panels())

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def placeholders(self) -> ExpertPanels:
        """The same formats and shapes, with no storage (the experts live elsewhere: an expert cache's store)."""
        return ExpertPanels(self.formats, *(_placeholder(tuple(t.shape), torch.uint8) for t in self[1:]))


class ExpertSink(Protocol):
    """Takes each MoE layer's experts, in layer order, as ``SparseMoE.hold_blocks`` makes them (an expert cache's store
    while the model loads: ``expert_cache.ExpertSpill``); the layer then keeps only their shapes. A layer whose
    experts load as floats puts them in blocks under ``EXPERT_QUANT`` (``expert_format``) as it is built (an expert
    at a time where the checkpoint stores them so: ``SparseMoE.load``), so that the sink has each layer's before
    the next layer's are read. A GPU worker's (``on_device``: ``device_expert_cache.DeviceExpertSpill``) takes each
    layer's float experts as loaded (``hold``) instead."""

    on_device: bool

    def append(self, panels: ExpertPanels) -> None: ...

    def hold(self, gate_up: torch.Tensor, down: torch.Tensor) -> None: ...


EXPERT_SINK: ContextVar[ExpertSink | None] = ContextVar("expert_sink", default=None)
# The worker's --weight-quant while a model loads (``weights_loading.load_model``): a checkpoint's experts stored one
# at a time go into its block format as their layer is built (``SparseMoE.load``), so that loading never holds every
# layer's float experts at once.
EXPERT_QUANT: ContextVar[str] = ContextVar("expert_quant", default="none")
BLOCKS_NEEDED = (
    "--expert-cache-bytes needs every MoE layer's experts in q4_0 / q4_1 / q8_0 blocks on the grouped C++ kernel "
    "(--weight-quant int4 or int4-a8, or a GGUF's blocks, with the CPU kernels built)"
)


def _placeholder(shape: tuple[int, ...], dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The shape of weights held only in blocks (their parameter count), with no storage."""
    return torch.empty(shape, dtype=dtype, device="meta")


def _cat_rows(a: torch.Tensor | BlockQuantized, b: torch.Tensor | BlockQuantized) -> torch.Tensor | BlockQuantized:
    """Stacks [E, R1, X] and [E, R2, X] → [E, R1 + R2, X]: blocks stay blocks where both share a format."""
    if isinstance(a, BlockQuantized) and isinstance(b, BlockQuantized) and a.fmt == b.fmt:
        return BlockQuantized(a.fmt, torch.cat([a.data, b.data], dim=-2), a.in_features)
    a, b = (t.dequantize() if isinstance(t, BlockQuantized) else t for t in (a, b))
    return torch.cat([a, b.to(a.dtype)], dim=-2)


def _stacked(w: dict, p: str, num_experts: int) -> tuple[torch.Tensor | BlockQuantized, torch.Tensor | BlockQuantized]:
    """A layer's experts under ``p`` as ([E, 2I, H], [E, H, I]), stored fused (``gate_up_proj``, ``down_proj``:
    transformers 5's layout in memory), stacked per projection (``{gate,up,down}_proj.weight`` [E, ...]:
    a GGUF's, possibly in blocks) or one expert at a time (``{e}.{gate,up,down}_proj.weight``, as
    transformers' ``save_pretrained`` and the published checkpoints write them; popped from ``w`` as they
    are stacked, so loading holds at most one layer's experts twice)."""
    if p + "gate_up_proj" in w:
        return w[p + "gate_up_proj"], w[p + "down_proj"]
    if p + "gate_up_proj.weight" in w:
        return w[p + "gate_up_proj.weight"], w[p + "down_proj.weight"]
    if p + "gate_proj.weight" in w:
        return _cat_rows(w.pop(p + "gate_proj.weight"), w.pop(p + "up_proj.weight")), w[p + "down_proj.weight"]
    first = w[p + "0.gate_proj.weight"]
    inter, hidden = first.shape
    gate_up = torch.empty(num_experts, 2 * inter, hidden, dtype=first.dtype, device=first.device)
    down = torch.empty(num_experts, hidden, inter, dtype=first.dtype, device=first.device)
    for e in range(num_experts):
        gate_up[e, :inter] = w.pop(f"{p}{e}.gate_proj.weight")
        gate_up[e, inter:] = w.pop(f"{p}{e}.up_proj.weight")
        down[e] = w.pop(f"{p}{e}.down_proj.weight")
    return gate_up, down


def _experts_in_blocks(w: dict, p: str, num_experts: int, fmt: str) -> tuple[BlockQuantized, BlockQuantized]:
    """A layer's experts stored one at a time (``{e}.{gate,up,down}_proj.weight``) in ``fmt``'s blocks, each expert
    quantized as it is read (and popped from ``w``), so that the layer's float experts are never all held at once:
    the same bytes as ``_stacked``'s stacks quantized (blocks are per row)."""
    stacks: list[torch.Tensor] = []
    for e in range(num_experts):
        parts = torch.cat([w.pop(f"{p}{e}.gate_proj.weight"), w.pop(f"{p}{e}.up_proj.weight")]), w.pop(f"{p}{e}.down_proj.weight")
        if not stacks:
            in_features = [t.shape[1] for t in parts]
            stacks = [torch.empty(num_experts, t.shape[0], t.shape[1] // block_quant.BLOCK * block_quant.BLOCK_BYTES[fmt], dtype=torch.uint8) for t in parts]
        for stack, t in zip(stacks, parts):
            stack[e] = block_quant.quantize(t, fmt)
    return BlockQuantized(fmt, stacks[0], in_features[0]), BlockQuantized(fmt, stacks[1], in_features[1])


def grouped_kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether experts in blocks can run as ``csrc/grouped_moe.cpp`` here (fp32 on a CPU, kernels built)."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_kernels()[0] is not None


class SharedExpert(NamedTuple):
    """A shared SwiGLU expert in blocks and its gate's row (sigmoid(gate · x) scales it per token)."""

    gate_up: BlockQuantized  # [2I, H]
    down: BlockQuantized  # [H, I]
    gate: torch.Tensor  # [1, H]


READ_AHEAD_WIDTH = 1.25  # top-10 of a top-8 router: 85 % of the next layer's experts read ahead, not 77 % (one stream at 50 %: 19.6 ms a step, 21.0)


class SparseMoE:
    """Post-attention-normed ``x`` → ``residual + moe(x)``; an ``MLP`` of the shared decoder."""

    def __init__(
        self,
        router: torch.Tensor,
        w_gate_up: torch.Tensor | BlockQuantized,
        w_down: torch.Tensor | BlockQuantized,
        top_k: int,
        renormalize: bool,
        backend: str,
    ) -> None:
        num_experts, hidden = router.shape
        if w_gate_up.shape[0] != num_experts or w_gate_up.shape[2] != hidden or tuple(w_down.shape) != (num_experts, hidden, w_gate_up.shape[1] // 2):
            raise ValueError(f"expert weights {tuple(w_gate_up.shape)} / {tuple(w_down.shape)} do not fit a router of {num_experts} experts × {hidden}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts}")
        self.router, self.top_k, self.renormalize, self.backend = router, top_k, renormalize, backend
        self.panels: ExpertPanels | None = None
        self.shared_panels: ExpertPanels | None = None
        self.cache: ExpertCache | DeviceExpertCache | None = None
        self.int8_activations = False
        self.quantized_at_load = False  # float experts put in blocks as the layer was built (``load``)
        self.predictor: torch.Tensor | None = None  # over an expert cache that reads ahead: the next MoE layer's router (stream_from)
        blocks = [isinstance(t, BlockQuantized) for t in (w_gate_up, w_down)]
        if any(blocks) and all(blocks) and grouped_kernel_runs(router.device, router.dtype):
            self.hold_blocks(w_gate_up, w_down)
            return
        # blocks that cannot run here (or only half of a layer in blocks): their float weights
        w_gate_up, w_down = (t.dequantize().to(router.dtype) if isinstance(t, BlockQuantized) else t for t in (w_gate_up, w_down))
        self.w_gate_up, self.w_down = w_gate_up.contiguous(), w_down.contiguous()
        self._experts = MOE_BACKENDS[backend]()
        if (sink := EXPERT_SINK.get()) is not None:
            if sink.on_device:  # a GPU worker's expert cache: the float experts go to host memory now
                sink.hold(self.w_gate_up, self.w_down)
                self.w_gate_up, self.w_down = _placeholder(tuple(w_gate_up.shape), w_gate_up.dtype), _placeholder(tuple(w_down.shape), w_down.dtype)
                return
            if not quantize_experts(self, EXPERT_QUANT.get()):
                raise ValueError(BLOCKS_NEEDED)
            self.quantized_at_load = True

    @classmethod
    def load(cls, w: dict, prefix: str, top_k: int, renormalize: bool, backend: str) -> SparseMoE:
        """From ``{prefix}gate.weight`` (the router) and the experts under ``{prefix}experts.`` (see ``_stacked``); where
        ``EXPERT_QUANT`` names a block format the grouped kernel runs, experts stored one at a time go into it one at a time."""
        router, num_experts = w[prefix + "gate.weight"], w[prefix + "gate.weight"].shape[0]
        weight_quant = EXPERT_QUANT.get()
        fmt = EXPERT_FORMATS.get(weight_quant) if grouped_kernel_runs(router.device, router.dtype) else None
        if fmt is None or prefix + "experts.0.gate_proj.weight" not in w:
            return cls(router, *_stacked(w, prefix + "experts.", num_experts), top_k, renormalize, backend)
        moe = cls(router, *_experts_in_blocks(w, prefix + "experts.", num_experts, fmt), top_k, renormalize, backend)
        moe.int8_activations, moe.quantized_at_load = weight_quant == "int4-a8", True
        return moe

    @property
    def formats(self) -> tuple[str, str]:
        """The experts' storage (gate_up's, down's): block formats, or the float dtype."""
        if self.panels is not None:
            return self.panels.formats
        dtype = str(self.w_gate_up.dtype).removeprefix("torch.")
        return dtype, dtype

    def float_experts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The float experts (None once they are in blocks)."""
        return None if self.panels is not None else (self.w_gate_up, self.w_down)

    def hold_blocks(self, gate_up: BlockQuantized, down: BlockQuantized, int8_activations: bool = False) -> None:
        """From now on the experts run from these blocks in one C++ call per layer (the float weights are
        dropped; the blocks go to ``EXPERT_SINK`` where one is set); ``int8_activations``: steps of more than ``BLOCK_QUANT_MAX_ROWS`` rows round the
        activations of 4-bit experts to int8."""
        self.panels = ExpertPanels.of(gate_up, down)
        if (sink := EXPERT_SINK.get()) is not None:  # loading into an expert cache: this layer's experts go to its store now
            sink.append(self.panels)
            self.panels = self.panels.placeholders()
        self.w_gate_up, self.w_down = _placeholder(tuple(gate_up.shape)), _placeholder(tuple(down.shape))
        self.int8_activations = int8_activations
        self.backend = "grouped-cpp"
        self._kernel, self._logits = cpu_kernels()[0].grouped_moe, cpu_kernels()[0].router_logits
        self._logits_weight = self.router
        self._grouped = self._resident

    @property
    def read_ahead_k(self) -> int:
        """How many of the next layer's experts a token's predicted routing reads ahead: a few more than its top-k, since
        the prediction ranks some of the experts it misses just below them."""
        return min(self.router.shape[0], math.ceil(self.top_k * READ_AHEAD_WIDTH))

    def stream_from(self, cache: ExpertCache, layer: int, predictor: torch.Tensor | None = None) -> None:
        """From now on the experts run from ``cache``'s bank as its MoE layer ``layer``; their panels (in the
        cache's store) are dropped from memory. ``predictor``: the next MoE layer's router over this layer's normed
        input (``read_ahead_predictors``), whose top ``read_ahead_k`` the cache reads ahead while this layer runs."""
        self.panels = self.panels.placeholders()
        self.cache, self.cache_layer, self.predictor = cache, layer, predictor
        self._route = cpu_kernels()[0].route_experts
        self._grouped = self._from_cache

    def experts_from_device_cache(self, cache: DeviceExpertCache, layer: int) -> None:
        """From now on the float experts run over ``cache``'s bank in device memory as its MoE layer ``layer`` (a GPU worker's)."""
        kernel, self.cache, self.cache_layer = self._experts, cache, layer

        def experts(x: torch.Tensor, _gate_up: Weight, _down: Weight, weights: torch.Tensor, ids: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
            return cache.run(layer, x, weights, ids, residual, kernel)

        self._experts = experts

    def add_shared_expert(self, shared: SharedExpert) -> None:
        """A shared expert that every token takes, scaled by sigmoid(gate · x), in the same call (the experts
        must be in blocks)."""
        if self.panels is None:
            raise ValueError("a shared expert joins the grouped call of experts in blocks only")
        one = [BlockQuantized(t.fmt, t.data[None], t.in_features) for t in (shared.gate_up, shared.down)]  # a stack of one expert
        self.shared_panels = ExpertPanels.of(*one)
        self.shared_gate = shared.gate
        self.shared_shapes = (tuple(shared.gate_up.shape), tuple(shared.down.shape))
        self._logits_weight = torch.cat([self.router, shared.gate.reshape(1, -1).to(self.router.dtype)])

    def describe(self) -> str:
        """The experts' weight format and kernel, for /instrumentation."""
        kernel = {"grouped-cpp": "grouped_moe (C++, one call per layer)", "torch": "grouped torch GEMMs", "triton": "fused_moe (Triton)"}[self.backend]
        shared = ", shared expert in the call" if self.shared_panels is not None else ""
        cached = ", from the expert cache" if self.cache is not None else ""
        return f"{'/'.join(dict.fromkeys(self.formats))}: {kernel}{shared}{cached}"

    def held_bytes(self) -> int:
        """The bytes of the experts' blocks (panels) in memory, the shared expert's included (an expert cache's bank apart)."""
        return sum(t.nbytes for p in (self.panels, self.shared_panels) if p is not None for t in p[1:] if not t.is_meta)

    def tensors(self) -> list[torch.Tensor]:
        shared = [] if self.shared_panels is None else [_placeholder(s) for s in self.shared_shapes] + [self.shared_gate]
        return [self.router, self.w_gate_up, self.w_down, *shared]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if self.panels is not None:
            return self._grouped(x, self._logits(x, self._logits_weight), residual)
        weights, ids = route(F.linear(x, self.router), self.top_k, self.renormalize)
        return self._experts(x, self.w_gate_up, self.w_down, weights, ids, residual)

    def _activation_bits(self, rows: int) -> int:
        return 8 if self.int8_activations and rows > BLOCK_QUANT_MAX_ROWS else 16

    def _shared(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        shared = self.shared_panels
        return (None, None) if shared is None else (shared.gate_up[0], shared.down[0])

    def _resident(self, x: torch.Tensor, logits: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self._kernel(
            x, logits, self.top_k, self.renormalize, self.panels.gate_up, self.panels.down, *self._shared(),
            None if residual is None else residual.contiguous(), self._activation_bits(x.shape[0]),
        )  # fmt: skip

    def _from_cache(self, x: torch.Tensor, logits: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if self.cache_layer == 0:
            self.cache.begin_step(x.shape[0])
        return self.run_cached(x, logits, residual)

    def run_cached(self, x: torch.Tensor, logits: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The grouped call over the cache's bank, in a step the cache has begun: the step's layer read whole (a streamed
        step), or once per group of tokens whose experts the bank holds at once, their misses filled on demand."""
        out = torch.zeros_like(x) if residual is None else residual.contiguous()
        x, shared, cache, layer, bits = x.contiguous(), self._shared(), self.cache, self.cache_layer, self._activation_bits(x.shape[0])
        computing = 0.0  # the calls' time, without the fills'
        if cache.streaming:
            slots = cache.streamed(layer)
            began = time.perf_counter()
            self._kernel(x, logits, self.top_k, self.renormalize, cache.gate_up, cache.down, *shared, out, bits, expert_slots=slots)
            computing = time.perf_counter() - began
        else:
            weights, ids = self._route(logits, self.top_k, self.renormalize, self.router.shape[0])
            ahead = (
                None
                if self.predictor is None or not cache.reads_ahead(x.shape[0])
                else (layer + 1, sorted(set(self._route(self._logits(x, self.predictor), self.read_ahead_k, False)[1].view(-1).tolist())))
            )
            for rows, slots in cache.passes(layer, ids, ahead):
                began = time.perf_counter()
                self._kernel(
                    x[rows], logits[rows], self.top_k, self.renormalize, cache.gate_up, cache.down, *shared, out[rows], bits,
                    topk_weights=weights[rows], topk_ids=ids[rows], expert_slots=slots,
                )  # fmt: skip
                computing += time.perf_counter() - began
        cache.layer_ran(layer, x.shape[0], computing)
        return out


class SharedExpertMoE:
    """The sparse MoE plus a shared SwiGLU expert scaled per token by ``sigmoid(shared_expert_gate(x))``
    (Qwen3-Next). Where the experts and the shared expert are in blocks, it joins their grouped call."""

    def __init__(self, moe: SparseMoE, shared: MLP, gate: torch.Tensor, weights: tuple[Weight, Weight]) -> None:
        """``shared`` the shared expert as a dense MLP, ``weights`` its gate_up [2I, H] and down [H, I]."""
        self.moe, self.shared, self.gate, self._weights = moe, shared, gate, weights
        if moe.panels is not None and all(isinstance(t, BlockQuantized) for t in weights):  # a GGUF's
            self._join(*weights)
        elif moe.quantized_at_load:  # as ``hold_blocks`` would have joined it
            self._join_as(moe.panels.formats)

    def tensors(self) -> list[torch.Tensor]:
        return self.moe.tensors() if self.shared is None else [*self.moe.tensors(), *self.shared.tensors(), self.gate]

    def hold_blocks(self, gate_up: BlockQuantized, down: BlockQuantized, int8_activations: bool = False) -> None:
        """``SparseMoE.hold_blocks``, the shared expert joining in the routed experts' formats (or its own blocks)."""
        self.moe.hold_blocks(gate_up, down, int8_activations)
        self._join_as((gate_up.fmt, down.fmt))

    def _join_as(self, formats: tuple[str, str]) -> None:
        """The shared expert joins the call in ``formats`` (gate_up's, down's), or its own blocks."""
        if any(t.shape[-1] % block_quant.BLOCK for t in self._weights):  # stays a dense MLP beside the call
            return
        shared_gate_up, shared_down = (t if isinstance(t, BlockQuantized) else BlockQuantized.of(t, fmt) for t, fmt in zip(self._weights, formats))
        self._join(shared_gate_up, shared_down)

    def _join(self, gate_up: BlockQuantized, down: BlockQuantized) -> None:
        self.moe.add_shared_expert(SharedExpert(gate_up, down, self.gate))
        self.shared, self._weights = None, ()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if self.shared is None:
            return self.moe(x, residual)
        shared = self.shared(x, None).mul_(torch.sigmoid(F.linear(x, self.gate)))
        return self.moe(x, shared if residual is None else shared.add_(residual))


MoELayer = SparseMoE | SharedExpertMoE


def moe_layers(model: object) -> list[MoELayer]:
    """The MoE MLPs of ``model``'s layers."""
    return [layer.mlp for layer in getattr(model, "layers", []) if isinstance(layer.mlp, SparseMoE | SharedExpertMoE)]


EXPERT_FORMATS = {"int4": "q4_1", "int4-a8": "q4_1"}  # --weight-quant → the experts' block format


def _exact_format(gate_up: torch.Tensor, down: torch.Tensor) -> str | None:
    """The block format both stacks round-trip through exactly (a checkpoint dequantized from it), if any."""
    for fmt in block_quant.BLOCK_BYTES:
        if not block_quant.round_trips(gate_up[0], fmt):  # the first expert tells most
            continue
        if all(block_quant.round_trips(t.reshape(-1, t.shape[-1]), fmt) for t in (gate_up, down)):
            return fmt
    return None


def routed_experts(model: object) -> list[SparseMoE]:
    """The ``SparseMoE`` of each MoE layer of ``model``."""
    return [layer.moe if isinstance(layer, SharedExpertMoE) else layer for layer in moe_layers(model)]


def describe_experts(model: object) -> dict[str, int]:
    """How many MoE layers hold their experts in each format and kernel (``SparseMoE.describe``)."""
    held: dict[str, int] = {}
    for moe in routed_experts(model):
        held[moe.describe()] = held.get(moe.describe(), 0) + 1
    return held


def expert_format(moe: SparseMoE, weight_quant: str) -> str | None:
    """The block format that ``moe``'s float experts take under ``weight_quant`` (``int4``, ``int4-a8``: q4_1;
    ``auto``: the format they round-trip through exactly, if any); None where they stay as they are (in blocks
    already, or floats that the grouped kernel cannot run here)."""
    if (floats := moe.float_experts()) is None or not grouped_kernel_runs(moe.router.device, moe.router.dtype):
        return None
    gate_up, down = floats
    if gate_up.shape[-1] % block_quant.BLOCK or down.shape[-1] % block_quant.BLOCK:
        return None
    return EXPERT_FORMATS.get(weight_quant) or (_exact_format(gate_up, down) if weight_quant == "auto" else None)


def quantize_experts(layer: MoELayer, weight_quant: str) -> bool:
    """``layer``'s float experts switch to blocks where ``expert_format`` names one; returns whether they did."""
    moe = layer.moe if isinstance(layer, SharedExpertMoE) else layer
    if (fmt := expert_format(moe, weight_quant)) is None:
        return False
    gate_up, down = moe.float_experts()
    layer.hold_blocks(BlockQuantized.of(gate_up, fmt), BlockQuantized.of(down, fmt), weight_quant == "int4-a8")
    return True


def convert_experts(model: object, weight_quant: str) -> dict[str, int]:
    """The float experts of ``model`` switch to blocks (``quantize_experts``), experts already in blocks (a
    GGUF's) taking int8 activations in many-row steps under ``int4-a8`` as well; returns ``describe_experts``."""
    for layer, moe in zip(moe_layers(model), routed_experts(model)):
        if moe.panels is not None and weight_quant == "int4-a8":  # a GGUF's blocks (the kernel rounds only 4-bit ones to int8)
            moe.int8_activations = True
        quantize_experts(layer, weight_quant)
    return describe_experts(model)
