"""The Qwen3-Next hybrid decoder: Gated DeltaNet (linear attention) layers and gated full-attention
layers, as ``layer_types`` lays them out, each followed by a sparse MoE with a gated shared expert
(or a dense SwiGLU where ``mlp_only_layers`` / ``decoder_sparse_step`` say so).

- Full attention: q_proj gives each head's query and an output gate; zero-centred RMSNorm on q and
  k; rotary on the leading ``partial_rotary_factor`` of each head; ``o_proj(sigmoid(gate) · attn)``.
- Gated DeltaNet: in_proj_qkvz / in_proj_ba (grouped by key head in the checkpoint, regrouped here at
  load into one projection [q | k | v | z | b | a]); causal conv1d with SiLU over q, k, v; L2-normed
  q and k; ``β = sigmoid(b)``, ``g = −exp(A_log) · softplus(a + dt_bias)``; the gated delta rule over
  the request's state slot; RMSNorm(o) · silu(z); out_proj.
- Every other RMSNorm is zero-centred (scales by ``1 + w``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from services.worker.attention import ATTENTION_BACKENDS, AttentionFn, AttentionMetadata, KVCache, paged_attention
from services.worker.block_quant import BlockQuantized
from services.worker.gdn import GDNKernels, select_gdn_kernels
from services.worker.gdn_state import GDNShape, SlotMetadata
from services.worker.linear import Linear, cat_rows, map_rows
from services.worker.models.decoder import MLP, DecoderConfig, DecoderLayer, RotateFn, Weights
from services.worker.models.qwen3_moe import Qwen3MoeForCausalLM
from services.worker.moe import SharedExpertMoE, SparseMoE
from services.worker.rmsnorm import RMSNorm
from services.worker.rotary import apply_rotary_
from shared.model_info import FULL_ATTENTION, LINEAR_ATTENTION, layer_types


class GatedAttention:
    """Input-normed hidden states → ``residual + o_proj(sigmoid(gate) · attention)`` over the paged KV cache.

    The projection's rows are regrouped at load to [q | k | v | gate], so q and k are normed together
    and k, v are one contiguous slice, as the shared decoder's attention has them.
    """

    def __init__(
        self, w: Weights, prefix: str, cfg: DecoderConfig, rotary_dim: int, attend: AttentionFn = paged_attention, rotate: RotateFn = apply_rotary_
    ) -> None:
        p = prefix + "self_attn."
        self.attend, self.rotate = attend, rotate
        heads, kv_heads, dim = self.heads, self.kv_heads, self.dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rotary_dim = rotary_dim

        def split(rows: torch.Tensor) -> torch.Tensor:  # q_proj's rows per head [query; gate] → [queries | gates]
            return rows.reshape(heads, 2, dim, -1).transpose(0, 1).reshape(rows.shape)

        def regroup(name: str) -> torch.Tensor | BlockQuantized:  # → [queries | k | v | gates]
            q_proj = w[f"{p}q_proj.{name}"]
            if name == "bias":
                q_gate = split(q_proj[:, None])[:, 0]
                return torch.cat([q_gate[: heads * dim], w[f"{p}k_proj.bias"], w[f"{p}v_proj.bias"], q_gate[heads * dim :]])
            queries, gates = map_rows(q_proj, lambda rows: split(rows)[: heads * dim]), map_rows(q_proj, lambda rows: split(rows)[heads * dim :])
            return cat_rows([queries, w[f"{p}k_proj.weight"], w[f"{p}v_proj.weight"], gates])

        self.proj = Linear(regroup("weight"), cfg.threads, regroup("bias") if cfg.attention_bias else None)  # hidden -> (2 heads + 2 kv_heads) * dim
        self.o_proj = Linear(w[p + "o_proj.weight"], cfg.threads, w[p + "o_proj.bias"] if cfg.attention_bias else None)
        q_norm, k_norm = 1 + w[p + "q_norm.weight"], 1 + w[p + "k_norm.weight"]
        self.qk_norm = RMSNorm(torch.cat([q_norm.expand(heads, -1), k_norm.expand(kv_heads, -1)]), cfg.eps)
        self._norm_weights = [q_norm, k_norm]

    def tensors(self) -> list[torch.Tensor]:
        parts = [self.proj.weight, self.proj.bias, self.o_proj.weight, self.o_proj.bias, *self._norm_weights]
        return [t for t in parts if t is not None]

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor
    ) -> torch.Tensor:
        total, heads, kv_heads, dim = x.shape[0], self.heads, self.kv_heads, self.dim
        qkvg = self.proj(x).view(total, 2 * heads + 2 * kv_heads, dim)
        qk = qkvg[:, : heads + kv_heads]
        self.qk_norm.norm_(qk)
        self.rotate(qk[..., : self.rotary_dim], cos, sin)  # partial rotary: the leading dims of each head
        out = self.attend(qkvg[:, :heads], qkvg[:, heads : heads + 2 * kv_heads].view(total, 2, kv_heads, dim), cache, meta)
        out.mul_(torch.sigmoid(qkvg[:, heads + 2 * kv_heads :].reshape(total, heads * dim)))
        return self.o_proj(out, residual=residual)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(Σx² + 1e-6)`` over the head dim, in fp32 (as transformers and FLA compute it)."""
    x32 = x.float()
    return (x32 * x32.square().sum(-1, keepdim=True).add_(1e-6).rsqrt_()).to(x.dtype)


