// grouped_moe: a Mixture-of-Experts layer over block-quantized experts in one call (services/worker/moe.py).
//
//   out[t] = residual[t] + sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = the j-th of t's top-k
//            (+ sigmoid(g_t) * shared(x_t), the shared expert where the layer has one)
//
// from the router's logits [T, E] (softmax over the experts, top-k, optionally renormalised, as
// moe.route); with a shared expert the logits have one more column, its gate's logit g. The routing may
// come precomputed (route_experts: the same arithmetic, so the caller learns the routed ids first), and the
// experts' panels may be a bank of slots (expert_slots[e]: the row of expert e, -1 where it is not held,
// which a routed expert must never be; services/worker/expert_cache.py): the same bits either way.
//
// 1. The (token, expert) pairs are sorted by expert (counting sort, stable: token order within an expert);
//    x is rounded once per token (activation_quant.h) and gathered into that order.
// 2. gate/up: work items (expert, range of column panels). An expert's gate_up panels alternate gate and
//    up (panel 2i: gate channels 8i .. 8i+7, panel 2i+1: up's, as moe.py lays them out), so an item holds
//    both halves of its channels and writes silu(gate) * up straight into the activations [pairs, I].
// 3. The activations are rounded per row.
// 4. down: work items (range of hidden panels) over every active expert, each row's product times its
//    routing weight added into a per-item accumulator [panels, T, 8], committed as out[t, cols] += acc:
//    items own disjoint columns, so the weighted sum lands in place with no reduction pass.
// Items run on the takeover pool for decode steps of up to its MAX_ROWS tokens (few rows: no per-expert
// dispatch at all), else on OpenMP's threads, sharing items as shared_items.h does. A step's experts come
// from memory (a model's are larger than a last-level cache), and with a few rows per expert the reads
// would add to the arithmetic: each expert's first tile of rows asks for its weight stream ahead into L2
// (block_panels.h Prefetch::TO_L2; gate/up items walk an expert's panels, and a thread's next item, front
// to back), and while a down item computes an expert, the next expert's panels of the item are asked into
// L2 too. (Asking for a thread's whole next gate/up item at once instead, with no prefetch in the tiles
// past the call's first expert, was 1.10-1.25x slower at 8 and 32 tokens in bench.moe_cpu's layers read
// from memory; in the MoE benchmark model's own layers, 1.2x slower at 8 tokens under the non-temporal
// weight hint and within the spread under T0.)
// Whether tiles take two panels at a time (block_panels.h ``tile_span``) follows the call's tokens, not an
// expert's rows: from enough tokens on, the few rows an expert gets are bound by the 256-bit tiles'
// instruction count more than by the weight stream (that model's 16- and 32-row steps 1.10-1.14x faster;
// 8 rows 1.08x where a core has two 512-bit ports). Which thread
// computes an item does not change its arithmetic: the same bits at every thread count.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "avx2_exp.h"
#include "avx2_sum.h"
#include "block_panels.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using namespace block_panels;

constexpr int64_t MAX_PANELS_PER_ITEM = 16;

// A weight set that rows are routed to: a routed expert, or the shared expert.
struct Expert {
  const uint8_t* gate_up;  // [2 * inter / 8, hidden / 32, gate_up_record]
  const uint8_t* down;     // [ceil(hidden / 8), inter / 32, down_record]
  int64_t gate_up_record, down_record, inter;
  int set;              // its rows' set: 0 the routed pairs, 1 the tokens (the shared expert)
  int64_t first, count;  // its rows within that set
};

// What every item of a call reads; owned by the jobs (a helper that was taken over may still read it
// after the call has returned).
template <typename T1, typename T2>
struct Call {
  int64_t tokens, hidden, top_k;
  std::vector<Expert> experts;        // the active ones, in expert order, then the shared expert
  std::vector<int64_t> pair_token;    // routed row -> its token
  std::vector<float> pair_weight;     // routed row -> its routing weight
  std::vector<float> shared_weight;   // token -> sigmoid(shared gate logit)
  QuantizedRows<T1> x_rows[2];        // x rounded: [0] in routed row order, [1] per token
  activation_quant::Unzeroed<float> act[2];  // silu(gate) * up: [routed rows, I], [tokens, shared I]; every element committed
  QuantizedRows<T2> act_rows[2];      // act rounded
  float* out;                         // [T, hidden]

  int64_t token_of(const Expert& e, int64_t row) const { return e.set == 0 ? pair_token[e.first + row] : row; }
  float weight_of(const Expert& e, int64_t row) const { return e.set == 0 ? pair_weight[e.first + row] : shared_weight[row]; }
};

