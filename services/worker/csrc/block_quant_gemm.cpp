// block_quant_gemm: x @ dequantized(panels).T for one weight in q4_0, q4_1 or q8_0 panels (block_panels.h
// holds the formats and the register tiles). Few-row calls run on the takeover pool, the others on
// OpenMP's threads; either way threads share the panels in groups, and each panel meets a chunk of rows
// while its weights are in L1.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "block_panels.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using namespace block_panels;

// A few rows' product as a takeover_pool job: an item is a range of panels, computed into scratch
// [panel, row, channel] and committed into the output. The job owns the rounded activations (a helper
// that was taken over still reads them after the call has returned).
static_assert(takeover_pool::MAX_ROWS <= ROW_CHUNK, "a few-row job's rows meet a panel together");

template <typename F, typename T>
struct FewRowsJob : takeover_pool::Job {
  QuantizedRows<T> a;
  const uint8_t* w;
  int64_t rows, out_features, blocks, panels_per_item, panel_count;
  const float *bias, *residual;              // or nullptr
  torch::Tensor bias_owner, residual_owner;  // theirs: alive while a helper that was taken over still reads them
  float* out;

  int64_t scratch_floats() const override { return panels_per_item * rows * PANEL; }
  void compute(int64_t item, float* scratch) const override {
    const int64_t begin = item * panels_per_item, end = std::min(panel_count, begin + panels_per_item);
    float sums[2 * MAX_ROW_TILE * PANEL];
    for (int64_t p = begin, span; p < end; p += span) {
      span = tile_span(p, end, rows);
      for (int64_t m0 = 0; m0 < rows; m0 += row_tile()) {
        const int64_t tile_rows = std::min(row_tile(), rows - m0);
        run_tile<F>(w + p * blocks * F::RECORD, blocks * F::RECORD, span, a, m0, tile_rows, m0 == 0 ? Prefetch::WEIGHTS : Prefetch::NONE, sums);
        for (int64_t q = 0; q < span; ++q) {
          const int64_t n0 = (p + q) * PANEL, cols = std::min(PANEL, out_features - n0);
          float* to = scratch + (p + q - begin) * rows * PANEL;
          const float* tile = sums + q * MAX_ROW_TILE * PANEL;
          for (int64_t r = 0; r < tile_rows; ++r)
            for (int64_t c = 0; c < cols; ++c)
              to[(m0 + r) * PANEL + c] = tile[r * PANEL + c] + (bias ? bias[n0 + c] : 0.f) + (residual ? residual[(m0 + r) * out_features + n0 + c] : 0.f);
        }
      }
    }
  }
  void commit(int64_t item, const float* scratch) const override {
    const int64_t begin = item * panels_per_item, end = std::min(panel_count, begin + panels_per_item);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * PANEL, cols = std::min(PANEL, out_features - n0);
      const float* from = scratch + (p - begin) * rows * PANEL;
      if (cols == PANEL) {  // a whole panel: a copy of constant size, inlined (a library call per row costs more than the copy)
        for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * out_features + n0, from + r * PANEL, PANEL * sizeof(float));
      } else {
        for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * out_features + n0, from + r * PANEL, cols * sizeof(float));
      }
    }
  }
};

// x rounded to the codes of Rounded (int8 or int16 per block) and held as T's: as they are, int8 codes widened to
// int16, or OffsetCodes.
template <typename T, typename Rounded>
QuantizedRows<T> rounded_rows(const float* x, int64_t rows, int64_t k) {
  QuantizedRows<Rounded> a = quantize_rows<Rounded>(x, rows, k);
  if constexpr (std::is_same_v<T, Rounded>)
    return a;
  else if constexpr (std::is_same_v<T, uint8_t>)
    return offset_codes(std::move(a));
  else
    return activation_quant::widened(std::move(a));
}