class GatedDeltaNet:
    """Input-normed hidden states → ``residual + out_proj(RMSNorm(o) · silu(z))``, where o is the gated
    delta rule over the request's state slot; decode slices and verifies (position by position) take the
    recurrent kernels, prefill chunks the chunked ones."""

    def __init__(self, w: Weights, prefix: str, config: dict, cfg: DecoderConfig, kernels: GDNKernels) -> None:
        p = prefix + "linear_attn."
        hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
        dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
        if hv % hk:
            raise ValueError(f"linear_num_value_heads={hv} must be a multiple of linear_num_key_heads={hk}")
        self.hk, self.hv, self.dk, self.dv, self.kernels = hk, hv, dk, dv, kernels
        self.key_dim, self.value_dim = hk * dk, hv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        group = hv // hk

        # The checkpoint groups rows by key head: per head [q, k, v of its group, z of its group], and
        # [b of its group, a of its group]. Regrouped to [q | k | v | z | b | a], all in head order.
        def regroup(rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:  # per key head [parts...] → [part (all heads) | ...]
            by_head = rows.reshape(hk, sum(sizes), -1).split(sizes, dim=1)
            return torch.cat([x.reshape(-1, rows.shape[-1]) for x in by_head])

        qkvz = map_rows(w[p + "in_proj_qkvz.weight"], lambda rows: regroup(rows, [dk, dk, group * dv, group * dv]))
        ba = map_rows(w[p + "in_proj_ba.weight"], lambda rows: regroup(rows, [group, group]))
        self.in_proj = Linear(cat_rows([qkvz, ba]), cfg.threads)
        self.conv_weight = w[p + "conv1d.weight"].squeeze(1).contiguous()  # [C, K]
        self.conv_bias = w.get(p + "conv1d.bias")
        self.a_log, self.dt_bias = w[p + "A_log"], w[p + "dt_bias"]
        self.neg_a = -self.a_log.float().exp()  # g = -exp(A_log) · softplus(a + dt_bias), in fp32
        self.dt_bias32 = self.dt_bias.float()
        self.norm = RMSNorm(w[p + "norm.weight"], cfg.eps)  # plain weight here, not zero-centred
        self.out_proj = Linear(w[p + "out_proj.weight"], cfg.threads)

    def tensors(self) -> list[torch.Tensor]:
        parts = [self.in_proj.weight, self.conv_weight, self.conv_bias, self.a_log, self.dt_bias, self.norm.weight, self.out_proj.weight]
        return [t for t in parts if t is not None]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, slots: SlotMetadata, layer: int) -> torch.Tensor:
        total, kernels, decodes = x.shape[0], self.kernels, slots.num_decodes
        conv_state, state = slots.cache.conv[layer], slots.cache.recurrent[layer]
        proj = self.in_proj(x)
        mixed = proj[:, : self.conv_dim]
        z_end = self.conv_dim + self.value_dim
        z, b, a = proj[:, self.conv_dim : z_end], proj[:, z_end : z_end + self.hv], proj[:, z_end + self.hv :]

        first_prefill = decodes + slots.num_verify_rows
        verifies = slice(decodes, first_prefill)
        parts = []
        if decodes:
            parts.append(kernels.causal_conv1d_update(mixed[:decodes].contiguous(), conv_state, slots.decode_slots, self.conv_weight, self.conv_bias))
        if slots.num_verify_rows:  # token by token, each position's state saved (gdn_state.SlotMetadata.by_positions)
            update = kernels.causal_conv1d_update
            parts.append(slots.by_positions(lambda x, ids: update(x[0], conv_state, ids, self.conv_weight, self.conv_bias), [mixed[verifies]], conv_state))
        if first_prefill < total:  # in rounds where a chunk saves GDN checkpoints (gdn_state.SlotMetadata.by_rounds)
            conv = kernels.causal_conv1d_varlen
            parts.append(
                slots.by_rounds(
                    lambda x, cu, ids, initial: conv(x[0].contiguous(), cu, conv_state, ids, initial, self.conv_weight, self.conv_bias),
                    [mixed[first_prefill:]],
                    conv_state,
                )
            )
        qkv = parts[0] if len(parts) == 1 else torch.cat(parts)
        q = _l2norm(qkv[:, : self.key_dim].view(total, self.hk, self.dk))
        k = _l2norm(qkv[:, self.key_dim : 2 * self.key_dim].view(total, self.hk, self.dk))
        v = qkv[:, 2 * self.key_dim :].reshape(total, self.hv, self.dv).contiguous()
        beta = torch.sigmoid(b.float())
        g = self.neg_a * F.softplus(a.float() + self.dt_bias32)

        scale = self.dk**-0.5
        outs = []
        if decodes:
            d = slice(0, decodes)
            outs.append(kernels.fused_recurrent_gated_delta_rule(q[d], k[d], v[d], g[d], beta[d], scale, state, slots.decode_slots))
        if slots.num_verify_rows:
            step = kernels.fused_recurrent_gated_delta_rule
            rows = [q[verifies], k[verifies], v[verifies], g[verifies], beta[verifies]]
            outs.append(slots.by_positions(lambda x, ids: step(*x, scale, state, ids), rows, state))
        if first_prefill < total:
            pf = slice(first_prefill, total)
            rule = kernels.chunk_gated_delta_rule
            outs.append(slots.by_rounds(lambda x, cu, ids, initial: rule(*x, scale, state, ids, cu, initial), [q[pf], k[pf], v[pf], g[pf], beta[pf]], state))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        o = self.norm(o).mul_(F.silu(z.reshape(total, self.hv, self.dv)))
        return self.out_proj(o.view(total, self.value_dim), residual=residual)


