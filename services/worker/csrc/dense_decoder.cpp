// The dense decoder's layers for a step, as one call: the same kernels, in the same order and with the
// same arguments as DecoderForCausalLM._forward_fused over int4 weights (Python's per-layer glue, a
// dozen calls per layer, costs as much as a layer's attention at batch 1, and 3-7 % of a 8-32 row
// decode step). The projections are q4_1 panels (block_quant.to_panels) multiplied with int16
// activations, so under int4-a8 (int8 activations beyond a few rows) only few-row steps come here.
//
// Per layer, on normed x and the running residual:
//   qkv = x @ Wqkv (+ b); rotate q, k in place; store k, v in the cache; attend every row over the
//   cache up to its own position; x, residual = add_rms_norm(attn @ Wo (+ b), residual);
//   x, residual = add_rms_norm(down(silu(gate) * up), residual) with the next layer's (or the final) norm.

#include "kernels.h"

#include <cmath>

torch::Tensor dense_decoder_layers(const torch::Tensor& embedded, const std::vector<torch::Tensor>& norms, const std::vector<torch::Tensor>& qkv,
                                   const std::vector<std::optional<torch::Tensor>>& qkv_bias, const std::vector<torch::Tensor>& o_proj,
                                   const std::vector<std::optional<torch::Tensor>>& o_bias, const std::vector<torch::Tensor>& gate_up,
                                   const std::vector<torch::Tensor>& down, const std::vector<torch::Tensor>& caches, const torch::Tensor& cos,
                                   const torch::Tensor& sin, const torch::Tensor& write_slots, const torch::Tensor& block_tables,
                                   const torch::Tensor& context_lens, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, double eps) {
  const int64_t layers = static_cast<int64_t>(qkv.size());
  TORCH_CHECK(norms.size() == static_cast<size_t>(2 * layers + 1), "norms: input and post-attention norm of every layer, then the final norm");
  TORCH_CHECK(qkv_bias.size() == qkv.size() && o_proj.size() == qkv.size() && o_bias.size() == qkv.size() && gate_up.size() == qkv.size() &&
                  down.size() == qkv.size() && caches.size() == qkv.size(),
              "one qkv, o_proj, gate_up, down and cache per layer");
  TORCH_CHECK(embedded.dim() == 2, "embedded must be [rows, hidden]");
  const int64_t rows = embedded.size(0), hidden = embedded.size(1), attn_width = heads * head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim;
  constexpr int64_t INT16 = 16;  // activation bits: few-row steps keep int4 as accurate as its weights
  constexpr int64_t BLOCK_FEATURES = 32;  // input features per panel block (down: [panels, intermediate / 32, ...])
  auto [x, residual] = add_rms_norm(embedded, std::nullopt, norms[0], eps);
  for (int64_t i = 0; i < layers; ++i) {
    const auto qkv_rows = block_quant_gemm(x, qkv[i], qkv_width, qkv_bias[i], std::nullopt, INT16).view({rows, heads + 2 * kv_heads, head_dim});
    rotary_(qkv_rows.narrow(1, 0, heads + kv_heads), cos, sin);
    const auto kv = qkv_rows.narrow(1, heads, 2 * kv_heads).view({rows, 2, kv_heads, head_dim});
    store_kv_(caches[i], kv, write_slots);
    const auto attended = paged_decode_attention(qkv_rows.narrow(1, 0, heads), caches[i], block_tables, context_lens, block_size, scale).view({rows, attn_width});
    std::tie(x, residual) = add_rms_norm(block_quant_gemm(attended, o_proj[i], hidden, o_bias[i], std::nullopt, INT16), residual, norms[2 * i + 1], eps);
    const auto activated = silu_and_mul(block_quant_gemm(x, gate_up[i], 2 * BLOCK_FEATURES * down[i].size(1), std::nullopt, std::nullopt, INT16));
    const auto mlp_out = block_quant_gemm(activated, down[i], hidden, std::nullopt, std::nullopt, INT16);
    std::tie(x, residual) = add_rms_norm(mlp_out, residual, norms[2 * i + 2], eps);
  }
  return x;
}
