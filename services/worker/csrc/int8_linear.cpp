// int8 linear on the CPU: weights int8 with one scale per output channel (services/worker/linear.py's
// codec), activations quantized on the fly to int8 with one scale per block of 32 features (the
// granularity of llama.cpp's Q8_0, fine enough that an outlier feature costs only its own block).
//
//   out[m, n] = wscale[n] * sum_blocks xscale[m, blk] * sum_{i in blk} xq[m, i] * wq[n, i]  (+ bias[n])
//
// The inner 32-element products are exact in int32 (AVX2 maddubs/madd: |w| as unsigned bytes times x
// carrying w's sign; 2 * 127 * 127 fits int16), the block sums accumulate in fp32. Threads share
// the output channels in groups of tiles (shared_items.h); each tile meets every row while it is in L1.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "activation_quant.h"
#include "avx2_sum.h"
#include "shared_items.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = activation_quant::BLOCK;  // activation features per scale
constexpr int64_t TILE = 4;    // output channels per tile
constexpr int64_t PREFETCH_TILES = 4;
constexpr int64_t MIN_TILES_PER_RANGE = 8;  // tiles a thread takes at a time, at least (shared_items.h share_ranges)

// The same arithmetic in plain loops: tiles the vector kernels do not take, and CPUs without AVX2.
void tile_generic(const int8_t* xq, const float* xscale, const int8_t* w, int64_t rows, int64_t cols, int64_t k, float* sums) {
  const int64_t blocks = k / BLOCK;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = 0; n < cols; ++n) {
      float s = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t dot = 0;
        for (int64_t i = 0; i < BLOCK; ++i) dot += int32_t(xq[m * k + b * BLOCK + i]) * int32_t(w[n * k + b * BLOCK + i]);
        s += xscale[m * blocks + b] * static_cast<float>(dot);
      }
      sums[m * TILE + n] = s;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// R rows x C channels (starting at w) into sums[m * TILE + c].
template <int R, int C>
void tile(const int8_t* xq, const float* xscale, const int8_t* w, int64_t k, float* sums) {
  const int64_t blocks = k / BLOCK;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][C];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i wv[C], wabs[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * k + b * BLOCK));
      wabs[c] = _mm256_sign_epi8(wv[c], wv[c]);
    }
    for (int m = 0; m < R; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k + b * BLOCK));
      const __m256 scale = _mm256_set1_ps(xscale[m * blocks + b]);
      for (int c = 0; c < C; ++c) {
        const __m256i products = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[c], _mm256_sign_epi8(xv, wv[c])), ones);
        acc[m][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), scale, acc[m][c]);
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < C; ++c) sums[m * TILE + c] = hsum(acc[m][c]);
}
#endif

void run_tile(const int8_t* xq, const float* xscale, const int8_t* w, int64_t rows, int64_t cols, int64_t k, float* sums) {
#if defined(__AVX2__) && defined(__FMA__)
  if (cols == TILE) {
    const int64_t blocks = k / BLOCK;
    switch (rows) {  // register budget: R * C accumulators + 2 C weight registers + a row <= 16
      case 1: return tile<1, 4>(xq, xscale, w, k, sums);
      case 2: tile<2, 2>(xq, xscale, w, k, sums); return tile<2, 2>(xq, xscale, w + 2 * k, k, sums + 2);
      case 3: tile<3, 2>(xq, xscale, w, k, sums); return tile<3, 2>(xq, xscale, w + 2 * k, k, sums + 2);
      case 4: tile<4, 2>(xq, xscale, w, k, sums); return tile<4, 2>(xq, xscale, w + 2 * k, k, sums + 2);
      default: (void)blocks; break;
    }
  }
#endif
  tile_generic(xq, xscale, w, rows, cols, k, sums);
}

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales, const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [rows, in] float32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kInt8 && weight.is_contiguous(), "weight must be contiguous [out, in] int8");
  TORCH_CHECK(weight.size(1) == x.size(1), "x has ", x.size(1), " features, the weight ", weight.size(1));
  TORCH_CHECK(x.size(1) % BLOCK == 0, "in_features must be a multiple of ", BLOCK, ", got ", x.size(1));
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == weight.size(0) && scales.scalar_type() == torch::kFloat32, "one float32 scale per output channel");
  const int64_t rows = x.size(0), k = x.size(1), out_features = weight.size(0), blocks = k / BLOCK;
  const auto xc = x.contiguous();
  const auto sc = scales.contiguous();
  std::optional<torch::Tensor> bc;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == torch::kFloat32, "one float32 bias per output channel");
    bc = bias->contiguous();
  }
  const auto a = activation_quant::quantize_rows<int8_t>(xc.data_ptr<float>(), rows, k);
  const auto& xq = a.q;
  const auto& xscale = a.d;
  auto out = torch::empty({rows, out_features}, x.options());
  const int8_t* w_ptr = weight.data_ptr<int8_t>();
  const float* s_ptr = sc.data_ptr<float>();
  const float* b_ptr = bc.has_value() ? bc->data_ptr<float>() : nullptr;
  float* o_ptr = out.data_ptr<float>();
  constexpr int64_t MR = 4;
  const int64_t tile_count = (out_features + TILE - 1) / TILE;
  auto tiles_times_rows = [&](int64_t begin, int64_t end) {
    float sums[MR * TILE];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE, cols = std::min(TILE, out_features - n0);
#if defined(__AVX2__) && defined(__FMA__)
      // A few rows of a step are too little work per tile for the hardware prefetcher to stay ahead
      // of: ask for the tile PREFETCH_TILES ahead while this one computes (a thread walks its share forward).
      if (t + PREFETCH_TILES < tile_count) {
        const int8_t* ahead = w_ptr + (n0 + PREFETCH_TILES * TILE) * k;
        for (int64_t byte = 0; byte < TILE * k; byte += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + byte), _MM_HINT_T0);
      }
#endif
      for (int64_t m0 = 0; m0 < rows; m0 += MR) {
        const int64_t r = std::min(MR, rows - m0);
        run_tile(xq.data() + m0 * k, xscale.data() + m0 * blocks, w_ptr + n0 * k, r, cols, k, sums);
        for (int64_t m = 0; m < r; ++m)
          for (int64_t n = 0; n < cols; ++n)
            o_ptr[(m0 + m) * out_features + n0 + n] = sums[m * TILE + n] * s_ptr[n0 + n] + (b_ptr ? b_ptr[n0 + n] : 0.f);
      }
    }
  };
  share_ranges(tile_count, MIN_TILES_PER_RANGE, tiles_times_rows);
  return out;
}
