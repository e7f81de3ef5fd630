// The register tiles of products over block-quantized weights in panels (block_quant_gemm.cpp, one weight;
// grouped_moe.cpp, a layer's experts): activations rounded per block of 32 features to int16 (accurate:
// error ~2e-5 of the block's largest value) or to int8 (the arithmetic of llama.cpp's q4 / q8_0 x q8 dot
// products, twice as fast in many-row steps), multiplied in integers.
//
// Weights in panels of 8 output channels (services/worker/block_quant.py ``to_panels``), one record per
// panel and block of 32 input features, whose format the record's size tells:
//   q4_0, 144 bytes: q4_1's codes and scales, no minimums (w = d * (q - 8): the minimum is -8 d)
//   q4_1, 160 bytes: bytes 32j .. 32j+31 (j = 0..3): byte 4c+i of channel c's features 4j+i (low nibble)
//                    and 16+4j+i (high); bytes 128 .. 143: the 8 channels' fp16 scales d; 144 .. 159: their
//                    fp16 minimums m
//   q8_0, 272 bytes: bytes 32j .. 32j+31 (j = 0..7): bytes 4c .. 4c+3 channel c's signed codes of features
//                    4j, 4j+2, 4j+1, 4j+3; bytes 256 .. 271: the fp16 scales d
// so one 32-byte load gives 4 features of all 8 channels, and a panel is one sequential stream (which the
// memory system feeds faster than rows read side by side: the panels serve steps of one row too).
//
// Activations: x ~= qx * dx per (row, block); sx = the block's sum of the unrounded x.
//   out[m, n] = sum_b d[n, b] * dx[m, b] * <q[n, b], qx[m, b]> (+ m[n, b] * sx[m, b])  (+ bias) (+ residual)
// Each output lane is a channel, so no horizontal sums: a tile of rows keeps one accumulator per row.
// The integer products use AVX2 (maddubs / madd), or AVX-512 VNNI where the build has it (cpu_kernels.py
// adds its flags on a CPU that lists it): 1.3-1.5x the many-row speed, and calls of enough rows (pair_min_rows)
// take two panels per 512-bit tile, another 1.1-1.2x; the same bits throughout.
// Threads share the panels in groups (shared_items.h); each panel meets a chunk of rows while its
// weights are in L1.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "activation_quant.h"
#include "shared_items.h"
#include "takeover_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENYARD_BLOCK_QUANT_GEMM_AVX2 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TOKENYARD_BLOCK_QUANT_GEMM_VNNI 1
#endif
#endif

namespace block_panels {

using activation_quant::QuantizedRows;
using activation_quant::quantize_rows;

constexpr int64_t BLOCK = activation_quant::BLOCK;  // input features per block (and per activation scale)
constexpr int64_t PANEL = 8;                         // output channels per panel
constexpr int64_t ROW_TILE = 4;                      // rows per register tile: 4 block sums + 4 accumulators + weights fit 16 registers
constexpr int64_t VNNI_ROW_TILE = 8;                 // AVX-512's 32 registers: 8 block sums + 8 accumulators + weights
constexpr int64_t MAX_ROW_TILE = VNNI_ROW_TILE;
constexpr int64_t ROW_CHUNK = 64;                    // rows a panel meets before the next panel (their activations stay in L2)
constexpr int64_t MAX_PANELS_PER_RANGE = 32;          // panels a thread takes at a time: q8_0's stay well inside L2 (lm_head: 192 groups)
// How far ahead of the record being multiplied the first row tile prefetches the weight stream (past
// the panel's end too: the next panel follows it in memory). A one-row step is bound by the weights'
// ~100 MB per step, and the hardware prefetcher alone leaves it waiting on memory: a prefetch makes it
// 1.15x faster (5.2 -> 4.5 ms on the default model; no change at 32 rows). A step of 5-16 rows multiplies
// a record for about as long as memory takes to bring it, so the stream must be asked for further
// ahead: 4096 bytes rather than 2048 make the default model's 8-row step 1.12-1.16x faster, and nothing
// slower (one row and 32 rows, the MoE benchmark model's steps, the AVX2 tiles, the weights streamed
// non-temporally as on a small L3: within the rounds' spread or faster).
constexpr int64_t WEIGHT_PREFETCH_BYTES = 4096;

// The prefetch's hint (set_weight_prefetch_keep). Where the last-level cache is smaller than the weights
// (a 32 MB L3 against ~100 MB), each step streams them from memory: non-temporal, so that they do not
// evict the rest of the step's data (measured a little faster than T0 or T1 there). Where it holds them
// (a 300 MB L3), T0 keeps them there from step to step: a one-row step 2.7 instead of 5.7 ms.
inline std::atomic<bool> weight_prefetch_keep_on{false};

// Whether a tile asks for the weight stream ahead, and how: not at all (a later tile of rows over a panel finds
// it in L1), with the hint above (a dense product's weights), or into L2 whatever the hint (a MoE layer's
// experts, each read once a step by a few rows: grouped_moe.cpp; the non-temporal hint there made
// bench.moe_cpu's layers read from memory 1.1-1.2x slower).
enum class Prefetch { NONE, WEIGHTS, TO_L2 };

#ifdef TOKENYARD_BLOCK_QUANT_GEMM_AVX2
inline void prefetch_weights(const uint8_t* at, Prefetch how, bool keep) {
  if (how == Prefetch::TO_L2)
    _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1);
  else if (keep)
    _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T0);
  else
    _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_NTA);
}
#endif