// silu(g) * u over 8 channels.
inline void silu_mul8(const float* g, const float* u, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 gate = _mm256_loadu_ps(g), one = _mm256_set1_ps(1.f);
  const __m256 e = exp8(_mm256_or_ps(gate, _mm256_set1_ps(-0.f)));  // exp(-|g|): no overflow
  const __m256 negative = _mm256_cmp_ps(gate, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_mul_ps(gate, sigmoid), _mm256_loadu_ps(u)));
#else
  for (int c = 0; c < PANEL; ++c) {
    const float e = std::exp(-std::fabs(g[c]));
    out[c] = g[c] * ((g[c] >= 0.f ? 1.f : e) / (1.f + e)) * u[c];
  }
#endif
}

// acc[c] += w * v[c] over a panel's 8 channels: one vector FMA where the build has them (a scalar loop there is
// contracted to the same FMAs, but the compiler cannot vectorize it: acc and v might overlap).
inline void add_weighted8(float* acc, float w, const float* v) {
#if defined(__AVX2__) && defined(__FMA__)
  _mm256_storeu_ps(acc, _mm256_fmadd_ps(_mm256_set1_ps(w), _mm256_loadu_ps(v), _mm256_loadu_ps(acc)));
#else
  for (int64_t c = 0; c < PANEL; ++c) acc[c] += w * v[c];
#endif
}

// `rows` rows (from m0) of `a` times `span` panels from `panel`, by the record format's tiles.
template <typename T>
void tile_of(int64_t record, const uint8_t* panel, int64_t panel_bytes, int64_t span, const QuantizedRows<T>& a, int64_t m0, int64_t rows,
             Prefetch prefetch, float* sums) {
  if (record == Q4_0Panels::RECORD) return run_tile<Q4_0Panels, T>(panel, panel_bytes, span, a, m0, rows, prefetch, sums);
  if (record == Q4_1Panels::RECORD) return run_tile<Q4_1Panels, T>(panel, panel_bytes, span, a, m0, rows, prefetch, sums);
  if constexpr (std::is_same_v<T, int16_t>) run_tile<Q8_0Panels, T>(panel, panel_bytes, span, a, m0, rows, prefetch, sums);
}

// Asks for `bytes` from `from` into L2: the weights a thread's next work reads, so that memory streams them
// while it computes.
inline void prefetch_to_l2(const uint8_t* from, int64_t bytes) {
  for (int64_t line = 0; line < (bytes + 63) / 64; ++line) __builtin_prefetch(from + 64 * line, 0, 2);  // prefetcht1 on x86
}

// Items that run as takeover_pool jobs or on OpenMP's threads: compute into scratch, commit into the output.
template <typename T1, typename T2>
struct Phase : takeover_pool::Job {
  std::shared_ptr<Call<T1, T2>> call;
  int64_t scratch = 0;
  int64_t scratch_floats() const override { return scratch; }
};

// gate/up: item i is (expert, pairs [first, last) of its channel groups of 8).
template <typename T1, typename T2>
struct GateUp : Phase<T1, T2> {
  struct Item {
    int64_t expert, first, last;
  };
  std::vector<Item> items;

  void compute(int64_t i, float* scratch) const override {
    const auto& c = *this->call;
    const Item item = items[i];
    const Expert& e = c.experts[item.expert];
    const QuantizedRows<T1>& a = c.x_rows[e.set];
    const int64_t panel_bytes = a.blocks * e.gate_up_record;
    float sums[2 * MAX_ROW_TILE * PANEL];
    for (int64_t chunk = 0; chunk < e.count; chunk += ROW_CHUNK)
      for (int64_t q = item.first; q < item.last; ++q) {
        const uint8_t* gate = e.gate_up + 2 * q * panel_bytes;
        const bool pair = tile_span(2 * q, 2 * q + 2, c.tokens) == 2;
        for (int64_t m0 = chunk; m0 < std::min(e.count, chunk + ROW_CHUNK); m0 += row_tile()) {
          const int64_t rows = std::min(row_tile(), e.count - m0);
          const Prefetch prefetch = m0 == 0 ? Prefetch::TO_L2 : Prefetch::NONE;  // an expert's first tile of rows
          if (pair) {
            tile_of<T1>(e.gate_up_record, gate, panel_bytes, 2, a, e.first + m0, rows, prefetch, sums);
          } else {
            tile_of<T1>(e.gate_up_record, gate, panel_bytes, 1, a, e.first + m0, rows, prefetch, sums);
            tile_of<T1>(e.gate_up_record, gate + panel_bytes, panel_bytes, 1, a, e.first + m0, rows, prefetch, sums + MAX_ROW_TILE * PANEL);
          }
          for (int64_t r = 0; r < rows; ++r)
            silu_mul8(sums + r * PANEL, sums + MAX_ROW_TILE * PANEL + r * PANEL, scratch + ((q - item.first) * e.count + m0 + r) * PANEL);
        }
      }
  }
  void commit(int64_t i, const float* scratch) const override {
    auto& c = *this->call;
    const Item item = items[i];
    const Expert& e = c.experts[item.expert];
    float* act = c.act[e.set].data();
    for (int64_t q = item.first; q < item.last; ++q)
      for (int64_t r = 0; r < e.count; ++r)
        std::memcpy(act + (e.first + r) * e.inter + q * PANEL, scratch + ((q - item.first) * e.count + r) * PANEL, PANEL * sizeof(float));
  }
};

