// The CPU worker's C++ kernels as one Python extension module (services/worker/cpu_kernels.py).

#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, int64_t block_size, double scale);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales, const std::optional<torch::Tensor>& bias);
torch::Tensor block_quant_linear(const torch::Tensor& x, const torch::Tensor& weight, const std::string& format, int64_t in_features,
                                 const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& residual);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const std::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                                                      double eps);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);
void rotary_(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor dense_decoder_layers(const torch::Tensor& embedded, const std::vector<torch::Tensor>& norms, const std::vector<torch::Tensor>& qkv,
                                   const std::vector<std::optional<torch::Tensor>>& qkv_bias, const std::vector<torch::Tensor>& o_proj,
                                   const std::vector<std::optional<torch::Tensor>>& o_bias, const std::vector<torch::Tensor>& gate_up,
                                   const std::vector<torch::Tensor>& down, const std::vector<torch::Tensor>& caches, const torch::Tensor& cos,
                                   const torch::Tensor& sin, const torch::Tensor& write_slots, const torch::Tensor& block_tables,
                                   const torch::Tensor& context_lens, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (fp32, CPU)");
  m.def("block_quant_linear", &block_quant_linear, "x @ dequantized(q4_1 or q8_0 blocks).T (+ bias) (+ residual), fp32 arithmetic (CPU)");
  m.def("int8_linear", &int8_linear, "x @ (int8 weight * per-channel scale).T (+ bias), fp32 arithmetic (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm(h) * weight, h) with h = x + residual written over x (fp32, CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [gate | up] rows (fp32, CPU)");
  m.def("dense_decoder_layers", &dense_decoder_layers, "a dense decoder's layers over int4 weights for a step of few rows, one call (fp32, CPU)");
  m.def("rotary_", &rotary_, "rotate x [tokens, heads, rotary_dim] in place by cos/sin [tokens, 1, rotary_dim] (fp32, CPU)");
}
