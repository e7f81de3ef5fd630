// The CPU worker's C++ kernels, as bindings.cpp exports them and as kernels built from others call them.
#pragma once

#include <torch/extension.h>

#include <linux/aio_abi.h>

#include <array>
#include <deque>
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

// A read of the expert store that failed (expert_bank.cpp): OSError(errno, what) in Python.
struct StoreReadError : std::system_error {
  using std::system_error::system_error;
};

// The expert cache's bank as its layer-steps see it (expert_bank.cpp): the slot maps of every MoE layer
// (int32 [experts], -1 where not held, shared with Python), the bank's records [slots, record], and the store's
// reads (none: Python fills, the bank only logs). begin (LRU) or begin_lfu hands it the policy's state as a step
// begins; fill makes a layer-step's experts (ascending) resident and starts reading the experts ahead of
// ahead_layer (-1: none) behind them; ran logs a layer-step that found every expert held; take_log gives every
// layer-step since the last call, in order, for the policy to hear of.
class ExpertBank {
 public:
  using Claim = std::array<int64_t, 4>;  // (expert, slot, evicted layer, evicted expert; -1, -1: a free slot)
  struct LayerStep {
    int64_t layer = -1;            // -1: reads ahead that landed between layer-steps
    std::vector<int64_t> experts;  // routed, ascending
    bool filled = false;           // through fill (else: every expert was held)
    std::vector<Claim> fills;      // this layer-step's misses, read
    int64_t ahead_layer = -1;
    std::vector<Claim> reserved;                     // ahead_layer's experts whose reads started behind them
    std::vector<std::array<int64_t, 2>> dropped;     // (layer, expert) whose read failed: its slot holds nothing
    int64_t bytes = 0, landed = 0, used = 0;         // bytes of the misses; reads ahead landed first, and routed here
    double fill_seconds = 0, seconds = 0;            // the fill's, the layer's call (where the decoder ran it)
  };

  ExpertBank(DirectReads* reads, int64_t fd, int64_t record, const torch::Tensor& records, std::vector<torch::Tensor> slot_maps);
  ~ExpertBank();
  ExpertBank(const ExpertBank&) = delete;
  ExpertBank& operator=(const ExpertBank&) = delete;
  void begin(const std::vector<int64_t>& free, const std::vector<int64_t>& ranked);  // LRU: ranked least recent first
  void begin_lfu(const std::vector<int64_t>& free, const torch::Tensor& count, const torch::Tensor& last, int64_t step, int64_t layer, int64_t passes,
                 int64_t aging_passes);
  LayerStep& fill(int64_t layer, const std::vector<int64_t>& experts, int64_t ahead_layer, const std::vector<int64_t>& ahead);
  LayerStep& ran(int64_t layer, const std::vector<int64_t>& experts);
  void land_all();  // waits for the reads ahead in flight, mapping what they read (logged as a layer -1 step)
  std::vector<LayerStep> take_log();
  bool fills() const { return reads_ != nullptr; }
  int64_t slots() const { return static_cast<int64_t>(key_of_.size()); }
  int64_t runs_read() const { return runs_read_; }  // reads queued so far, each a run of adjacent records
  std::tuple<torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t> lfu_state() const;  // after begin_lfu: count, last, step, layer, passes
  void fail_reads_of(std::vector<std::array<int64_t, 2>> runs) { failing_ = std::move(runs); }  // tests

 private:
  struct Run {
    int64_t layer, first;
    std::vector<int64_t> slots;
  };
  struct Ahead {
    int64_t ticket;
    Run run;
  };
  LayerStep land(int64_t layer, const std::vector<int64_t>& routed);
  void start(const std::vector<int64_t>& free);
  void next_step(int64_t layer);
  void used(int64_t slot);                  // a layer-step read it
  void filled(int64_t slot, int64_t uses);  // 1: a miss read into it; 0: an expert read ahead
  int64_t victim();                         // a slot this layer-step does not hold (free first); -1: none
  int64_t least_used() const;
  int64_t least_recent();
  void to_back(int64_t slot);
  void compact();
  Claim claim(int64_t slot, int64_t layer, int64_t expert);
  std::vector<Run> runs(int64_t layer, const std::vector<Claim>& claims) const;
  std::tuple<int64_t, std::vector<int64_t>> request(const Run& run) const;
  void drop(const Run& run, LayerStep& step);
  std::vector<int64_t> submit(const std::vector<Run>& runs);  // each run's ticket, or -errno