// down: item i is hidden panels [i * per_item, ...) over every active expert, weighted, summed per token.
template <typename T1, typename T2>
struct Down : Phase<T1, T2> {
  int64_t per_item = 1, panel_count = 0;

  void compute(int64_t i, float* scratch) const override {
    const auto& c = *this->call;
    const int64_t begin = i * per_item, end = std::min(panel_count, begin + per_item);
    std::fill(scratch, scratch + (end - begin) * c.tokens * PANEL, 0.f);
    float sums[2 * MAX_ROW_TILE * PANEL];
    for (size_t x = 0; x < c.experts.size(); ++x) {
      const Expert& e = c.experts[x];
      const QuantizedRows<T2>& a = c.act_rows[e.set];
      const int64_t panel_bytes = a.blocks * e.down_record;
      if (x + 1 < c.experts.size()) {  // the next expert's panels of this item arrive while this one computes
        const Expert& n = c.experts[x + 1];
        const int64_t bytes = c.act_rows[n.set].blocks * n.down_record;
        prefetch_to_l2(n.down + begin * bytes, (end - begin) * bytes);
      }
      for (int64_t chunk = 0; chunk < e.count; chunk += ROW_CHUNK)
        for (int64_t p = begin, span; p < end; p += span) {
          span = tile_span(p, end, c.tokens);
          for (int64_t m0 = chunk; m0 < std::min(e.count, chunk + ROW_CHUNK); m0 += row_tile()) {
            const int64_t rows = std::min(row_tile(), e.count - m0);
            tile_of<T2>(e.down_record, e.down + p * panel_bytes, panel_bytes, span, a, e.first + m0, rows, m0 == 0 ? Prefetch::TO_L2 : Prefetch::NONE, sums);
            for (int64_t q = 0; q < span; ++q)
              for (int64_t r = 0; r < rows; ++r)
                add_weighted8(scratch + ((p + q - begin) * c.tokens + c.token_of(e, m0 + r)) * PANEL, c.weight_of(e, m0 + r),
                              sums + q * MAX_ROW_TILE * PANEL + r * PANEL);
          }
        }
    }
  }
  void commit(int64_t i, const float* scratch) const override {
    const auto& c = *this->call;
    const int64_t begin = i * per_item, end = std::min(panel_count, begin + per_item);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * PANEL, cols = std::min(PANEL, c.hidden - n0);
      for (int64_t t = 0; t < c.tokens; ++t) {
        float* to = c.out + t * c.hidden + n0;
        const float* from = scratch + ((p - begin) * c.tokens + t) * PANEL;
        for (int64_t ch = 0; ch < cols; ++ch) to[ch] += from[ch];
      }
    }
  }
};

// Runs a phase's items on the takeover pool (few tokens) or on OpenMP's threads.
void run_items(const std::shared_ptr<takeover_pool::Job>& job, int64_t items, bool on_pool) {
  if (on_pool) return takeover_pool::run(job, items);
  share_items(items, [&](int64_t item) {
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < job->scratch_floats()) scratch.resize(job->scratch_floats());
    job->compute(item, scratch.data());
    job->commit(item, scratch.data());
  });
}

// Rows rounded per block of 32; on the caller's thread in a step whose calls run on the pool.
template <typename T>
QuantizedRows<T> round_rows(const float* x, int64_t rows, int64_t k, bool on_caller) {
  const int64_t blocks = k / BLOCK;
  QuantizedRows<T> a(rows, k);
  at::parallel_for(0, rows, on_caller ? std::max<int64_t>(rows, 1) : 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < blocks; ++b)
        activation_quant::quantize_block<T>(x + r * k + b * BLOCK, a.q.data() + r * k + b * BLOCK, a.d.data() + r * blocks + b, a.s.data() + r * blocks + b);
  });
  return a;
}

