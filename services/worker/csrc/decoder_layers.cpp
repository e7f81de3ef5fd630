// A decoder's layers for a step, as one call: the same kernels, in the same order and with the same
// arguments as DecoderForCausalLM.forward_fused over weights in blocks (Python's per-layer glue, a dozen
// calls per layer, costs as much as a layer's attention at batch 1, and 3-7 % of a 8-32 row decode step).
// The projections are q4_0 / q4_1 / q8_0 panels (block_quant.to_panels), their activations rounded as the
// per-layer path rounds them: to int16 in steps of up to few_rows rows, else to each projection's
// many_row_bits (8 under int4-a8: llama.cpp's arithmetic, 16 otherwise).
//
// Per layer, on normed x and the running residual:
//   qkv = x @ Wqkv (+ b); q, k heads RMSNorm-ed by their own weights (Qwen3's q/k norms, where the layer
//   has them) and rotated in place; k, v stored in the cache; every row attends over the cache up to its
//   own position; x, residual = add_rms_norm(attn @ Wo (+ b), residual);
//   mlp = down(silu(gate) * up) (a dense SwiGLU), or grouped_moe over the router's logits (a sparse MoE);
//   x, residual = add_rms_norm(mlp, residual) with the next layer's (or the final) norm.
// The layers' weights are held from construction (once, at load); a step passes only what changes.
//
// A MoE layer whose experts live in an expert cache (services/worker/expert_cache.py) runs here when every
// expert its tokens route to is held in the bank, or when the bank's ExpertBank reads its misses (and, where the
// cache reads ahead, the next cached layer's predicted experts that are not held): grouped_moe over the bank's
// slots, with route_experts' routing, the same bits as resident. Otherwise (a bank that Python fills, a step that
// routes to more experts than the bank holds, or a step that streams its layers) the cache's Python side runs
// the layer (cached_layer: fills, then the same call). The replacement policy stays in Python: the ExpertBank
// logs the layer-steps that ran here, and the cache replays them into it in order.

#include "kernels.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace {

constexpr int64_t INT16 = 16;  // activation bits: few-row steps keep 4-bit blocks as accurate as their weights
constexpr int64_t QKV = 0, O_PROJ = 1, GATE_UP = 2, DOWN = 3;  // a layer's many_row_bits (a MoE layer: its experts' at GATE_UP)
constexpr int64_t BLOCK_FEATURES = 32;  // input features per panel block (down: [panels, intermediate / 32, ...])

std::vector<int64_t> distinct(const torch::Tensor& ids, int64_t experts) {  // the experts int32 ids name, ascending
  std::vector<char> named(experts, 0);
  const int32_t* id = ids.data_ptr<int32_t>();
  for (int64_t j = 0; j < ids.numel(); ++j) named[id[j]] = 1;
  std::vector<int64_t> out;
  for (int64_t e = 0; e < experts; ++e) {
    if (named[e]) out.push_back(e);
  }
  return out;
}

}  // namespace

