// Greedy sampling's argmax over each row of fp32 logits, as torch.argmax(dim=-1) answers it (the
// first index of the largest value; a row holding NaN answers its first NaN), eight lanes at a time
// and rows split over the threads: torch's CPU reduction reads ~7 GB/s (0.85 ms for 32 rows of a
// 49152-token vocabulary), this ~5x faster (0.16 ms).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <limits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "takeover_pool.h"

namespace {

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (std::isnan(x[j])) return j;
  return -1;
}

int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float best_value = -std::numeric_limits<float>::infinity();
#if defined(__AVX2__)
  if (n >= 8) {
    // Per lane: the largest value met and the first position holding it (only a strictly larger value
    // replaces it, so ties keep the earlier position); a NaN anywhere sends the row to first_nan.
    __m256 values = _mm256_loadu_ps(x), nan_seen = _mm256_cmp_ps(values, values, _CMP_UNORD_Q);
    __m256i positions = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = positions;
    const __m256i step = _mm256_set1_epi32(8);
    for (i = 8; i + 8 <= n; i += 8) {
      at = _mm256_add_epi32(at, step);
      const __m256 v = _mm256_loadu_ps(x + i);
      nan_seen = _mm256_or_ps(nan_seen, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 larger = _mm256_cmp_ps(v, values, _CMP_GT_OQ);
      values = _mm256_blendv_ps(values, v, larger);
      positions = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(positions), _mm256_castsi256_ps(at), larger));
    }
    if (_mm256_movemask_ps(nan_seen) != 0) return first_nan(x, n);
    alignas(32) float lane_values[8];
    alignas(32) int32_t lane_positions[8];
    _mm256_store_ps(lane_values, values);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_positions), positions);
    best_value = lane_values[0], best = lane_positions[0];
    for (int l = 1; l < 8; ++l)
      if (lane_values[l] > best_value || (lane_values[l] == best_value && lane_positions[l] < best)) best_value = lane_values[l], best = lane_positions[l];
  }
#endif
  for (; i < n; ++i) {  // the tail (or the whole row): positions after every one already met
    if (std::isnan(x[i])) return i;
    if (x[i] > best_value) best_value = x[i], best = i;
  }
  return best;
}

// A few rows' argmax as a takeover_pool job (a step whose other kernels run on the pool must not wake
// OpenMP's threads, whose spinning would then compete with the pool's helpers): an item is a row, its
// index passed through scratch.
struct FewRowsArgmax : takeover_pool::Job {
  torch::Tensor logits_owner;
  const float* src;
  int64_t n;
  int64_t* dst;

  int64_t scratch_floats() const override { return sizeof(int64_t) / sizeof(float); }
  void compute(int64_t item, float* scratch) const override {
    const int64_t best = argmax_row(src + item * n, n);
    std::memcpy(scratch, &best, sizeof best);
  }
  void commit(int64_t item, const float* scratch) const override { std::memcpy(dst + item, scratch, sizeof(int64_t)); }
};

}  // namespace

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.size(1) >= 1, "logits must be [rows, vocab] float32");
  TORCH_CHECK(logits.size(1) <= std::numeric_limits<int32_t>::max(), "a vocabulary of at most 2^31 - 1 entries");
  const auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  const float* src = x.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  if (rows <= takeover_pool::MAX_ROWS && takeover_pool::enabled().load(std::memory_order_relaxed) && at::get_num_threads() > 1) {
    auto job = std::make_shared<FewRowsArgmax>();
    job->logits_owner = x;
    job->src = src;
    job->n = n;
    job->dst = dst;
    takeover_pool::run(job, rows);
    return out;
  }
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(src + r * n, n);
  });
  return out;
}