// Row i of `rows` is row from[i] of `source`: a token's rounded row copied to each of its top-k experts' rows
// (copying it is a fraction of rounding it top_k times).
template <typename T>
QuantizedRows<T> gathered_rows(const QuantizedRows<T>& source, const int64_t* from, int64_t rows) {
  const int64_t k = source.k, blocks = source.blocks;
  QuantizedRows<T> a(rows, k);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(source.q.data() + from[r] * k, k, a.q.data() + r * k);
    std::copy_n(source.d.data() + from[r] * blocks, blocks, a.d.data() + r * blocks);
    std::copy_n(source.s.data() + from[r] * blocks, blocks, a.s.data() + r * blocks);
  }
  return a;
}

// a . b over n floats, in one fixed order (the same bits on every thread and at every row count).
[[maybe_unused]] float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  sum = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

#ifdef __AVX512F__
// dot() of TB rows of x with EB rows of w at a time, each product in dot()'s order: one 16-lane sum whose
// halves are dot()'s two 8-lane sums, added as it adds them (the same bits). The rows' loads are shared,
// so a decode step's router runs on its FMAs rather than on its loads. `next`: rows the following tile
// reads, asked for a line each as this tile reads one (nullptr: none).
template <int TB, int EB>
void dot_tile(const float* x, const float* w, int64_t n, float* out, int64_t out_stride, const float* next) {
  __m512 acc[TB][EB];
  for (int t = 0; t < TB; ++t)
    for (int e = 0; e < EB; ++e) acc[t][e] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (next != nullptr)
      for (int e = 0; e < EB; ++e) _mm_prefetch(reinterpret_cast<const char*>(next + e * n + i), _MM_HINT_T0);
    __m512 xv[TB];
    for (int t = 0; t < TB; ++t) xv[t] = _mm512_loadu_ps(x + t * n + i);
    for (int e = 0; e < EB; ++e) {
      const __m512 wv = _mm512_loadu_ps(w + e * n + i);
      for (int t = 0; t < TB; ++t) acc[t][e] = _mm512_fmadd_ps(xv[t], wv, acc[t][e]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int e = 0; e < EB; ++e) {
      const __m512 v = acc[t][e];
      float sum = hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
      for (int64_t j = i; j < n; ++j) sum += x[t * n + j] * w[e * n + j];
      out[t * out_stride + e] = sum;
    }
}

// Rows [0, TB) of x against rows [0, experts) of w: four of w's rows at a time, then one; the first rows of
// x (`ahead`) ask for each next four rows of w while they read these.
template <int TB>
void dot_rows(const float* x, const float* w, int64_t n, int64_t experts, float* out, int64_t out_stride, bool ahead) {
  int64_t e = 0;
  for (; e + 4 <= experts; e += 4) dot_tile<TB, 4>(x, w + e * n, n, out + e, out_stride, ahead && e + 8 <= experts ? w + (e + 4) * n : nullptr);
  for (; e < experts; ++e) dot_tile<TB, 1>(x, w + e * n, n, out + e, out_stride, nullptr);
}
#endif

// x [T, H] . rows [e0, e0 + count) of w [E, H] into out (out_stride floats a row of x): four rows of x at a time.
void router_rows(const float* x, const float* w, int64_t tokens, int64_t hidden, int64_t e0, int64_t count, float* out, int64_t out_stride) {
#ifdef __AVX512F__
  for (int64_t t = 0; t < tokens; t += 4) {
    const float *xt = x + t * hidden, *we = w + e0 * hidden;
    float* ot = out + t * out_stride;
    switch (std::min<int64_t>(4, tokens - t)) {
      case 1: dot_rows<1>(xt, we, hidden, count, ot, out_stride, t == 0); break;
      case 2: dot_rows<2>(xt, we, hidden, count, ot, out_stride, t == 0); break;
      case 3: dot_rows<3>(xt, we, hidden, count, ot, out_stride, t == 0); break;
      default: dot_rows<4>(xt, we, hidden, count, ot, out_stride, t == 0);
    }
  }
#else
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t e = 0; e < count; ++e) out[t * out_stride + e] = dot(x + t * hidden, w + (e0 + e) * hidden, hidden);
#endif
}

// A decode step's router on the takeover pool: item i is experts [i * EXPERTS_PER_ITEM, ...) for every token, so
// that both cores read the router's weights (a layer's 147 KB on the MoE benchmark model, from memory: the
// step's experts have passed through the caches since).
struct RouterJob : takeover_pool::Job {
  static constexpr int64_t EXPERTS_PER_ITEM = 8;
  torch::Tensor x, w, out;  // owned: a helper may still read after the call returns
  int64_t tokens = 0, hidden = 0, experts = 0;