// The two record formats: their size, where the scales start, whether minimums follow them.
// The record formats: their size, where the scales start, 4-bit (unsigned) or 8-bit (signed) codes, and
// the blocks' minimums: none, stored after the scales, or -8 d (q4_0's codes are offset by 8).
enum class Mins { NONE, STORED, MINUS_8D };
struct Q4_1Panels {
  static constexpr int64_t RECORD = 160, SCALES = 128;  // codes, 8 fp16 scales, 8 fp16 minimums
  static constexpr bool NIBBLES = true;
  static constexpr Mins MINS = Mins::STORED;
  static int code(const uint8_t* rec, int64_t c, int64_t f) {  // channel c's feature f of the block
    const uint8_t byte = rec[32 * (f % 16 / 4) + 4 * c + f % 4];
    return f < 16 ? byte & 0x0f : byte >> 4;
  }
};
struct Q4_0Panels : Q4_1Panels {
  static constexpr int64_t RECORD = 144;  // codes, 8 fp16 scales
  static constexpr Mins MINS = Mins::MINUS_8D;
};
struct Q8_0Panels {
  static constexpr int64_t RECORD = 272, SCALES = 256;  // codes, 8 fp16 scales
  static constexpr bool NIBBLES = false;
  static constexpr Mins MINS = Mins::NONE;
  static int code(const uint8_t* rec, int64_t c, int64_t f) {
    constexpr int64_t place[4] = {0, 2, 1, 3};  // features 4j, 4j+2, 4j+1, 4j+3 in a channel's 4 bytes
    return static_cast<int8_t>(rec[32 * (f / 4) + 4 * c + place[f % 4]]);
  }
};
constexpr const char* RECORD_SIZES = "144 bytes (q4_0), 160 (q4_1) or 272 (q8_0)";  // for error messages

// Whether the block products use AVX-512 VNNI where it was compiled in: TOKENYARD_CPU_VNNI=0 keeps them on
// AVX2 (for A/B measurements and the tests that compare the two, which agree to the bit).
[[maybe_unused]] inline bool vnni_enabled() {
  static const bool on = [] {
    const char* setting = std::getenv("TOKENYARD_CPU_VNNI");
    return setting == nullptr || std::strcmp(setting, "0") != 0;
  }();
  return on;
}

// From how many rows a call's tiles take two panels at a time in 512-bit vectors (VNNI builds;
// set_block_quant_pair_min_rows, 0: never): kernel_settings.py chooses by the core's measured 512-bit
// product rate. Fewer rows lean on the weight stream, which one panel at a time reads faster.
inline std::atomic<int64_t> pair_min_rows{16};
inline bool pair_tiles(int64_t rows) {
#ifdef TOKENYARD_BLOCK_QUANT_GEMM_VNNI
  const int64_t from = pair_min_rows.load(std::memory_order_relaxed);
  return vnni_enabled() && from > 0 && rows >= from;
#else
  (void)rows;
  return false;
#endif
}

// int8 activation codes for q8_0 records in the VNNI tiles: each group of 4 features in the order the records
// hold their codes (0, 2, 1, 3), offset by 128 (unsigned, as vpdpbusd takes them); d and s as they were.
using OffsetCodes = QuantizedRows<uint8_t>;

