// Shared by the CPU kernels: the sum of an AVX2 register's eight floats.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

inline float hsum(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}
#endif