  int64_t scratch_floats() const override { return tokens * EXPERTS_PER_ITEM; }
  int64_t count(int64_t item) const { return std::min(EXPERTS_PER_ITEM, experts - item * EXPERTS_PER_ITEM); }
  void compute(int64_t item, float* scratch) const override {
    router_rows(x.data_ptr<float>(), w.data_ptr<float>(), tokens, hidden, item * EXPERTS_PER_ITEM, count(item), scratch, EXPERTS_PER_ITEM);
  }
  void commit(int64_t item, const float* scratch) const override {
    float* o = out.data_ptr<float>() + item * EXPERTS_PER_ITEM;
    for (int64_t t = 0; t < tokens; ++t) std::memcpy(o + t * experts, scratch + t * EXPERTS_PER_ITEM, count(item) * sizeof(float));
  }
};

// exp(l[e] - top) for e < n into out, eight lanes at a time where the build has AVX2 (avx2_exp.h).
void shifted_exps(const float* l, int64_t n, float top, float* out) {
  int64_t e = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 shift = _mm256_set1_ps(top);
  for (; e + 8 <= n; e += 8) _mm256_storeu_ps(out + e, exp8(_mm256_sub_ps(_mm256_loadu_ps(l + e), shift)));
  if (e < n) {
    float tail[8];
    std::fill(tail, tail + 8, top);
    std::copy(l + e, l + n, tail);
    _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), shift)));
    std::copy(tail, tail + (n - e), out + e);
  }
#else
  for (; e < n; ++e) out[e] = std::exp(l[e] - top);
#endif
}

// Each token's top-k experts and weights from its router logits: softmax in fp32, the k largest (ties:
// the lower expert first), optionally renormalised to sum to 1. Per token the exps are vectorized and the k
// largest kept by insertion, where std::exp and a sort per token made routing ~5 % of a 32-token MoE decode step.
void route(const float* logits, int64_t tokens, int64_t stride, int64_t experts, int64_t top_k, bool renormalize, std::vector<int64_t>& ids,
           std::vector<float>& weights) {
  ids.resize(tokens * top_k);
  weights.resize(tokens * top_k);
  std::vector<float> exps(experts);
  std::vector<int64_t> best(top_k);  // the token's largest so far, in descending order
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = logits + t * stride;
    shifted_exps(l, experts, *std::max_element(l, l + experts), exps.data());
    float total = 0.f;
    for (int64_t e = 0; e < experts; ++e) total += exps[e];
    int64_t held = 0;
    for (int64_t e = 0; e < experts; ++e) {
      if (held == top_k && exps[e] <= exps[best[top_k - 1]]) continue;  // not above the k-th: a later expert never displaces an equal one
      int64_t at = std::min(held, top_k - 1);
      for (; at > 0 && exps[best[at - 1]] < exps[e]; --at) best[at] = best[at - 1];
      best[at] = e;
      held = std::min(held + 1, top_k);
    }
    float kept = 0.f;
    for (int64_t j = 0; j < top_k; ++j) kept += exps[best[j]] / total;
    for (int64_t j = 0; j < top_k; ++j) {
      const float prob = exps[best[j]] / total;
      ids[t * top_k + j] = best[j];
      weights[t * top_k + j] = renormalize ? prob / kept : prob;
    }
  }
}

struct Weights {
  const uint8_t *gate_up, *down;
  int64_t gate_up_record, down_record, inter, gate_up_stride, down_stride;  // per expert, in bytes
};