inline OffsetCodes offset_codes(QuantizedRows<int8_t>&& a) {
  OffsetCodes o;
  o.q.resize(a.q.size());
  const int64_t n = static_cast<int64_t>(a.q.size());  // a multiple of BLOCK
  const int8_t* from = a.q.data();
  uint8_t* to = o.q.data();
  int64_t i = 0;
#ifdef TOKENYARD_BLOCK_QUANT_GEMM_AVX2
  const __m256i order = _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15, 0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
  for (; i < n; i += 32) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + i), _mm256_xor_si256(_mm256_shuffle_epi8(codes, order), _mm256_set1_epi8(-128)));
  }
#endif
  constexpr int place[4] = {0, 2, 1, 3};
  for (; i < n; ++i) to[i] = static_cast<uint8_t>(from[i - i % 4 + place[i % 4]] + 128);
  o.d = std::move(a.d);
  o.s = std::move(a.s);
  o.k = a.k;
  o.blocks = a.blocks;
  return o;
}

// Whether q8_0 products with int8 activations take OffsetCodes (the VNNI tiles); elsewhere the codes are widened to int16.
inline bool offset_codes_on() {
#ifdef TOKENYARD_BLOCK_QUANT_GEMM_VNNI
  return vnni_enabled();
#else
  return false;
#endif
}

inline int64_t row_tile() {
#ifdef TOKENYARD_BLOCK_QUANT_GEMM_VNNI
  if (vnni_enabled()) return VNNI_ROW_TILE;
#endif
  return ROW_TILE;
}

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// Plain loops: the reference for the vector tiles, and CPUs without AVX2. sums[r * PANEL + c].
template <typename F, typename T>
void panel_rows_generic(const uint8_t* panel, const QuantizedRows<T>& a, int64_t m0, int64_t rows, float* sums) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < PANEL; ++c) {
      float total = 0.f;
      for (int64_t b = 0; b < a.blocks; ++b) {
        const uint8_t* rec = panel + b * F::RECORD;
        const T* xq = a.q.data() + (m0 + r) * a.k + b * BLOCK;
        int32_t dot = 0;
        for (int64_t f = 0; f < BLOCK; ++f) dot += F::code(rec, c, f) * int32_t(xq[f]);
        uint16_t dh;
        std::memcpy(&dh, rec + F::SCALES + 2 * c, 2);
        const int64_t at = (m0 + r) * a.blocks + b;
        total += half_to_float(dh) * a.d[at] * static_cast<float>(dot);
        if constexpr (F::MINS == Mins::STORED) {
          uint16_t mh;
          std::memcpy(&mh, rec + F::SCALES + 2 * PANEL + 2 * c, 2);
          total += half_to_float(mh) * a.s[at];
        } else if constexpr (F::MINS == Mins::MINUS_8D) {
          total += -8.f * half_to_float(dh) * a.s[at];
        }
      }
      sums[r * PANEL + c] = total;
    }
}

#ifdef TOKENYARD_BLOCK_QUANT_GEMM_AVX2
template <typename T>
inline __m256i broadcast4(const T* p) {  // 4 bytes of activation codes into every dword
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Keeps a running sum due where it is computed: without this GCC defers the integer additions to the
// block's end, keeping all the products live and spilling them.
#define TOKENYARD_DUE(v) __asm__("" : "+x"(v))

// The block's integer dot products of R rows with a panel's 8 channels: lane c of dot[r] for channel c.
// int8 activations: maddubs (unsigned codes x signed activations, 32 products), its int16 pair sums
// added up in int16 (at most 8 * 2 * 15 * 127 = 30480), widened by one madd.
template <int R>
inline void block_dots(const uint8_t* rec, const int8_t* const* x, __m256i* dot) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  __m256i sum[R];
  for (int j = 0; j < 4; ++j) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j));
    const __m256i low = _mm256_and_si256(codes, nibble), high = _mm256_and_si256(_mm256_srli_epi16(codes, 4), nibble);
    for (int r = 0; r < R; ++r) {
      const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(low, broadcast4(x[r] + 4 * j)), _mm256_maddubs_epi16(high, broadcast4(x[r] + 16 + 4 * j)));
      sum[r] = j == 0 ? p : _mm256_add_epi16(sum[r], p);
      TOKENYARD_DUE(sum[r]);
    }
  }
  for (int r = 0; r < R; ++r) dot[r] = _mm256_madd_epi16(sum[r], _mm256_set1_epi16(1));
}

