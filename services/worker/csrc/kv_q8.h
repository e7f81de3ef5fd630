// The int8 KV cache's format (``--kv-cache-dtype int8``): llama.cpp's q8_0 per head vector. A head's keys
// (or values) of head_dim elements are stored as head_dim signed codes, then one fp16 scale per block of 32
// elements: element i = code[i] * scale[i / 32], codes in -127..127 (the block's largest magnitude maps to
// 127). A head_dim of 64 takes 68 bytes instead of fp16's 128. What writes it: kv_store.cpp; what reads
// it: paged_decode_attention.cpp; services/worker/attention.py mirrors the layout for tests.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kv_q8 {

constexpr int64_t BLOCK = 32;  // elements per scale

// Bytes of one head vector in the cache: the codes, then the fp16 scales.
constexpr int64_t vector_bytes(int64_t dim) { return dim + dim / BLOCK * 2; }

// The scale of block b of the vector whose codes start at vec (dim codes).
inline float scale(const int8_t* vec, int64_t dim, int64_t b) {
  uint16_t bits;
  std::memcpy(&bits, vec + dim + 2 * b, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Element i of a stored vector, widened (the plain loops' read; the vector paths scale whole registers).
inline float element(const int8_t* vec, int64_t dim, int64_t i) { return static_cast<float>(vec[i]) * scale(vec, dim, i / BLOCK); }

// x [dim] (dim a multiple of BLOCK) into a stored vector at out. The codes are chosen against the scale
// as stored (rounded to fp16 first), so code * scale is the nearest multiple of the stored scale.
inline void quantize(const float* x, int8_t* out, int64_t dim) {
  for (int64_t b = 0; b < dim / BLOCK; ++b) {
    const float* v = x + b * BLOCK;
    int8_t* codes = out + b * BLOCK;
    float amax = 0.f;
    for (int64_t i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(v[i]));
    const c10::Half stored(amax / 127.f);
    const float d = static_cast<float>(stored), inv = d > 0.f ? 1.f / d : 0.f;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    const __m256 scale8 = _mm256_set1_ps(inv);
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    for (; i + 8 <= BLOCK; i += 8) {
      // nearest (as std::nearbyint), clamped: the fp16 rounding of the scale may put the largest just past 127
      const __m256i q = _mm256_max_epi32(lo, _mm256_min_epi32(hi, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), scale8))));
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      const __m128i bytes = _mm_packs_epi16(words, words);
      std::memcpy(codes + i, &bytes, 8);
    }
#endif
    for (; i < BLOCK; ++i) codes[i] = static_cast<int8_t>(std::clamp(std::nearbyint(v[i] * inv), -127.f, 127.f));
    const uint16_t bits = stored.x;
    std::memcpy(out + dim + 2 * b, &bits, 2);
  }
}

}  // namespace kv_q8