Weights check_weights(const torch::Tensor& gate_up, const torch::Tensor& down, int64_t hidden, int64_t experts, const char* what) {
  // Each expert's panels are contiguous; experts are stride(0) bytes apart (a bank's slots may be padded records).
  auto expert_contiguous = [](const torch::Tensor& t) { return t.size(0) > 0 && t[0].is_contiguous() && (t.size(0) == 1 || t.stride(0) >= t[0].numel()); };
  TORCH_CHECK(gate_up.dim() == 4 && down.dim() == 4 && gate_up.scalar_type() == torch::kUInt8 && down.scalar_type() == torch::kUInt8 &&
                  expert_contiguous(gate_up) && expert_contiguous(down),
              what, " panels must be uint8 [experts, panels, blocks, record], each expert's contiguous, got strides ", gate_up.strides(), " and ",
              down.strides());
  const int64_t gu_record = gate_up.size(3), down_record = down.size(3);
  for (int64_t record : {gu_record, down_record})
    TORCH_CHECK(record == Q4_0Panels::RECORD || record == Q4_1Panels::RECORD || record == Q8_0Panels::RECORD, "a panel record is ", RECORD_SIZES, ", got ",
                record);
  const int64_t inter = down.size(2) * BLOCK;
  TORCH_CHECK(gate_up.size(0) == experts && down.size(0) == experts, what, ": ", experts, " experts expected, got ", gate_up.size(0), " and ", down.size(0));
  TORCH_CHECK(gate_up.size(1) == 2 * inter / PANEL && gate_up.size(2) == hidden / BLOCK, what, " gate_up panels of ", inter, " x ", hidden,
              " must be [experts, ", 2 * inter / PANEL, ", ", hidden / BLOCK, ", record], got ", gate_up.sizes());
  TORCH_CHECK(down.size(1) == (hidden + PANEL - 1) / PANEL, what, " down panels must be [experts, ", (hidden + PANEL - 1) / PANEL, ", ", inter / BLOCK,
              ", record], got ", down.sizes());
  return {gate_up.data_ptr<uint8_t>(), down.data_ptr<uint8_t>(), gu_record, down_record, inter, gate_up.stride(0), down.stride(0)};
}

// Where each expert's panels are: row e of the weights (all resident), or row slots[e] of a bank of `rows`.
struct Rows {
  const int32_t* slots;  // nullptr: all resident
  int64_t rows;
  int64_t of(int64_t expert) const {
    if (!slots) return expert;
    TORCH_CHECK(slots[expert] >= 0 && slots[expert] < rows, "expert ", expert, " is routed but its slot is ", slots[expert], " (a bank of ", rows, " slots)");
    return slots[expert];
  }
};

// A precomputed routing (route_experts'), or none: the call routes.
struct Routing {
  const int32_t* ids;
  const float* weights;
};

template <typename T1, typename T2>
void run_layer(const float* x, const float* logits, int64_t tokens, int64_t hidden, int64_t experts, int64_t top_k, bool renormalize, const Weights& routed,
               const std::optional<Weights>& shared, const Routing& given, const Rows& rows, float* out) {
  const bool on_pool = takeover_pool::runs_on_pool(tokens), on_caller = takeover_pool::keeps_to_caller(tokens);
  auto call = std::make_shared<Call<T1, T2>>();
  call->tokens = tokens;
  call->hidden = hidden;
  call->top_k = top_k;
  call->out = out;
  const int64_t stride = experts + (shared ? 1 : 0);
  std::vector<int64_t> ids;
  std::vector<float> weights;
  if (given.ids) {
    ids.assign(given.ids, given.ids + tokens * top_k);
    weights.assign(given.weights, given.weights + tokens * top_k);
  } else {
    route(logits, tokens, stride, experts, top_k, renormalize, ids, weights);
  }

  // Pairs sorted by expert (stable).
  std::vector<int64_t> counts(experts + 1, 0);
  for (int64_t id : ids) ++counts[id + 1];
  std::partial_sum(counts.begin(), counts.end(), counts.begin());
  const int64_t pairs = tokens * top_k;
  std::vector<int64_t> next(counts.begin(), counts.end() - 1);
  call->pair_token.resize(pairs);
  call->pair_weight.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t row = next[ids[p]]++;
    call->pair_token[row] = p / top_k;
    call->pair_weight[row] = weights[p];
  }
  for (int64_t e = 0; e < experts; ++e)
    if (const int64_t n = counts[e + 1] - counts[e]; n > 0) {
      const int64_t row = rows.of(e);
      call->experts.push_back({routed.gate_up + row * routed.gate_up_stride, routed.down + row * routed.down_stride, routed.gate_up_record, routed.down_record,
                               routed.inter, 0, counts[e], n});
    }
  QuantizedRows<T1> token_rows = round_rows<T1>(x, tokens, hidden, on_caller);
  call->x_rows[0] = gathered_rows(token_rows, call->pair_token.data(), pairs);
  call->act[0].resize(pairs * routed.inter);
  if (shared) {
    call->shared_weight.resize(tokens);
    for (int64_t t = 0; t < tokens; ++t) call->shared_weight[t] = 1.f / (1.f + std::exp(-logits[t * stride + experts]));
    call->experts.push_back({shared->gate_up, shared->down, shared->gate_up_record, shared->down_record, shared->inter, 1, 0, tokens});
    call->x_rows[1] = std::move(token_rows);  // the shared expert takes every token's row once
    call->act[1].resize(tokens * shared->inter);
  }

  const int64_t threads = at::get_num_threads();
  auto gate_up = std::make_shared<GateUp<T1, T2>>();
  gate_up->call = call;
  int64_t groups = 0;
  for (const Expert& e : call->experts) groups += e.inter / PANEL;
  const int64_t per_item = shared_items::range_size(groups, threads, 1, MAX_PANELS_PER_ITEM / 2);
  for (int64_t i = 0; i < static_cast<int64_t>(call->experts.size()); ++i) {
    const Expert& e = call->experts[i];
    for (int64_t q = 0; q < e.inter / PANEL; q += per_item) gate_up->items.push_back({i, q, std::min(e.inter / PANEL, q + per_item)});
    gate_up->scratch = std::max(gate_up->scratch, per_item * e.count * PANEL);
  }
  run_items(gate_up, static_cast<int64_t>(gate_up->items.size()), on_pool);

  call->act_rows[0] = round_rows<T2>(call->act[0].data(), pairs, routed.inter, on_caller);
  if (shared) call->act_rows[1] = round_rows<T2>(call->act[1].data(), tokens, shared->inter, on_caller);

  auto down = std::make_shared<Down<T1, T2>>();
  down->call = call;
  down->panel_count = (hidden + PANEL - 1) / PANEL;
  down->per_item = shared_items::range_size(down->panel_count, threads, 1, MAX_PANELS_PER_ITEM);
  down->scratch = down->per_item * tokens * PANEL;
  run_items(down, (down->panel_count + down->per_item - 1) / down->per_item, on_pool);
}