DecoderLayers::DecoderLayers(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> qkv, std::vector<std::optional<torch::Tensor>> qkv_bias,
                             std::vector<std::optional<torch::Tensor>> head_norms, std::vector<torch::Tensor> o_proj,
                             std::vector<std::optional<torch::Tensor>> o_bias, std::vector<std::optional<torch::Tensor>> routers,
                             std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down, std::vector<std::optional<torch::Tensor>> slot_maps,
                             std::vector<std::vector<int64_t>> many_row_bits, int64_t few_rows, int64_t top_k, bool renormalize, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, double eps, std::vector<std::optional<torch::Tensor>> predictors,
                             std::vector<std::optional<torch::Tensor>> predicted_maps, int64_t predicted_k, std::vector<int64_t> cache_layers)
    : norms_(std::move(norms)), qkv_(std::move(qkv)), qkv_bias_(std::move(qkv_bias)), head_norms_(std::move(head_norms)), o_proj_(std::move(o_proj)),
      o_bias_(std::move(o_bias)), routers_(std::move(routers)), gate_up_(std::move(gate_up)), down_(std::move(down)),
      slot_maps_(std::move(slot_maps)), predictors_(std::move(predictors)), predicted_maps_(std::move(predicted_maps)),
      predicted_k_(predicted_k > 0 ? predicted_k : top_k), cache_layers_(std::move(cache_layers)), many_row_bits_(std::move(many_row_bits)),
      few_rows_(few_rows), top_k_(top_k), renormalize_(renormalize), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {
  const size_t layers = qkv_.size();
  TORCH_CHECK(norms_.size() == 2 * layers + 1, "norms: input and post-attention norm of every layer, then the final norm");
  TORCH_CHECK(qkv_bias_.size() == layers && head_norms_.size() == layers && o_proj_.size() == layers && o_bias_.size() == layers &&
                  routers_.size() == layers && gate_up_.size() == layers && down_.size() == layers && slot_maps_.size() == layers &&
                  many_row_bits_.size() == layers,
              "one qkv, qkv bias, head norm, o_proj, o bias, router, gate_up, down, slot map and many_row_bits per layer");
  if (predictors_.empty()) predictors_.resize(layers);
  if (predicted_maps_.empty()) predicted_maps_.resize(layers);
  TORCH_CHECK(predictors_.size() == layers && predicted_maps_.size() == layers, "predictors and predicted_maps: none, or one per layer");
  if (cache_layers_.empty()) cache_layers_.assign(layers, -1);
  TORCH_CHECK(cache_layers_.size() == layers, "cache_layers: none, or one per layer");
  for (size_t i = 0; i < layers; ++i) {
    TORCH_CHECK(many_row_bits_[i].size() == 4, "layer ", i, "'s many_row_bits must be [qkv, o_proj, gate_up, down]");
    for (int64_t bits : many_row_bits_[i]) TORCH_CHECK(bits == 8 || bits == 16, "layer ", i, "'s many_row_bits must be 8 or 16, got ", bits);
    if (head_norms_[i]) {
      TORCH_CHECK(head_norms_[i]->dim() == 2 && head_norms_[i]->size(0) == heads + kv_heads && head_norms_[i]->size(1) == head_dim,
                  "layer ", i, "'s head norms must be [heads + kv_heads, head_dim], got ", head_norms_[i]->sizes());
    }
    // A MoE layer's experts are stacked [experts, panels, blocks, record]; a dense layer's panels [panels, blocks, record].
    const int64_t expected = routers_[i] ? 4 : 3;
    TORCH_CHECK(gate_up_[i].dim() == expected && down_[i].dim() == expected, "layer ", i, (routers_[i] ? "'s experts" : "'s MLP"), " panels must have ",
                expected, " dims, got ", gate_up_[i].dim(), " and ", down_[i].dim());
    if (routers_[i]) {
      TORCH_CHECK(top_k >= 1 && top_k <= routers_[i]->size(0), "top_k must be in 1..", routers_[i]->size(0), ", got ", top_k);
    }
    if (slot_maps_[i]) {
      TORCH_CHECK(cache_layers_[i] >= 0, "layer ", i, " has a slot map, so it needs its MoE layer in the cache (cache_layers)");
      const auto& slots = *slot_maps_[i];
      TORCH_CHECK(routers_[i] && slots.dim() == 1 && slots.scalar_type() == torch::kInt32 && slots.is_contiguous() && slots.size(0) == routers_[i]->size(0),
                  "layer ", i, "'s slot map must be contiguous int32 [experts] of a MoE layer");
    }
    if (predictors_[i]) {
      const auto& map = predicted_maps_[i];
      TORCH_CHECK(slot_maps_[i] && map && map->scalar_type() == torch::kInt32 && map->is_contiguous() && predictors_[i]->dim() == 2 &&
                      predictors_[i]->size(0) == map->size(0) && predictors_[i]->size(1) == routers_[i]->size(1),
                  "layer ", i, "'s predictor must be [experts, hidden] with the predicted layer's int32 slot map, on a cached layer");
    }
  }
}

