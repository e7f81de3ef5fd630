// Activations rounded per block of 32 features to int8 or int16 codes with one scale per block (the
// granularity of llama.cpp's q8 activations), for the CPU kernels that multiply them in integers:
// block_quant_gemm.cpp (int16 or int8) and int8_linear.cpp (int8).
#pragma once

#include <ATen/Parallel.h>

#include "takeover_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace activation_quant {

constexpr int64_t BLOCK = 32;  // features per scale

// An allocator whose vectors leave new elements uninitialized (a vector whose every element is written before
// it is read: a value-initialized one would zero it first, a memset as long as the writes themselves).
template <typename T>
struct Uninitialized : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = Uninitialized<U>;
  };
  Uninitialized() = default;
  template <typename U>
  Uninitialized(const Uninitialized<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using Unzeroed = std::vector<T, Uninitialized<T>>;

// A product's activations: x ~= q * d per (row, block), q in -MAX..MAX of T; s = the block's sum of x itself.
template <typename T>
struct QuantizedRows {
  static constexpr float MAX_CODE = sizeof(T) == 1 ? 127.f : 32767.f;
  Unzeroed<T> q;      // [rows, k]
  Unzeroed<float> d;  // [rows, blocks]
  Unzeroed<float> s;  // [rows, blocks]
  int64_t k, blocks;

  QuantizedRows() = default;
  QuantizedRows(int64_t rows, int64_t k_) : q(rows * k_), d(rows * (k_ / BLOCK)), s(rows * (k_ / BLOCK)), k(k_), blocks(k_ / BLOCK) {}
};

template <typename T>
void quantize_block(const float* x, T* q, float* d, float* s) {
  constexpr float MAX_CODE = QuantizedRows<T>::MAX_CODE;
#if defined(__AVX2__)
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 amax8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  const __m256 sum8 = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(sum8), _mm256_extractf128_ps(sum8, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  *s = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  *d = amax / MAX_CODE;
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? MAX_CODE / amax : 0.f);
  __m256i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // nearest, as std::nearbyint
  // packs work within 128-bit lanes, so 8-byte (int16) or 4-byte (int8) runs come out of order; a permute restores it.
  if constexpr (sizeof(T) == 1) {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(_mm256_packs_epi32(i[0], i[1]), 0xd8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(i[2], i[3]), 0xd8));
  }
#else
  float amax = 0.f, sum = 0.f;
  for (int i = 0; i < BLOCK; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    sum += x[i];
  }
  *s = sum;
  *d = amax / MAX_CODE;
  const float inv = amax > 0.f ? MAX_CODE / amax : 0.f;
  for (int i = 0; i < BLOCK; ++i) q[i] = static_cast<T>(std::nearbyint(x[i] * inv));
#endif
}

template <typename T>
QuantizedRows<T> quantize_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / BLOCK;
  QuantizedRows<T> a(rows, k);
  // One thread in a step whose big calls run on the takeover pool: splitting would wake OpenMP's threads.
  at::parallel_for(0, rows * blocks, takeover_pool::keeps_to_caller(rows) ? std::max<int64_t>(rows * blocks, 1) : 512, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) quantize_block<T>(x + b * BLOCK, a.q.data() + b * BLOCK, a.d.data() + b, a.s.data() + b);
  });
  return a;
}

// int8 codes held as int16 ones: the same values, for the int16 tiles.
inline QuantizedRows<int16_t> widened(QuantizedRows<int8_t>&& a) {
  QuantizedRows<int16_t> wide;
  wide.q.assign(a.q.begin(), a.q.end());
  wide.d = std::move(a.d);
  wide.s = std::move(a.s);
  wide.k = a.k;
  wide.blocks = a.blocks;
  return wide;
}

}  // namespace activation_quant