// int16 activations: each channel's codes widened to int16 pairs (features 0,1 and 2,3 of a 4-feature
// group) by a byte shuffle, then madd (16 products); the int32 sums are exact (32 * 15 * 32767 < 2^24,
// so the float conversion is too).
template <int R>
inline void block_dots(const uint8_t* rec, const int16_t* const* x, __m256i* dot) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i pairs01 = _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1, 0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
  const __m256i pairs23 = _mm256_add_epi8(pairs01, _mm256_set1_epi16(2));  // the -1 bytes stay negative: zeros
  for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j));
    for (int half = 0; half < 2; ++half) {  // features 4j.. (low nibbles), then 16 + 4j.. (high)
      const __m256i nibbles = _mm256_and_si256(half ? _mm256_srli_epi16(codes, 4) : codes, nibble);
      const __m256i w01 = _mm256_shuffle_epi8(nibbles, pairs01), w23 = _mm256_shuffle_epi8(nibbles, pairs23);
      const int64_t f = 16 * half + 4 * j;
      for (int r = 0; r < R; ++r) {
        dot[r] = _mm256_add_epi32(dot[r], _mm256_add_epi32(_mm256_madd_epi16(w01, broadcast4(x[r] + f)), _mm256_madd_epi16(w23, broadcast4(x[r] + f + 2))));
        TOKENYARD_DUE(dot[r]);
      }
    }
  }
}

// q8_0 codes, int16 activations: a 32-byte group's 16-bit lanes 2c, 2c+1 hold channel c's features
// (0, 2) and (1, 3) of the group, so the lanes' low bytes are features 0, 1 and their high bytes 2, 3,
// each sign-extended by shifts alone; then madd (16 products). The int32 sums stay below
// 32 * 127 * 32767 < 2^28, their float conversion rounds at 2^-24.
template <int R>
inline void q8_0_block_dots(const uint8_t* rec, const int16_t* const* x, __m256i* dot) {
  for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j));
    const __m256i w01 = _mm256_srai_epi16(_mm256_slli_epi16(codes, 8), 8), w23 = _mm256_srai_epi16(codes, 8);
    for (int r = 0; r < R; ++r) {
      dot[r] = _mm256_add_epi32(dot[r], _mm256_add_epi32(_mm256_madd_epi16(w01, broadcast4(x[r] + 4 * j)), _mm256_madd_epi16(w23, broadcast4(x[r] + 4 * j + 2))));
      TOKENYARD_DUE(dot[r]);
    }
  }
}

#ifdef TOKENYARD_BLOCK_QUANT_GEMM_VNNI
// AVX-512 VNNI on 256-bit vectors: vpdpbusd / vpdpwssd multiply and add into the running sums in one
// instruction (the same exact integer sums as above, so the same results to the bit). Each takes 4
// cycles before the next on the same sum can start and two start per cycle, so 8 or more independent
// sums must be in flight: a tile of R rows keeps S = 8 / R per row (one from 8 rows on; the registers
// for more are not there), the products of a row dealt round-robin.
template <int R>
constexpr int sums_per_row() { return R >= 8 ? 1 : R >= 4 ? 2 : R >= 2 ? 4 : 8; }

template <int R, int S>
inline __m256i sum_chains(__m256i (&sum)[S][R], int r) {
  __m256i total = sum[0][r];
  for (int i = 1; i < S; ++i) total = _mm256_add_epi32(total, sum[i][r]);
  return total;
}

template <int R>
inline void block_dots_vnni(const uint8_t* rec, const int8_t* const* x, __m256i* dot) {
  constexpr int S = sums_per_row<R>();
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  __m256i sum[S][R];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < S; ++i) sum[i][r] = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j));
    const __m256i low = _mm256_and_si256(codes, nibble), high = _mm256_and_si256(_mm256_srli_epi16(codes, 4), nibble);
    for (int r = 0; r < R; ++r) {
      sum[(2 * j) % S][r] = _mm256_dpbusd_epi32(sum[(2 * j) % S][r], low, broadcast4(x[r] + 4 * j));
      sum[(2 * j + 1) % S][r] = _mm256_dpbusd_epi32(sum[(2 * j + 1) % S][r], high, broadcast4(x[r] + 16 + 4 * j));
    }
  }
  for (int r = 0; r < R; ++r) dot[r] = sum_chains<R, S>(sum, r);
}