torch::Tensor DecoderLayers::forward(const torch::Tensor& embedded, const std::vector<torch::Tensor>& caches, const torch::Tensor& cos,
                                     const torch::Tensor& sin, const torch::Tensor& write_slots, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, int64_t block_size,
                                     const std::optional<std::tuple<torch::Tensor, torch::Tensor>>& bank, const std::optional<CachedLayer>& cached_layer,
                                     bool read_ahead, ExpertBank* expert_bank) {
  const int64_t layers = static_cast<int64_t>(qkv_.size());
  TORCH_CHECK(caches.size() == qkv_.size(), "one cache per layer: ", layers, " layers, ", caches.size(), " caches");
  TORCH_CHECK(embedded.dim() == 2, "embedded must be [rows, hidden]");
  const int64_t rows = embedded.size(0), hidden = embedded.size(1), attn_width = heads_ * head_dim_;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  const int64_t qkv_width = (heads_ + 2 * kv_heads_) * head_dim_;
  auto [x, residual] = add_rms_norm(embedded, std::nullopt, norms_[0], eps_);
  for (int64_t i = 0; i < layers; ++i) {
    const auto bits = [&](int64_t projection) { return rows <= few_rows_ ? INT16 : many_row_bits_[i][projection]; };
    const auto qkv_rows = block_quant_gemm(x, qkv_[i], qkv_width, qkv_bias_[i], std::nullopt, bits(QKV)).view({rows, heads_ + 2 * kv_heads_, head_dim_});
    const auto qk = qkv_rows.narrow(1, 0, heads_ + kv_heads_);
    if (head_norms_[i]) rms_norm_heads_(qk, *head_norms_[i], eps_);
    rotary_(qk, cos, sin);
    const auto kv = qkv_rows.narrow(1, heads_, 2 * kv_heads_).view({rows, 2, kv_heads_, head_dim_});
    store_kv_(caches[i], kv, write_slots);
    const auto attended = paged_decode_attention(qkv_rows.narrow(1, 0, heads_), caches[i], block_tables, context_lens, block_size, scale).view({rows, attn_width});
    std::tie(x, residual) = add_rms_norm(block_quant_gemm(attended, o_proj_[i], hidden, o_bias_[i], std::nullopt, bits(O_PROJ)), residual, norms_[2 * i + 1], eps_);
    torch::Tensor mlp_out;
    if (slot_maps_[i]) {
      mlp_out = from_cache(i, x, router_logits(x, *routers_[i]), bits(GATE_UP), bank, cached_layer, read_ahead, expert_bank);
    } else if (routers_[i]) {
      mlp_out = grouped_moe(x, router_logits(x, *routers_[i]), top_k_, renormalize_, gate_up_[i], down_[i], std::nullopt, std::nullopt, std::nullopt, bits(GATE_UP),
                            std::nullopt, std::nullopt, std::nullopt);
    } else {
      const auto activated = silu_and_mul(block_quant_gemm(x, gate_up_[i], 2 * BLOCK_FEATURES * down_[i].size(1), std::nullopt, std::nullopt, bits(GATE_UP)));
      mlp_out = block_quant_gemm(activated, down_[i], hidden, std::nullopt, std::nullopt, bits(DOWN));
    }
    std::tie(x, residual) = add_rms_norm(mlp_out, residual, norms_[2 * i + 2], eps_);
  }
  return x;
}

torch::Tensor DecoderLayers::from_cache(int64_t layer, const torch::Tensor& x, const torch::Tensor& logits, int64_t bits,
                                        const std::optional<std::tuple<torch::Tensor, torch::Tensor>>& bank,
                                        const std::optional<CachedLayer>& cached_layer, bool read_ahead, ExpertBank* expert_bank) {
  TORCH_CHECK(cached_layer.has_value(), "layer ", layer, "'s experts are in an expert cache: forward needs cached_layer");
  if (!bank) return (*cached_layer)(layer, x, logits);
  TORCH_CHECK(expert_bank != nullptr, "a cached layer over the bank needs the bank's ExpertBank");
  const auto& slot_map = *slot_maps_[layer];
  const int64_t experts = slot_map.size(0);
  auto [weights, ids] = route_experts(logits, top_k_, renormalize_, experts);
  const auto routed = distinct(ids, experts);
  const int32_t* slot = slot_map.data_ptr<int32_t>();
  bool all_held = std::all_of(routed.begin(), routed.end(), [&](int64_t e) { return slot[e] >= 0; });
  std::vector<int64_t> predicted;  // the next cached layer's experts, where this step reads them ahead
  if (read_ahead && predictors_[layer] && (all_held || expert_bank->fills())) {
    predicted = distinct(std::get<1>(route_experts(router_logits(x, *predictors_[layer]), predicted_k_, false, experts)), experts);
    const int32_t* next_slot = predicted_maps_[layer]->data_ptr<int32_t>();
    all_held = all_held && std::all_of(predicted.begin(), predicted.end(), [&](int64_t e) { return next_slot[e] >= 0; });
  }
  const int64_t cache_layer = cache_layers_[layer];
  ExpertBank::LayerStep* step = nullptr;
  if (all_held) {
    step = &expert_bank->ran(cache_layer, routed);
  } else if (expert_bank->fills() && static_cast<int64_t>(routed.size()) <= expert_bank->slots()) {
    step = &expert_bank->fill(cache_layer, routed, predicted.empty() ? -1 : cache_layer + 1, predicted);
  } else {
    return (*cached_layer)(layer, x, logits);
  }
  const auto began = std::chrono::steady_clock::now();
  auto out = grouped_moe(x, logits, top_k_, renormalize_, std::get<0>(*bank), std::get<1>(*bank), std::nullopt, std::nullopt, std::nullopt, bits, weights, ids,
                         slot_map);
  step->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  return out;
}