bool nibbles(int64_t record) { return record != Q8_0Panels::RECORD; }

int64_t routed_experts(const torch::Tensor& router_logits, int64_t num_experts) {
  TORCH_CHECK(router_logits.dim() == 2 && router_logits.scalar_type() == torch::kFloat32, "router_logits must be [tokens, experts] float32, got ",
              router_logits.sizes());
  const int64_t experts = num_experts < 0 ? router_logits.size(1) : num_experts;
  TORCH_CHECK(experts >= 1 && experts <= router_logits.size(1), "num_experts must be in 1..", router_logits.size(1), ", got ", num_experts);
  return experts;
}

}  // namespace

torch::Tensor router_logits(const torch::Tensor& x_in, const torch::Tensor& weight_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32 && x_in.device().is_cpu(), "x must be [tokens, hidden] float32 on the CPU, got ", x_in.sizes());
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == torch::kFloat32 && weight_in.size(1) == x_in.size(1),
              "the router's weight must be [experts, hidden] float32 with hidden = ", x_in.size(1), ", got ", weight_in.sizes());
  const auto x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t tokens = x.size(0), experts = weight.size(0), hidden = x.size(1);
  auto out = torch::empty({tokens, experts}, x.options());
  const float *x_ptr = x.data_ptr<float>(), *w_ptr = weight.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  if (takeover_pool::runs_on_pool(tokens) && experts > RouterJob::EXPERTS_PER_ITEM) {
    auto job = std::make_shared<RouterJob>();
    job->x = x, job->w = weight, job->out = out, job->tokens = tokens, job->hidden = hidden, job->experts = experts;
    takeover_pool::run(job, (experts + RouterJob::EXPERTS_PER_ITEM - 1) / RouterJob::EXPERTS_PER_ITEM);
    return out;
  }
  // A step's few rows off the pool stay on the calling thread: a step on the takeover pool wakes no OpenMP region.
  const int64_t grain = takeover_pool::keeps_to_caller(tokens) ? std::max<int64_t>(tokens, 1) : 8;
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    router_rows(x_ptr + begin * hidden, w_ptr, end - begin, hidden, 0, experts, o_ptr + begin * experts, experts);
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> route_experts(const torch::Tensor& router_logits, int64_t top_k, bool renormalize, int64_t num_experts) {
  const int64_t experts = routed_experts(router_logits, num_experts), tokens = router_logits.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "top_k must be in 1..", experts, ", got ", top_k);
  const auto logits = router_logits.contiguous();
  std::vector<int64_t> ids;
  std::vector<float> weights;
  route(logits.data_ptr<float>(), tokens, logits.size(1), experts, top_k, renormalize, ids, weights);
  auto out_weights = torch::empty({tokens, top_k}, torch::kFloat32);
  auto out_ids = torch::empty({tokens, top_k}, torch::kInt32);
  std::copy(weights.begin(), weights.end(), out_weights.data_ptr<float>());
  std::copy(ids.begin(), ids.end(), out_ids.data_ptr<int32_t>());
  return {out_weights, out_ids};
}

