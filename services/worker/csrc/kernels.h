// The CPU worker's C++ kernels, as bindings.cpp exports them and as kernels built from others call them.
#pragma once

#include <torch/extension.h>

#include <linux/aio_abi.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <tuple>
#include <unordered_map>
#include <vector>

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, int64_t block_size, double scale);
void store_kv_(const torch::Tensor& cache, const torch::Tensor& kv, const torch::Tensor& slots);
torch::Tensor argmax_rows(const torch::Tensor& logits);
torch::Tensor sample_rows(const torch::Tensor& logits, const std::vector<double>& temperature, const std::vector<int64_t>& top_k,
                          const std::vector<double>& top_p, const std::vector<double>& min_p, const std::vector<double>& uniform);
torch::Tensor sampling_thresholds(const torch::Tensor& logits, const std::vector<double>& temperature, const std::vector<int64_t>& top_k,
                                  const std::vector<double>& top_p, const std::vector<double>& min_p);
std::vector<torch::Tensor> logprobs_rows(const torch::Tensor& logits, const torch::Tensor& tokens, int64_t k);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales, const std::optional<torch::Tensor>& bias);
torch::Tensor block_quant_gemm(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features, const std::optional<torch::Tensor>& bias,
                               const std::optional<torch::Tensor>& residual, int64_t activation_bits);
std::string block_quant_gemm_isa();
torch::Tensor grouped_moe(const torch::Tensor& x, const torch::Tensor& router_logits, int64_t top_k, bool renormalize, const torch::Tensor& gate_up,
                          const torch::Tensor& down, const std::optional<torch::Tensor>& shared_gate_up, const std::optional<torch::Tensor>& shared_down,
                          const std::optional<torch::Tensor>& residual, int64_t activation_bits, const std::optional<torch::Tensor>& topk_weights,
                          const std::optional<torch::Tensor>& topk_ids, const std::optional<torch::Tensor>& expert_slots);
torch::Tensor router_logits(const torch::Tensor& x, const torch::Tensor& weight);
std::tuple<torch::Tensor, torch::Tensor> route_experts(const torch::Tensor& router_logits, int64_t top_k, bool renormalize, int64_t num_experts);
void set_block_quant_pair_min_rows(int64_t rows);
int64_t block_quant_pair_min_rows();
double block_quant_wide_product_rate();
void set_weight_prefetch_keep(bool keep);
bool weight_prefetch_keep();
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const std::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                                                      double eps);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);
void rotary_(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
void rms_norm_heads_(const torch::Tensor& x, const torch::Tensor& weight, double eps);
// A decoder's layers (decoder_layers.cpp), their weights held from load: per layer a dense SwiGLU (routers[i]
// none; gate_up / down its panels) or a sparse MoE (routers[i] its [experts, hidden] weight; gate_up / down its
// experts' stacked panels, or where slot_maps[i] is given, an expert cache's: the bank's slot of each expert,
// -1 where not held), q/k head norms where head_norms[i] is given; activations rounded to int16 in steps of up
// to few_rows rows, else to many_row_bits.
class DecoderLayers {
 public:
  // A MoE layer over an expert cache that must fill (or stream): (layer, normed x, router logits) -> its output.
  using CachedLayer = std::function<torch::Tensor(int64_t, const torch::Tensor&, const torch::Tensor&)>;
  // A layer-step that found every routed expert in the bank and ran here: (layer, its experts ascending,
  // seconds of its call), what the cache's policy hears of afterwards, in order (take_bank_hits).
  using BankHit = std::tuple<int64_t, std::vector<int64_t>, double>;

  DecoderLayers(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> qkv, std::vector<std::optional<torch::Tensor>> qkv_bias,
                std::vector<std::optional<torch::Tensor>> head_norms, std::vector<torch::Tensor> o_proj, std::vector<std::optional<torch::Tensor>> o_bias,
                std::vector<std::optional<torch::Tensor>> routers, std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
                std::vector<std::optional<torch::Tensor>> slot_maps, std::vector<std::vector<int64_t>> many_row_bits, int64_t few_rows, int64_t top_k,
                bool renormalize, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                std::vector<std::optional<torch::Tensor>> predictors = {}, std::vector<std::optional<torch::Tensor>> predicted_maps = {},
                int64_t predicted_k = 0);
  // bank: the expert cache's (gate_up, down) slots, where a layer-step whose experts are all held may run here
  // (none: every cached layer goes to cached_layer, as in a streamed step); read_ahead: whether the predictors apply.
  torch::Tensor forward(const torch::Tensor& embedded, const std::vector<torch::Tensor>& caches, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& write_slots, const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t block_size,
                        const std::optional<std::tuple<torch::Tensor, torch::Tensor>>& bank, const std::optional<CachedLayer>& cached_layer,
                        bool read_ahead = true);
  std::vector<BankHit> take_bank_hits();

 private:
  torch::Tensor from_cache(int64_t layer, const torch::Tensor& x, const torch::Tensor& logits, int64_t bits,
                           const std::optional<std::tuple<torch::Tensor, torch::Tensor>>& bank, const std::optional<CachedLayer>& cached_layer,
                           bool read_ahead);

  std::vector<torch::Tensor> norms_, qkv_;
  std::vector<std::optional<torch::Tensor>> qkv_bias_, head_norms_;
  std::vector<torch::Tensor> o_proj_;
  std::vector<std::optional<torch::Tensor>> o_bias_, routers_;
  std::vector<torch::Tensor> gate_up_, down_;
  std::vector<std::optional<torch::Tensor>> slot_maps_;
  // per cached layer, where its cache reads ahead: the next cached layer's router over this layer's normed x
  // ([experts, hidden]) and that layer's slot map; the experts a token's prediction reads ahead (its top predicted_k_)
  std::vector<std::optional<torch::Tensor>> predictors_, predicted_maps_;
  int64_t predicted_k_;
  std::vector<std::vector<int64_t>> many_row_bits_;  // per layer: qkv, o_proj, gate_up (a MoE layer: its experts'), down
  int64_t few_rows_, top_k_;
  bool renormalize_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<BankHit> bank_hits_;  // since the last take_bank_hits
};

// Reads of a file opened with O_DIRECT, in flight while the caller computes (direct_reads.cpp): submit queues reads,
// each (offset, the addresses of its buffers of nbytes each: adjacent records), and gives each one's ticket (-errno
// where it could not be queued); wait gives (a read's result: bytes read or -errno, whether it had still to be
// waited for). Every queued read must be waited for.
class DirectReads {
 public:
  explicit DirectReads(int64_t depth);  // std::system_error where the kernel refuses native AIO
  ~DirectReads();
  DirectReads(const DirectReads&) = delete;
  DirectReads& operator=(const DirectReads&) = delete;
  std::vector<int64_t> submit(int64_t fd, const std::vector<std::tuple<int64_t, std::vector<int64_t>>>& reads, int64_t nbytes);
  std::tuple<int64_t, bool> wait(int64_t ticket);
  int64_t in_flight() const { return in_flight_; }

 private:
  struct Read;
  bool reap(long at_least);  // takes the completions there are, waiting for at least at_least of them

  aio_context_t ctx_ = 0;
  int64_t depth_, in_flight_ = 0, next_ticket_ = 0;
  std::unordered_map<int64_t, std::unique_ptr<Read>> reads_;
};