  DirectReads* reads_;
  int64_t fd_, record_, experts_ = 0, runs_read_ = 0;
  torch::Tensor records_;  // held: reads land in it
  uint8_t* base_ = nullptr;
  std::vector<torch::Tensor> slot_maps_;
  std::vector<int32_t*> maps_;
  std::vector<int64_t> key_of_;  // per slot: layer * experts + expert, -1 where free
  std::vector<uint64_t> stamp_, mark_;  // per slot: its latest queue entry; the layer-step (epoch_) that holds it
  uint64_t epoch_ = 0;
  std::vector<int64_t> free_;  // taken from the back, as the policy's free list
  bool lfu_ = false;
  std::deque<std::pair<int64_t, uint64_t>> queue_;  // LRU: (slot, stamp), least recent first; an entry whose stamp is old is stale
  std::vector<int64_t> count_, last_;  // LFU: per slot, uses (halved every aging_passes_ passes over the layers) and last use
  int64_t step_ = 0, layer_ = 0, passes_ = 0, aging_passes_ = 1;
  std::vector<Ahead> ahead_;
  std::vector<LayerStep> log_;
  std::vector<std::array<int64_t, 2>> failing_;  // tests: (layer, first expert) of runs whose reads fail with EIO
};

// A decoder's layers (decoder_layers.cpp), their weights held from load: per layer a dense SwiGLU (routers[i]
// none; gate_up / down its panels) or a sparse MoE (routers[i] its [experts, hidden] weight; gate_up / down its
// experts' stacked panels, or where slot_maps[i] is given, an expert cache's: the bank's slot of each expert,
// -1 where not held, as its MoE layer cache_layers[i]), q/k head norms where head_norms[i] is given;
// activations rounded to int16 in steps of up to few_rows rows, else to many_row_bits.
class DecoderLayers {
 public:
  // A MoE layer over an expert cache that must fill (or stream): (layer, normed x, router logits) -> its output.
  using CachedLayer = std::function<torch::Tensor(int64_t, const torch::Tensor&, const torch::Tensor&)>;

  DecoderLayers(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> qkv, std::vector<std::optional<torch::Tensor>> qkv_bias,
                std::vector<std::optional<torch::Tensor>> head_norms, std::vector<torch::Tensor> o_proj, std::vector<std::optional<torch::Tensor>> o_bias,
                std::vector<std::optional<torch::Tensor>> routers, std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
                std::vector<std::optional<torch::Tensor>> slot_maps, std::vector<std::vector<int64_t>> many_row_bits, int64_t few_rows, int64_t top_k,
                bool renormalize, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                std::vector<std::optional<torch::Tensor>> predictors = {}, std::vector<std::optional<torch::Tensor>> predicted_maps = {},
                int64_t predicted_k = 0, std::vector<int64_t> cache_layers = {});
  // bank: the expert cache's (gate_up, down) slots and its ExpertBank, where a layer-step may run here: every
  // routed expert held, or filled by the ExpertBank where it reads (none: every cached layer goes to cached_layer,
  // as in a streamed step); read_ahead: whether the predictors apply.
  torch::Tensor forward(const torch::Tensor& embedded, const std::vector<torch::Tensor>& caches, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& write_slots, const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t block_size,
                        const std::optional<std::tuple<torch::Tensor, torch::Tensor>>& bank, const std::optional<CachedLayer>& cached_layer,
                        bool read_ahead = true, ExpertBank* expert_bank = nullptr);

 private:
  torch::Tensor from_cache(int64_t layer, const torch::Tensor& x, const torch::Tensor& logits, int64_t bits,
                           const std::optional<std::tuple<torch::Tensor, torch::Tensor>>& bank, const std::optional<CachedLayer>& cached_layer,
                           bool read_ahead, ExpertBank* expert_bank);

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
  std::vector<int64_t> cache_layers_;  // per layer: its MoE layer in the expert cache (-1: not cached)
  std::vector<std::vector<int64_t>> many_row_bits_;  // per layer: qkv, o_proj, gate_up (a MoE layer: its experts'), down
  int64_t few_rows_, top_k_;
  bool renormalize_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
};