template <typename F, typename T, typename Rounded>
void run(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t out_features, const float* bias, const float* residual, float* out,
         const torch::Tensor& bias_owner, const torch::Tensor& residual_owner) {
  if (takeover_pool::runs_on_pool(rows)) {
    auto job = std::make_shared<FewRowsJob<F, T>>();
    job->a = rounded_rows<T, Rounded>(x, rows, k);
    job->w = w;
    job->rows = rows;
    job->out_features = out_features;
    job->blocks = k / BLOCK;
    job->panel_count = (out_features + PANEL - 1) / PANEL;
    job->panels_per_item = shared_items::range_size(job->panel_count, at::get_num_threads(), 1, MAX_PANELS_PER_RANGE);
    job->bias = bias;
    job->residual = residual;
    job->bias_owner = bias_owner;
    job->residual_owner = residual_owner;
    job->out = out;
    takeover_pool::run(job, (job->panel_count + job->panels_per_item - 1) / job->panels_per_item);
    return;
  }
  const QuantizedRows<T> a = rounded_rows<T, Rounded>(x, rows, k);
  const int64_t blocks = k / BLOCK, panel_count = (out_features + PANEL - 1) / PANEL;
  auto panels_times_rows = [&](int64_t begin, int64_t end) {
    float sums[2 * MAX_ROW_TILE * PANEL];
    for (int64_t chunk = 0; chunk < rows; chunk += ROW_CHUNK)
      for (int64_t p = begin, span; p < end; p += span) {
        span = tile_span(p, end, rows);
        for (int64_t m0 = chunk; m0 < std::min(rows, chunk + ROW_CHUNK); m0 += row_tile()) {
          const int64_t tile_rows = std::min(row_tile(), rows - m0);
          run_tile<F>(w + p * blocks * F::RECORD, blocks * F::RECORD, span, a, m0, tile_rows, m0 == 0 ? Prefetch::WEIGHTS : Prefetch::NONE, sums);
          for (int64_t q = 0; q < span; ++q) {
            const int64_t n0 = (p + q) * PANEL, cols = std::min(PANEL, out_features - n0);
            const float* tile = sums + q * MAX_ROW_TILE * PANEL;
            for (int64_t r = 0; r < tile_rows; ++r)
              for (int64_t c = 0; c < cols; ++c) {
                const int64_t at = (m0 + r) * out_features + n0 + c;
                out[at] = tile[r * PANEL + c] + (bias ? bias[n0 + c] : 0.f) + (residual ? residual[at] : 0.f);
              }
          }
        }
      }
  };
  share_ranges(panel_count, 1, MAX_PANELS_PER_RANGE, panels_times_rows);
}

// The optional bias [out] and residual [rows, out] added to a product, checked and made contiguous.
struct LinearEpilogue {
  std::optional<torch::Tensor> bias, residual;  // contiguous copies (or the tensors themselves)

  LinearEpilogue(const std::optional<torch::Tensor>& b, const std::optional<torch::Tensor>& r, int64_t rows, int64_t out_features) {
    if (b.has_value()) {
      TORCH_CHECK(b->dim() == 1 && b->size(0) == out_features && b->scalar_type() == torch::kFloat32, "one float32 bias per output channel");
      bias = b->contiguous();
    }
    if (r.has_value()) {
      TORCH_CHECK(r->dim() == 2 && r->size(0) == rows && r->size(1) == out_features && r->scalar_type() == torch::kFloat32,
                  "residual must be [rows, out] float32");
      residual = r->contiguous();
    }
  }
  const float* bias_ptr() const { return bias.has_value() ? bias->data_ptr<float>() : nullptr; }
  const float* residual_ptr() const { return residual.has_value() ? residual->data_ptr<float>() : nullptr; }
};

}  // namespace

