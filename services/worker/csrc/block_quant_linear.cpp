// Linear over block-quantized weights on the CPU (services/worker/block_quant.py's layouts).
//
// Weights [out, in] in blocks of 32 input features with fp16 scales, one row after another:
//   q4_1 row: in/2 bytes of 4-bit codes (block b's byte j: feature 32b+j low, 32b+j+16 high), then
//             in/32 fp16 scales d, then in/32 fp16 minimums m;  w = d * q + m, q in 0..15
//   q8_0 row: in signed bytes, then in/32 fp16 scales d;          w = d * q
// Activations are quantized on the fly to int16 with one scale per row and block (error 2^-16 of the
// block's largest value: far below the weights' own fp16 scales), so each 32-feature product is exact
// in int32 (AVX2 madd: 16 products per instruction, no VNNI needed) and only the block sums are
// float. The q4_1 minimum enters as m * sum(x over the block), summed in fp32 from the unrounded x.
//
//   out[m, n] = sum_b dw[n, b] * dx[m, b] * <qw[n, b], qx[m, b]> (+ mw[n, b] * sx[m, b])  (+ bias) (+ residual)
//
// Threads split the output channels; each tile of channels meets every row while its weights are in L1.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "linear_epilogue.h"

#include "avx2_sum.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENYARD_BLOCK_QUANT_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;  // input features per weight block and per activation scale
constexpr float INT16_MAX_CODE = 32767.f;
constexpr int64_t PREFETCH_CHANNELS = 8;

float half_to_float(uint16_t h) {
#ifdef TOKENYARD_BLOCK_QUANT_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// The quantized activations: x ~= qx * dx per (row, block); sx = sum of x over the block.
struct Activations {
  std::vector<int16_t> qx;
  std::vector<float> dx, sx;
  int64_t blocks;
};

Activations quantize_rows(const float* x, int64_t rows, int64_t k) {
  Activations a{std::vector<int16_t>(rows * k), std::vector<float>(rows * (k / BLOCK)), std::vector<float>(rows * (k / BLOCK)), k / BLOCK};
  at::parallel_for(0, rows * a.blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* src = x + b * BLOCK;
      float amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < BLOCK; ++i) {
        amax = std::max(amax, std::fabs(src[i]));
        sum += src[i];
      }
      const float inv = amax > 0.f ? INT16_MAX_CODE / amax : 0.f;
      a.dx[b] = amax / INT16_MAX_CODE;
      a.sx[b] = sum;
      for (int64_t i = 0; i < BLOCK; ++i) a.qx[b * BLOCK + i] = static_cast<int16_t>(std::nearbyint(src[i] * inv));
    }
  });
  return a;
}

struct Q4_1 {
  static constexpr int64_t BYTES = 20;  // per block
  static constexpr bool HAS_MIN = true;
  static const uint16_t* scales(const uint8_t* row, int64_t k) { return reinterpret_cast<const uint16_t*>(row + k / 2); }
  static const uint16_t* mins(const uint8_t* row, int64_t k) { return reinterpret_cast<const uint16_t*>(row + k / 2 + k / 16); }
  static int code(const uint8_t* row, int64_t b, int j) {
    const uint8_t byte = row[b * 16 + (j & 15)];
    return j < 16 ? (byte & 0x0f) : (byte >> 4);
  }
#ifdef TOKENYARD_BLOCK_QUANT_AVX2
  static void load(const uint8_t* row, int64_t b, __m256i& low, __m256i& high) {  // features 0..15, 16..31 as int16
    // Widen the 16 bytes first: each 16-bit lane then holds one byte, its nibbles are one and, one shift.
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16)));
    low = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0f));
    high = _mm256_srli_epi16(bytes, 4);
  }
#endif
};

struct Q8_0 {
  static constexpr int64_t BYTES = 34;
  static constexpr bool HAS_MIN = false;
  static const uint16_t* scales(const uint8_t* row, int64_t k) { return reinterpret_cast<const uint16_t*>(row + k); }
  static const uint16_t* mins(const uint8_t*, int64_t) { return nullptr; }
  static int code(const uint8_t* row, int64_t b, int j) { return static_cast<int8_t>(row[b * 32 + j]); }
#ifdef TOKENYARD_BLOCK_QUANT_AVX2
  static void load(const uint8_t* row, int64_t b, __m256i& low, __m256i& high) {
    low = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 32)));
    high = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 32 + 16)));
  }
#endif
};