torch::Tensor grouped_moe(const torch::Tensor& x, const torch::Tensor& router_logits, int64_t top_k, bool renormalize, const torch::Tensor& gate_up,
                          const torch::Tensor& down, const std::optional<torch::Tensor>& shared_gate_up, const std::optional<torch::Tensor>& shared_down,
                          const std::optional<torch::Tensor>& residual, int64_t activation_bits, const std::optional<torch::Tensor>& topk_weights,
                          const std::optional<torch::Tensor>& topk_ids, const std::optional<torch::Tensor>& expert_slots) {
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16, "activation_bits must be 8 or 16, got ", activation_bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [tokens, hidden] float32");
  TORCH_CHECK(!expert_slots.has_value() || (expert_slots->dim() == 1 && expert_slots->scalar_type() == torch::kInt32 && expert_slots->is_contiguous()),
              "expert_slots must be contiguous int32 [experts]");
  const int64_t tokens = x.size(0), hidden = x.size(1), bank = gate_up.size(0), experts = expert_slots ? expert_slots->size(0) : bank;
  TORCH_CHECK(hidden % BLOCK == 0, "hidden must be a multiple of ", BLOCK, ", got ", hidden);
  TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value(), "a shared expert needs both its gate_up and its down panels");
  const bool has_shared = shared_gate_up.has_value();
  TORCH_CHECK(router_logits.dim() == 2 && router_logits.scalar_type() == torch::kFloat32 && router_logits.size(0) == tokens &&
                  router_logits.size(1) == experts + (has_shared ? 1 : 0),
              "router_logits must be [tokens, experts", has_shared ? " + 1 (the shared expert's gate)" : "", "] float32, got ", router_logits.sizes());
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "top_k must be in 1..", experts, ", got ", top_k);
  TORCH_CHECK(topk_weights.has_value() == topk_ids.has_value(), "a precomputed routing needs both topk_weights and topk_ids");
  if (topk_ids) {
    TORCH_CHECK(topk_ids->sizes() == torch::IntArrayRef({tokens, top_k}) && topk_ids->scalar_type() == torch::kInt32 && topk_ids->is_contiguous() &&
                    topk_weights->sizes() == topk_ids->sizes() && topk_weights->scalar_type() == torch::kFloat32 && topk_weights->is_contiguous(),
                "topk_weights / topk_ids must be contiguous [tokens, top_k] float32 / int32 (route_experts'), got ", topk_weights->sizes(), " / ",
                topk_ids->sizes());
    if (tokens > 0) {
      const auto [low, high] = std::minmax_element(topk_ids->data_ptr<int32_t>(), topk_ids->data_ptr<int32_t>() + tokens * top_k);
      TORCH_CHECK(*low >= 0 && *high < experts, "topk_ids must be in 0..", experts - 1, ", got ", *low, "..", *high);
    }
  }
  const Weights routed = check_weights(gate_up, down, hidden, bank, "experts'");
  std::optional<Weights> shared;
  if (has_shared) {
    TORCH_CHECK(shared_gate_up->dim() == 3 && shared_down->dim() == 3, "the shared expert's panels must be [panels, blocks, record]");
    shared = check_weights(shared_gate_up->unsqueeze(0), shared_down->unsqueeze(0), hidden, 1, "the shared expert's");
  }
  torch::Tensor out;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == torch::kFloat32 && residual->is_contiguous(),
                "residual must be contiguous [tokens, hidden] float32, as x");
    out = *residual;  // the weighted sum lands in it
  } else {
    out = torch::zeros_like(x);
  }
  if (tokens == 0) return out;
  const auto xc = x.contiguous(), logits = router_logits.contiguous();
  const bool int8_first = activation_bits == 8 && nibbles(routed.gate_up_record) && (!shared || nibbles(shared->gate_up_record));
  const bool int8_second = activation_bits == 8 && nibbles(routed.down_record) && (!shared || nibbles(shared->down_record));
  const float *x_ptr = xc.data_ptr<float>(), *l_ptr = logits.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const Routing given{topk_ids ? topk_ids->data_ptr<int32_t>() : nullptr, topk_weights ? topk_weights->data_ptr<float>() : nullptr};
  const Rows rows{expert_slots ? expert_slots->data_ptr<int32_t>() : nullptr, bank};
  auto run_as = [&](auto first, auto second) {
    run_layer<decltype(first), decltype(second)>(x_ptr, l_ptr, tokens, hidden, experts, top_k, renormalize, routed, shared, given, rows, o_ptr);
  };
  if (int8_first)
    int8_second ? run_as(int8_t{}, int8_t{}) : run_as(int8_t{}, int16_t{});
  else
    int8_second ? run_as(int16_t{}, int8_t{}) : run_as(int16_t{}, int16_t{});
  return out;
}