torch::Tensor block_quant_gemm(const torch::Tensor& x, const torch::Tensor& panels, int64_t out_features, const std::optional<torch::Tensor>& bias,
                               const std::optional<torch::Tensor>& residual, int64_t activation_bits) {
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16, "activation_bits must be 8 or 16, got ", activation_bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [rows, in] float32");
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / BLOCK, panel_count = (out_features + PANEL - 1) / PANEL;
  TORCH_CHECK(k % BLOCK == 0, "in_features must be a multiple of ", BLOCK, ", got ", k);
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == torch::kUInt8 && panels.is_contiguous(), "panels must be contiguous [panels, blocks, record] uint8 (",
              RECORD_SIZES, ")");
  const int64_t record = panels.size(2);
  TORCH_CHECK(record == Q4_0Panels::RECORD || record == Q4_1Panels::RECORD || record == Q8_0Panels::RECORD, "a panel record is ", RECORD_SIZES, ", got ", record);
  TORCH_CHECK(panels.size(0) == panel_count && panels.size(1) == blocks, "panels of ", out_features, " x ", k, " weights must be [", panel_count, ", ",
              blocks, ", ", record, "], got ", panels.sizes());
  const LinearEpilogue epilogue(bias, residual, rows, out_features);
  auto out = torch::empty({rows, out_features}, x.options());
  const auto xc = x.contiguous();
  const float *x_ptr = xc.data_ptr<float>(), *b_ptr = epilogue.bias_ptr(), *r_ptr = epilogue.residual_ptr();
  const uint8_t* w_ptr = panels.data_ptr<uint8_t>();
  float* o_ptr = out.data_ptr<float>();
  const torch::Tensor bias_owner = epilogue.bias.value_or(torch::Tensor()), residual_owner = epilogue.residual.value_or(torch::Tensor());
  auto run_as = [&](auto format, auto held, auto rounded) {
    run<decltype(format), decltype(held), decltype(rounded)>(x_ptr, rows, k, w_ptr, out_features, b_ptr, r_ptr, o_ptr, bias_owner, residual_owner);
  };
  if (record == Q8_0Panels::RECORD) {
    if (activation_bits == 16)
      run_as(Q8_0Panels{}, int16_t{}, int16_t{});
    else
      offset_codes_on() ? run_as(Q8_0Panels{}, uint8_t{}, int8_t{}) : run_as(Q8_0Panels{}, int16_t{}, int8_t{});
  } else if (record == Q4_1Panels::RECORD) {
    activation_bits == 8 ? run_as(Q4_1Panels{}, int8_t{}, int8_t{}) : run_as(Q4_1Panels{}, int16_t{}, int16_t{});
  } else {
    activation_bits == 8 ? run_as(Q4_0Panels{}, int8_t{}, int8_t{}) : run_as(Q4_0Panels{}, int16_t{}, int16_t{});
  }
  return out;
}

std::string block_quant_gemm_isa() {
#if defined(TOKENYARD_BLOCK_QUANT_GEMM_VNNI)
  if (vnni_enabled()) return "avx512-vnni";
#endif
#if defined(TOKENYARD_BLOCK_QUANT_GEMM_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

#ifdef TOKENYARD_BLOCK_QUANT_GEMM_VNNI
namespace {
// Seconds for `rounds` x 12 independent vpdpwssd on vectors of V (12 chains: more than the latency x the
// ports, so the time is the throughput).
template <typename V, typename Dot>
double dot_seconds(V start, V x, int64_t rounds, Dot dot) {
  V s[12];
  for (auto& v : s) v = start;
  const auto began = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < rounds; ++n) {
    for (auto& v : s) v = dot(v, x);
    __asm__("" : "+v"(x));  // each round's input unknown to the compiler: no folding
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  for (auto& v : s) __asm__("" : : "v"(v));
  return seconds;
}
}  // namespace
#endif

double block_quant_wide_product_rate() {
#ifdef TOKENYARD_BLOCK_QUANT_GEMM_VNNI
  if (!vnni_enabled()) return 0.0;
  constexpr int64_t ROUNDS = 20000;  // ~0.1-0.3 ms a measurement
  double narrow = 1e30, wide = 1e30;
  for (int i = 0; i < 5; ++i) {  // the best of five: another thread's interruption only slows one
    narrow = std::min(narrow, dot_seconds(_mm256_set1_epi16(1), _mm256_set1_epi16(3), ROUNDS, [](__m256i a, __m256i x) { return _mm256_dpwssd_epi32(a, x, x); }));
    wide = std::min(wide, dot_seconds(_mm512_set1_epi16(1), _mm512_set1_epi16(3), ROUNDS, [](__m512i a, __m512i x) { return _mm512_dpwssd_epi32(a, x, x); }));
  }
  return 2.0 * narrow / wide;  // a 512-bit instruction does twice the products
#else
  return 0.0;
#endif
}

void set_block_quant_pair_min_rows(int64_t rows) { pair_min_rows.store(std::max<int64_t>(rows, 0)); }

int64_t block_quant_pair_min_rows() { return pair_min_rows.load(); }

void set_weight_prefetch_keep(bool keep) { weight_prefetch_keep_on.store(keep); }

bool weight_prefetch_keep() { return weight_prefetch_keep_on.load(); }