// The same arithmetic in plain loops: the reference for the vector tiles, and CPUs without AVX2.
template <typename F>
float dot_generic(const Activations& a, int64_t m, const uint8_t* row, int64_t k) {
  const uint16_t* d = F::scales(row, k);
  const uint16_t* mn = F::mins(row, k);
  float total = 0.f;
  for (int64_t b = 0; b < a.blocks; ++b) {
    int32_t dot = 0;
    for (int j = 0; j < BLOCK; ++j) dot += F::code(row, b, j) * int32_t(a.qx[m * k + b * BLOCK + j]);
    total += half_to_float(d[b]) * a.dx[m * a.blocks + b] * static_cast<float>(dot);
    if (F::HAS_MIN) total += half_to_float(mn[b]) * a.sx[m * a.blocks + b];
  }
  return total;
}

#ifdef TOKENYARD_BLOCK_QUANT_AVX2
// sum over blocks of mw[b] * sx[b], eight blocks at a time.
float min_term(const uint16_t* mins, const float* sx, int64_t blocks) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8)
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b))), _mm256_loadu_ps(sx + b), acc);
  float total = hsum(acc);
  for (; b < blocks; ++b) total += _cvtsh_ss(mins[b]) * sx[b];
  return total;
}

// R rows x C channels (weight rows w[0..C), row stride row_bytes) into sums[m * ld + c].
template <typename F, int R, int C>
void tile(const Activations& a, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t k, float* sums, int64_t ld) {
  const int64_t blocks = a.blocks;
  __m256 acc[R][C];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i low[C], high[C];
    __m256 dw[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* row = w + c * row_bytes;
      F::load(row, b, low[c], high[c]);
      dw[c] = _mm256_set1_ps(_cvtsh_ss(F::scales(row, k)[b]));
    }
    for (int m = 0; m < R; ++m) {
      const int16_t* xq = a.qx.data() + (m0 + m) * k + b * BLOCK;
      const __m256i x_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
      const __m256i x_high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16));
      const __m256 dx = _mm256_broadcast_ss(a.dx.data() + (m0 + m) * blocks + b);
      for (int c = 0; c < C; ++c) {
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(low[c], x_low), _mm256_madd_epi16(high[c], x_high));
        acc[m][c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), dx), dw[c], acc[m][c]);
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < C; ++c) {
      float total = hsum(acc[m][c]);
      if (F::HAS_MIN) total += min_term(F::mins(w + c * row_bytes, k), a.sx.data() + (m0 + m) * blocks, blocks);
      sums[m * ld + c] = total;
    }
}

// One row (a single-stream decode): C channels, each weight block widened, multiplied and dropped in
// turn, so C accumulators (not C weight blocks) stay in registers and C can be twice as wide.
template <typename F, int C>
void tile_one_row(const Activations& a, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t k, float* sums) {
  constexpr int64_t GROUP = 8;  // blocks whose scales are widened and multiplied together
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  const int16_t* xq = a.qx.data() + m0 * k;
  const float* dx = a.dx.data() + m0 * a.blocks;
  alignas(32) float scale[C][GROUP];  // dw * dx of each channel and block of the group
  for (int64_t g = 0; g < a.blocks; g += GROUP) {
    const int64_t n = std::min(GROUP, a.blocks - g);
    for (int c = 0; c < C; ++c) {
      const uint16_t* dw = F::scales(w + c * row_bytes, k) + g;
      if (n == GROUP) {
        _mm256_store_ps(scale[c], _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dw))), _mm256_loadu_ps(dx + g)));
      } else {
        for (int64_t j = 0; j < n; ++j) scale[c][j] = _cvtsh_ss(dw[j]) * dx[g + j];
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t b = g + j;
      const __m256i x_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * BLOCK));
      const __m256i x_high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * BLOCK + 16));
      for (int c = 0; c < C; ++c) {
        __m256i low, high;
        F::load(w + c * row_bytes, b, low, high);
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(low, x_low), _mm256_madd_epi16(high, x_high));
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&scale[c][j]), acc[c]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    float total = hsum(acc[c]);
    if (F::HAS_MIN) total += min_term(F::mins(w + c * row_bytes, k), a.sx.data() + m0 * a.blocks, a.blocks);
    sums[c] = total;
  }
}
#endif

constexpr int64_t TILE_CHANNELS = 8;  // channels per unit of work (the widest tile)
constexpr int64_t TILE_ROWS = 4;