class Qwen3NextForCausalLM(Qwen3MoeForCausalLM):
    ZERO_CENTRED_NORMS = True
    NORM_TOPK_PROB = True

    def __init__(self, config: dict, weights: Weights) -> None:
        self.layer_types = layer_types(config)
        unknown = set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
        if unknown:
            raise ValueError(f"qwen3_next layer types {sorted(unknown)} are not supported (supported: {FULL_ATTENTION}, {LINEAR_ATTENTION})")
        # Layer i's index among the layers of its kind: its KV cache layer, or its GDN state layer.
        self.cache_index = [self.layer_types[:i].count(kind) for i, kind in enumerate(self.layer_types)]
        self.gdn_kernels = select_gdn_kernels(weights["model.embed_tokens.weight"].device)
        self._config = config
        super().__init__(config, weights)
        self.num_kv_layers = self.layer_types.count(FULL_ATTENTION)
        num_gdn = self.layer_types.count(LINEAR_ATTENTION)
        if num_gdn:
            self.gdn_shape = GDNShape(
                num_layers=num_gdn,
                conv_channels=2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
                + config["linear_num_value_heads"] * config["linear_value_head_dim"],
                conv_history=config.get("linear_conv_kernel_dim", 4) - 1,
                num_v_heads=config["linear_num_value_heads"],
                key_dim=config["linear_key_head_dim"],
                value_dim=config["linear_value_head_dim"],
            )

    def rotary_dim(self, config: dict) -> int:
        params = config.get("rope_parameters") or {}
        factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))  # transformers' default for qwen3_next
        return int(self.cfg.head_dim * factor)

    def _layer(self, w: Weights, index: int) -> DecoderLayer:
        return self._decoder_layer(w, f"model.layers.{index}.", index, self.layer_types[index])

    def mtp_layer(self, w: Weights) -> DecoderLayer:
        """The checkpoint's multi-token-prediction layer (``mtp.layers.0.``): gated full attention and the MLP of a
        layer of index 0, as vLLM numbers it (``speculative/mtp.py`` runs it)."""
        return self._decoder_layer(w, "mtp.layers.0.", 0, FULL_ATTENTION)

    def _decoder_layer(self, w: Weights, p: str, index: int, kind: str) -> DecoderLayer:
        if kind == FULL_ATTENTION:
            attend = ATTENTION_BACKENDS[self.attention_backend]
            mixer: GatedAttention | GatedDeltaNet = GatedAttention(w, p, self.cfg, self.rotary_dim(self._config), attend, self.rotate)
        else:
            mixer = GatedDeltaNet(w, p, self._config, self.cfg, self.gdn_kernels)
        return DecoderLayer(
            input_norm=self.rms_norm(w[p + "input_layernorm.weight"]),
            attn=mixer,
            post_norm=self.rms_norm(w[p + "post_attention_layernorm.weight"]),
            mlp=self.mlp(w, p, index),
        )

    def mlp(self, w: Weights, prefix: str, index: int) -> MLP:
        routed = super().mlp(w, prefix, index)
        if not isinstance(routed, SparseMoE) or prefix + "mlp.shared_expert_gate.weight" not in w:
            return routed
        p = prefix + "mlp.shared_expert."
        weights = (cat_rows([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]]), w[p + "down_proj.weight"])
        return SharedExpertMoE(routed, self.dense_mlp(w, p), w[prefix + "mlp.shared_expert_gate.weight"], weights)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, slots: SlotMetadata | None = None
    ) -> torch.Tensor:
        if slots is None and self.gdn_shape is not None:
            raise ValueError("a qwen3_next step needs the GDN state slots of its requests")
        cos, sin = self.rotary.lookup(positions, attn.max_position)
        h = F.embedding(input_ids, self.embed)
        for layer, kind, j in zip(self.layers, self.layer_types, self.cache_index):
            x = layer.input_norm(h)
            if kind == FULL_ATTENTION:
                h = layer.attn(x, h, cos, sin, attn, kv_cache.layers[j])
            else:
                h = layer.attn(x, h, slots, j)
            h = layer.mlp(layer.post_norm(h), h)
        return self.norm(h)

    def _mix(
        self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, slots: SlotMetadata | None
    ) -> torch.Tensor:
        layer, j = self.layers[index], self.cache_index[index]
        if self.layer_types[index] == FULL_ATTENTION:
            return layer.attn(x, None, cos, sin, attn, kv_cache.layers[j])
        if slots is None:
            raise ValueError("a qwen3_next step needs the GDN state slots of its requests")
        return layer.attn(x, None, slots, j)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "full_attention_layers": self.num_kv_layers,
            "gdn_layers": self.gdn_shape.num_layers if self.gdn_shape else 0,
            "gdn_kernels": self.gdn_kernels.names,
        }