template <int R>
inline void block_dots_vnni(const uint8_t* rec, const int16_t* const* x, __m256i* dot) {
  constexpr int S = sums_per_row<R>();
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i pairs01 = _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1, 0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
  const __m256i pairs23 = _mm256_add_epi8(pairs01, _mm256_set1_epi16(2));
  __m256i sum[S][R];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < S; ++i) sum[i][r] = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j));
    for (int half = 0; half < 2; ++half) {
      const __m256i nibbles = _mm256_and_si256(half ? _mm256_srli_epi16(codes, 4) : codes, nibble);
      const __m256i w01 = _mm256_shuffle_epi8(nibbles, pairs01), w23 = _mm256_shuffle_epi8(nibbles, pairs23);
      const int64_t f = 16 * half + 4 * j;
      const int i = 4 * j + 2 * half;  // the products' count so far
      for (int r = 0; r < R; ++r) {
        sum[i % S][r] = _mm256_dpwssd_epi32(sum[i % S][r], w01, broadcast4(x[r] + f));
        sum[(i + 1) % S][r] = _mm256_dpwssd_epi32(sum[(i + 1) % S][r], w23, broadcast4(x[r] + f + 2));
      }
    }
  }
  for (int r = 0; r < R; ++r) dot[r] = sum_chains<R, S>(sum, r);
}

template <int R>
inline void q8_0_block_dots_vnni(const uint8_t* rec, const int16_t* const* x, __m256i* dot) {
  constexpr int S = sums_per_row<R>();
  __m256i sum[S][R];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < S; ++i) sum[i][r] = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j));
    const __m256i w01 = _mm256_srai_epi16(_mm256_slli_epi16(codes, 8), 8), w23 = _mm256_srai_epi16(codes, 8);
    for (int r = 0; r < R; ++r) {
      sum[(2 * j) % S][r] = _mm256_dpwssd_epi32(sum[(2 * j) % S][r], w01, broadcast4(x[r] + 4 * j));
      sum[(2 * j + 1) % S][r] = _mm256_dpwssd_epi32(sum[(2 * j + 1) % S][r], w23, broadcast4(x[r] + 4 * j + 2));
    }
  }
  for (int r = 0; r < R; ++r) dot[r] = sum_chains<R, S>(sum, r);
}

// q8_0 codes, int8 activations in q8_0's order offset by 128 (OffsetCodes): vpdpbusd multiplies the unsigned
// activations with the signed codes (a row's block in 8 instructions, half int16's), and the offset's 128 * (the
// channel's sum of codes, one more vpdpbusd per group of 4 features for all R rows) comes off in int32: the
// exact sums of the signed int8 products (at most 32 * 255 * 128 < 2^21).
template <int R>
inline void q8_0_block_dots_vnni(const uint8_t* rec, const uint8_t* const* x, __m256i* dot) {
  constexpr int S = sums_per_row<R>();
  const __m256i ones = _mm256_set1_epi8(1);
  __m256i sum[S][R], codes_sum = _mm256_setzero_si256();
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < S; ++i) sum[i][r] = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j));
    codes_sum = _mm256_dpbusd_epi32(codes_sum, ones, codes);
    for (int r = 0; r < R; ++r) sum[j % S][r] = _mm256_dpbusd_epi32(sum[j % S][r], broadcast4(x[r] + 4 * j), codes);
  }
  const __m256i offset = _mm256_slli_epi32(codes_sum, 7);
  for (int r = 0; r < R; ++r) dot[r] = _mm256_sub_epi32(sum_chains<R, S>(sum, r), offset);
}
#endif