// rows x cols (cols <= TILE_CHANNELS) into sums[m * cols + c]. One row: the 8-channel tile; more rows
// share each widened weight block in 2-channel tiles (R * 2 accumulators + 4 weight vectors + 2 scales
// + 2 activation vectors + a scale <= 16 registers).
template <typename F>
void run_tile(const Activations& a, int64_t m0, int64_t rows, const uint8_t* w, int64_t row_bytes, int64_t cols, int64_t k, float* sums) {
#ifdef TOKENYARD_BLOCK_QUANT_AVX2
  if (cols == TILE_CHANNELS) {
    if (rows == 1) return tile_one_row<F, TILE_CHANNELS>(a, m0, w, row_bytes, k, sums);
    for (int64_t c = 0; c < TILE_CHANNELS; c += 2) {
      const uint8_t* pair = w + c * row_bytes;
      switch (rows) {
        case 2: tile<F, 2, 2>(a, m0, pair, row_bytes, k, sums + c, cols); break;
        case 3: tile<F, 3, 2>(a, m0, pair, row_bytes, k, sums + c, cols); break;
        default: tile<F, 4, 2>(a, m0, pair, row_bytes, k, sums + c, cols); break;
      }
    }
    return;
  }
#endif
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < cols; ++c) sums[m * cols + c] = dot_generic<F>(a, m0 + m, w + c * row_bytes, k);
}

template <typename F>
void run(const float* x, int64_t rows, int64_t k, const uint8_t* weight, int64_t out_features, const float* bias, const float* residual, float* out) {
  const Activations a = quantize_rows(x, rows, k);
  const int64_t row_bytes = (k / BLOCK) * F::BYTES;
  const int64_t tiles = (out_features + TILE_CHANNELS - 1) / TILE_CHANNELS;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    float sums[TILE_ROWS * TILE_CHANNELS];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE_CHANNELS, cols = std::min(TILE_CHANNELS, out_features - n0);
      const uint8_t* w = weight + n0 * row_bytes;
#ifdef TOKENYARD_BLOCK_QUANT_AVX2
      // A few rows are too little work per tile for the hardware prefetcher to stay ahead of the weights.
      if (n0 + PREFETCH_CHANNELS + TILE_CHANNELS <= out_features) {
        const uint8_t* ahead = w + PREFETCH_CHANNELS * row_bytes;
        for (int64_t byte = 0; byte < TILE_CHANNELS * row_bytes; byte += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + byte), _MM_HINT_T0);
      }
#endif
      for (int64_t m0 = 0; m0 < rows; m0 += TILE_ROWS) {
        const int64_t r = std::min(TILE_ROWS, rows - m0);
        run_tile<F>(a, m0, r, w, row_bytes, cols, k, sums);
        for (int64_t m = 0; m < r; ++m)
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t at = (m0 + m) * out_features + n0 + c;
            out[at] = sums[m * cols + c] + (bias ? bias[n0 + c] : 0.f) + (residual ? residual[at] : 0.f);
          }
      }
    }
  });
}

int64_t block_bytes(const std::string& format) {
  if (format == "q4_1") return Q4_1::BYTES;
  if (format == "q8_0") return Q8_0::BYTES;
  TORCH_CHECK(false, "unknown block format ", format, " (supported: q4_1, q8_0)");
  return 0;
}

}  // namespace

torch::Tensor block_quant_linear(const torch::Tensor& x, const torch::Tensor& weight, const std::string& format, int64_t in_features,
                                 const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& residual) {
  const int64_t bytes = block_bytes(format);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [rows, in] float32");
  TORCH_CHECK(x.size(1) == in_features, "x has ", x.size(1), " features, the weight ", in_features);
  TORCH_CHECK(in_features % BLOCK == 0, "in_features must be a multiple of ", BLOCK, ", got ", in_features);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kUInt8 && weight.is_contiguous(), "weight must be contiguous [out, blocks * bytes] uint8");
  TORCH_CHECK(weight.size(1) == in_features / BLOCK * bytes, "a ", format, " weight row of ", in_features, " features is ", in_features / BLOCK * bytes,
              " bytes, got ", weight.size(1));
  const int64_t rows = x.size(0), out_features = weight.size(0);
  const auto xc = x.contiguous();
  const LinearEpilogue epilogue(bias, residual, rows, out_features);
  auto out = torch::empty({rows, out_features}, x.options());
  const float *b_ptr = epilogue.bias_ptr(), *r_ptr = epilogue.residual_ptr();
  const auto* w_ptr = weight.data_ptr<uint8_t>();
  if (format == "q4_1")
    run<Q4_1>(xc.data_ptr<float>(), rows, in_features, w_ptr, out_features, b_ptr, r_ptr, out.data_ptr<float>());
  else
    run<Q8_0>(xc.data_ptr<float>(), rows, in_features, w_ptr, out_features, b_ptr, r_ptr, out.data_ptr<float>());
  return out;
}