// R rows x one panel into sums[r * PANEL + c] (row m0 + r, channel c); VNNI: the block products by
// AVX-512 VNNI instructions; `prefetch`: whether and how it asks for the weight stream ahead.
template <int R, typename F, typename T, bool VNNI>
void panel_tile(const uint8_t* panel, const QuantizedRows<T>& a, int64_t m0, Prefetch prefetch, float* sums) {
  const bool keep = weight_prefetch_keep_on.load(std::memory_order_relaxed);
  const T* xq[R];
  const float *dx[R], *sx[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = a.q.data() + (m0 + r) * a.k;
    dx[r] = a.d.data() + (m0 + r) * a.blocks;
    sx[r] = a.s.data() + (m0 + r) * a.blocks;
    acc[r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* rec = panel + b * F::RECORD;
    if (prefetch != Prefetch::NONE)
      for (int64_t byte = 0; byte < F::RECORD; byte += 64) prefetch_weights(rec + WEIGHT_PREFETCH_BYTES + byte, prefetch, keep);
    const T* x[R];
    for (int r = 0; r < R; ++r) x[r] = xq[r] + b * BLOCK;
    __m256i dot[R];
#ifdef TOKENYARD_BLOCK_QUANT_GEMM_VNNI
    if constexpr (VNNI) {
      if constexpr (F::NIBBLES)
        block_dots_vnni<R>(rec, x, dot);
      else
        q8_0_block_dots_vnni<R>(rec, x, dot);
    } else
#endif
    if constexpr (F::NIBBLES)
      block_dots<R>(rec, x, dot);
    else
      q8_0_block_dots<R>(rec, x, dot);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + F::SCALES)));
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(d, _mm256_broadcast_ss(dx[r] + b)), acc[r]);
    if constexpr (F::MINS != Mins::NONE) {
      const __m256 mins = F::MINS == Mins::STORED ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + F::SCALES + 2 * PANEL)))
                                                  : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(mins, _mm256_broadcast_ss(sx[r] + b), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(sums + r * PANEL, acc[r]);
}
#endif

#ifdef TOKENYARD_BLOCK_QUANT_GEMM_VNNI
// Two panels side by side in 512-bit vectors (lanes 0-7: panel p's channels, 8-15: panel p + 1's): the
// same products in half the instructions, where the front end rather than the multipliers limited the
// 256-bit tiles (32-row products 1.15-1.2x faster; the default model's decode step, fp16 cache, 8
// alternating rounds in one process: 1.10x at 32 rows, 1.04x at 24, 1.07x at 16, 0.96x at 8). Lane for
// lane the arithmetic of the 256-bit tile, so the same bits.
inline __m512i two_records(const uint8_t* rec0, const uint8_t* rec1, int64_t offset) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec0 + offset))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec1 + offset)), 1);
}
inline __m512 two_halves_to_float(const uint8_t* rec0, const uint8_t* rec1, int64_t offset) {  // 8 + 8 fp16
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec0 + offset))),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec1 + offset)), 1));
}
template <typename T>
inline __m512i broadcast4_512(const T* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int R, int S>
inline __m512i sum_chains(__m512i (&sum)[S][R], int r) {
  __m512i total = sum[0][r];
  for (int i = 1; i < S; ++i) total = _mm512_add_epi32(total, sum[i][r]);
  return total;
}

template <int R>
inline void pair_dots(const uint8_t* rec0, const uint8_t* rec1, const int8_t* const* x, __m512i* dot) {
  constexpr int S = sums_per_row<R>();
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512i sum[S][R];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < S; ++i) sum[i][r] = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    const __m512i codes = two_records(rec0, rec1, 32 * j);
    const __m512i low = _mm512_and_si512(codes, nibble), high = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble);
    for (int r = 0; r < R; ++r) {
      sum[(2 * j) % S][r] = _mm512_dpbusd_epi32(sum[(2 * j) % S][r], low, broadcast4_512(x[r] + 4 * j));
      sum[(2 * j + 1) % S][r] = _mm512_dpbusd_epi32(sum[(2 * j + 1) % S][r], high, broadcast4_512(x[r] + 16 + 4 * j));
    }
  }
  for (int r = 0; r < R; ++r) dot[r] = sum_chains<R, S>(sum, r);
}

template <int R>
inline void pair_dots(const uint8_t* rec0, const uint8_t* rec1, const int16_t* const* x, __m512i* dot) {
  constexpr int S = sums_per_row<R>();
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i pairs01 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1));
  const __m512i pairs23 = _mm512_add_epi8(pairs01, _mm512_set1_epi16(2));
  __m512i sum[S][R];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < S; ++i) sum[i][r] = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    const __m512i codes = two_records(rec0, rec1, 32 * j);
    for (int half = 0; half < 2; ++half) {
      const __m512i nibbles = _mm512_and_si512(half ? _mm512_srli_epi16(codes, 4) : codes, nibble);
      const __m512i w01 = _mm512_shuffle_epi8(nibbles, pairs01), w23 = _mm512_shuffle_epi8(nibbles, pairs23);
      const int64_t f = 16 * half + 4 * j;
      const int i = 4 * j + 2 * half;
      for (int r = 0; r < R; ++r) {
        sum[i % S][r] = _mm512_dpwssd_epi32(sum[i % S][r], w01, broadcast4_512(x[r] + f));
        sum[(i + 1) % S][r] = _mm512_dpwssd_epi32(sum[(i + 1) % S][r], w23, broadcast4_512(x[r] + f + 2));
      }
    }
  }
  for (int r = 0; r < R; ++r) dot[r] = sum_chains<R, S>(sum, r);
}

template <int R>
inline void q8_0_pair_dots(const uint8_t* rec0, const uint8_t* rec1, const int16_t* const* x, __m512i* dot) {
  constexpr int S = sums_per_row<R>();
  __m512i sum[S][R];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < S; ++i) sum[i][r] = _mm512_setzero_si512();
  for (int j = 0; j < 8; ++j) {
    const __m512i codes = two_records(rec0, rec1, 32 * j);
    const __m512i w01 = _mm512_srai_epi16(_mm512_slli_epi16(codes, 8), 8), w23 = _mm512_srai_epi16(codes, 8);
    for (int r = 0; r < R; ++r) {
      sum[(2 * j) % S][r] = _mm512_dpwssd_epi32(sum[(2 * j) % S][r], w01, broadcast4_512(x[r] + 4 * j));
      sum[(2 * j + 1) % S][r] = _mm512_dpwssd_epi32(sum[(2 * j + 1) % S][r], w23, broadcast4_512(x[r] + 4 * j + 2));
    }
  }
  for (int r = 0; r < R; ++r) dot[r] = sum_chains<R, S>(sum, r);
}

template <int R>
inline void q8_0_pair_dots(const uint8_t* rec0, const uint8_t* rec1, const uint8_t* const* x, __m512i* dot) {
  constexpr int S = sums_per_row<R>();
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i sum[S][R], codes_sum = _mm512_setzero_si512();
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < S; ++i) sum[i][r] = _mm512_setzero_si512();
  for (int j = 0; j < 8; ++j) {
    const __m512i codes = two_records(rec0, rec1, 32 * j);
    codes_sum = _mm512_dpbusd_epi32(codes_sum, ones, codes);
    for (int r = 0; r < R; ++r) sum[j % S][r] = _mm512_dpbusd_epi32(sum[j % S][r], broadcast4_512(x[r] + 4 * j), codes);
  }
  const __m512i offset = _mm512_slli_epi32(codes_sum, 7);
  for (int r = 0; r < R; ++r) dot[r] = _mm512_sub_epi32(sum_chains<R, S>(sum, r), offset);
}

// R rows x panels p and p + 1 (panel_bytes apart) into sums[q * MAX_ROW_TILE * PANEL + r * PANEL + c]
// (panel p + q, row m0 + r, channel c).
template <int R, typename F, typename T>
void panel_pair_tile(const uint8_t* panel, int64_t panel_bytes, const QuantizedRows<T>& a, int64_t m0, Prefetch prefetch, float* sums) {
  const bool keep = weight_prefetch_keep_on.load(std::memory_order_relaxed);
  const T* xq[R];
  const float *dx[R], *sx[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = a.q.data() + (m0 + r) * a.k;
    dx[r] = a.d.data() + (m0 + r) * a.blocks;
    sx[r] = a.s.data() + (m0 + r) * a.blocks;
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t *rec0 = panel + b * F::RECORD, *rec1 = rec0 + panel_bytes;
    if (prefetch != Prefetch::NONE)
      for (int64_t byte = 0; byte < F::RECORD; byte += 64) {
        prefetch_weights(rec0 + WEIGHT_PREFETCH_BYTES + byte, prefetch, keep);
        prefetch_weights(rec1 + WEIGHT_PREFETCH_BYTES + byte, prefetch, keep);
      }
    const T* x[R];
    for (int r = 0; r < R; ++r) x[r] = xq[r] + b * BLOCK;
    __m512i dot[R];
    if constexpr (F::NIBBLES)
      pair_dots<R>(rec0, rec1, x, dot);
    else
      q8_0_pair_dots<R>(rec0, rec1, x, dot);
    const __m512 d = two_halves_to_float(rec0, rec1, F::SCALES);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx[r][b])), acc[r]);
    if constexpr (F::MINS != Mins::NONE) {
      const __m512 mins = F::MINS == Mins::STORED ? two_halves_to_float(rec0, rec1, F::SCALES + 2 * PANEL) : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(sx[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(sums + r * PANEL, _mm512_castps512_ps256(acc[r]));
    _mm256_storeu_ps(sums + MAX_ROW_TILE * PANEL + r * PANEL, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
  }
}
#endif

// rows <= row_tile() rows of `span` panels (1, or 2 where pair_tiles(rows)) starting at `panel`, panel_bytes
// apart, into sums[q * MAX_ROW_TILE * PANEL + r * PANEL + c] (panel q of the span, row m0 + r, channel c);
// `prefetch` as panel_tile's.
template <typename F, typename T>
void run_tile(const uint8_t* panel, [[maybe_unused]] int64_t panel_bytes, [[maybe_unused]] int64_t span, const QuantizedRows<T>& a, int64_t m0,
              int64_t rows, [[maybe_unused]] Prefetch prefetch, float* sums) {
  constexpr bool offset_codes = std::is_same_v<T, uint8_t>;  // OffsetCodes: q8_0's, for the VNNI tiles only
  static_assert(!offset_codes || std::is_same_v<F, Q8_0Panels>, "offset int8 codes are q8_0's");
#ifdef TOKENYARD_BLOCK_QUANT_GEMM_AVX2
#ifdef TOKENYARD_BLOCK_QUANT_GEMM_VNNI
  if (span == 2) switch (rows) {
      case 1: return panel_pair_tile<1, F, T>(panel, panel_bytes, a, m0, prefetch, sums);
      case 2: return panel_pair_tile<2, F, T>(panel, panel_bytes, a, m0, prefetch, sums);
      case 3: return panel_pair_tile<3, F, T>(panel, panel_bytes, a, m0, prefetch, sums);
      case 4: return panel_pair_tile<4, F, T>(panel, panel_bytes, a, m0, prefetch, sums);
      case 5: return panel_pair_tile<5, F, T>(panel, panel_bytes, a, m0, prefetch, sums);
      case 6: return panel_pair_tile<6, F, T>(panel, panel_bytes, a, m0, prefetch, sums);
      case 7: return panel_pair_tile<7, F, T>(panel, panel_bytes, a, m0, prefetch, sums);
      default: return panel_pair_tile<8, F, T>(panel, panel_bytes, a, m0, prefetch, sums);
    }
  if (offset_codes || vnni_enabled()) switch (rows) {
      case 1: return panel_tile<1, F, T, true>(panel, a, m0, prefetch, sums);
      case 2: return panel_tile<2, F, T, true>(panel, a, m0, prefetch, sums);
      case 3: return panel_tile<3, F, T, true>(panel, a, m0, prefetch, sums);
      case 4: return panel_tile<4, F, T, true>(panel, a, m0, prefetch, sums);
      case 5: return panel_tile<5, F, T, true>(panel, a, m0, prefetch, sums);
      case 6: return panel_tile<6, F, T, true>(panel, a, m0, prefetch, sums);
      case 7: return panel_tile<7, F, T, true>(panel, a, m0, prefetch, sums);
      default: return panel_tile<8, F, T, true>(panel, a, m0, prefetch, sums);
    }
#endif
  if constexpr (!offset_codes) switch (rows) {
      case 1: return panel_tile<1, F, T, false>(panel, a, m0, prefetch, sums);
      case 2: return panel_tile<2, F, T, false>(panel, a, m0, prefetch, sums);
      case 3: return panel_tile<3, F, T, false>(panel, a, m0, prefetch, sums);
      default: return panel_tile<4, F, T, false>(panel, a, m0, prefetch, sums);
    }
#else
  if constexpr (!offset_codes) return panel_rows_generic<F>(panel, a, m0, rows, sums);
#endif
  TORCH_CHECK(!offset_codes, "offset int8 codes need the AVX-512 VNNI tiles");
}

// How many panels a tile takes from `p` on in a range ending at `end`, in a call of `rows` rows.
inline int64_t tile_span(int64_t p, int64_t end, int64_t rows) { return pair_tiles(rows) && p + 1 < end ? 2 : 1; }

}  // namespace block_panels
