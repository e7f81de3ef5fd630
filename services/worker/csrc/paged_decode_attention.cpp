// Paged attention on the CPU for every row of a step: each row is one query token (a decode, or one
// token of a prefill chunk) over positions [0, len) of its request, its keys and values read in place
// from the paged KV cache through the block table (no gathered copy of the context).
//
// Layout (services/worker/attention.py): cache [slots, 2, kv_heads, head_dim] (an int8 cache: each head
// vector's head_dim codes, then its fp16 scales, kv_q8.h), position p of a request in slot
// table[p / block_size] * block_size + p % block_size. Query heads h*G .. h*G+G-1 share kv head h (GQA),
// so each (row, kv head) work item reads its keys and values once for its G queries.
//
// Per item, in three passes over the whole context (fp32 arithmetic; fp16 and int8 storage widened on load):
//   1. scores [G, len] = q . k * scale, each key read once for the G heads; with AVX2, eight positions'
//      dot products at a time, reduced together into one register of eight sums (no horizontal sum
//      per score);
//   2. softmax per head over its row of scores: max, exp, sum (probabilities left unnormalized);
//   3. out[g] = sum_p prob[g, p] * v_p / sum[g], each value read once for up to three heads at a time,
//      a slice of head_dim at a time so the heads' accumulators stay in registers.
// Items are taken one at a time by the threads (prefill rows grow 1..len, so equal shares of items
// would be far from equal work). Builds for AVX-512 run the passes in 512-bit vectors (decode rows over
// 1,024 positions 1.2-1.4x faster at head_dim 64 and 128, a 2,000-token prefill of the default model
// 1.10-1.16x), every row alike: a row's bits never depend on the step it is in (a verify's rows answer as
// decodes do).
//
// A decode row's context lies in blocks scattered over the cache, and an item reads 4 of each slot's
// 12 cache lines (fp16, the default model): read in place, the passes stall on memory. With enough
// rows for every thread, an item is a whole row instead: its blocks (every kv head's keys and values,
// one contiguous run each) are first copied into a per-thread buffer, which streams at memory speed,
// and its kv heads then read the copy from L2. Measured on a 32-row decode step of the default model:
// 1.2-1.35x for the kernel alone with the cache cold (bench.attention_kernel), ~1.15-1.2x inside the
// model; 0.85x with the cache in L3, which a model step never leaves it. Not copied: a context too long
// to stay in L2, and the rows of a prefill chunk after its first (they read what it fetched).
// An int8 cache's slot is 0.53x fp16's bytes, so whole-row copies stream that much less (bench.kv_cache);
// a head's 68-byte vectors still touch two cache lines each, so items read in place gain nothing.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "avx2_exp.h"
#include "kv_q8.h"
#include "takeover_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kRowsPerThreadByRow = 4;  // from this many rows per thread, whole rows are the work items
constexpr int64_t kCopyMaxBytes = 384 * 1024;  // a row's copied context must stay in L2 (512 KB per core here)

// Per-thread scratch for a row's copied context: the pool's threads persist, so it is allocated once
// and grown, never per call.
char* copy_scratch(int64_t bytes) {
  static thread_local std::vector<char> scratch;
  if (static_cast<int64_t>(scratch.size()) < bytes) scratch.resize(bytes);
  return scratch.data();
}

// Elements of T per head vector in the cache: head_dim, and for an int8 cache its scales' bytes too (kv_q8.h).
template <typename T>
constexpr int64_t head_stride(int64_t dim) {
  if constexpr (std::is_same_v<T, int8_t>)
    return kv_q8::vector_bytes(dim);
  else
    return dim;
}

// Element i of a stored head vector of dim elements, as a float.
template <typename T>
inline float widen(const T* vec, int64_t dim, int64_t i) {
  if constexpr (std::is_same_v<T, int8_t>)
    return kv_q8::element(vec, dim, i);
  else
    return static_cast<float>(vec[i]);
}

// The context a thread copies next (the following row's blocks), asked into L2 a few cache lines at a time
// while this row computes: the copy then reads L2 instead of waiting on memory (the MoE benchmark model's
// 32-row decode step under int4-a8: its attention 8.1-8.4 instead of 9.3-9.6 ms). Only the takeover pool's
// jobs ask: a thread there takes its share's rows in order, where OpenMP's take the next free row (which,
// asked for all the same, made bench.attention_kernel's cold decode 1.13x slower).
struct Ahead {
  const char* cache = nullptr;  // nullptr: nothing to ask for
  const int32_t* table = nullptr;
  int64_t block_bytes = 0, last_block_bytes = 0, blocks = 0;
  int64_t block = 0, byte = 0;  // the next line to ask for

  void pump(int64_t lines) {
    for (; lines > 0 && block < blocks; --lines) {
      __builtin_prefetch(cache + table[block] * block_bytes + byte, 0, 2);  // prefetcht1: into L2
      if ((byte += 64) >= (block + 1 == blocks ? last_block_bytes : block_bytes)) byte = 0, ++block;
    }
  }
};

// One (row, kv head) work item. keys[p] points at position p's key; its value is at keys[p] +
// value_offset. scores is [group, stride] with stride >= len (a multiple of 8 on the AVX2 path).
template <typename T>  // the cache's element type: float, c10::Half (fp16 storage, fp32 arithmetic) or int8_t (kv_q8.h)
struct Item {
  const float* queries;  // [group, dim]
  const T* const* keys;
  float* scores;
  float* out;  // [group, dim]
  int64_t len, stride, value_offset, group, dim;
  float scale;
  Ahead* ahead;  // or nullptr
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }  // codes, unscaled

// Eight elements [i, i + 8) of a stored head vector of dim elements, as floats (an int8 cache's codes scaled).
template <typename T>
inline __m256 load8_scaled(const T* vec, int64_t dim, int64_t i) {
  if constexpr (std::is_same_v<T, int8_t>)
    return _mm256_mul_ps(load8(vec + i), _mm256_set1_ps(kv_q8::scale(vec, dim, i / kv_q8::BLOCK)));
  else
    return load8(vec + i);
}

// [sum(a[0]), sum(a[1]), ..., sum(a[7])]: three rounds of pairwise adds instead of eight horizontal sums.
inline __m256 reduce8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);  // lane halves: a0..a3 | a0..a3
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Prefetch the eight keys (offset 0) or values (it.value_offset) of positions [start, start + 8).
template <int R, auto hint, typename T>
inline void prefetch8(const Item<T>& it, int64_t start, int64_t offset) {
  for (int i = 0; i < 8; ++i)
    for (int64_t byte = 0; byte < head_stride<T>(8 * R) * static_cast<int64_t>(sizeof(T)); byte += 64)
      _mm_prefetch(reinterpret_cast<const char*>(it.keys[start + i] + offset) + byte, hint);
}

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// Sixteen elements [i, i + 16) of a stored head vector of dim elements, as floats (an int8 cache's codes scaled).
template <typename T>
inline __m512 load16_scaled(const T* vec, int64_t dim, int64_t i) {
  if constexpr (std::is_same_v<T, int8_t>)
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vec + i)))),
                         _mm512_set1_ps(kv_q8::scale(vec, dim, i / kv_q8::BLOCK)));
  else
    return load16(vec + i);
}
#endif

// Keys and values are scattered over the cache (L3 or memory): the keys of the block after next and this
// block's values (for pass 3, into L2) are fetched ahead.
constexpr int64_t KEYS_AHEAD = 16;

template <int R, typename T>
inline void fetch_first_keys(const Item<T>& it) {
  for (int64_t start = 0; start < std::min(KEYS_AHEAD, it.stride); start += 8) prefetch8<R, _MM_HINT_T0>(it, start, 0);
}

// Positions [start, start + 8)'s keys as floats, k[i] for position start + i: fp16 and int8 keys widened
// (int8 codes times their scales) once into `widened` [8, dim], where every head's query meets them.
template <int R, typename T>
inline void block_keys(const Item<T>& it, int64_t start, float* widened, const float** k) {
  if (it.ahead) it.ahead->pump(16);
  if (start + KEYS_AHEAD < it.stride) prefetch8<R, _MM_HINT_T0>(it, start + KEYS_AHEAD, 0);
  prefetch8<R, _MM_HINT_T1>(it, start, it.value_offset);
  for (int i = 0; i < 8; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      k[i] = it.keys[start + i];
    } else {
      float* w = widened + i * 8 * R;
#ifdef __AVX512F__
      for (int z = 0; z < R / 2; ++z) _mm512_storeu_ps(w + 16 * z, load16_scaled(it.keys[start + i], 8 * R, 16 * z));
#else
      if constexpr (std::is_same_v<T, int8_t>) {
        for (int r0 = 0; r0 < R; r0 += 4) {  // a scale per four registers (32 elements)
          const __m256 d = _mm256_set1_ps(kv_q8::scale(it.keys[start + i], 8 * R, r0 / 4));
          for (int r = r0; r < r0 + 4; ++r) _mm256_storeu_ps(w + 8 * r, _mm256_mul_ps(load8(it.keys[start + i] + 8 * r), d));
        }
      } else {
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(w + 8 * r, load8(it.keys[start + i] + 8 * r));
      }
#endif
      k[i] = w;
    }
  }
}

// Pass 1, R = dim / 8 registers per vector. Keys go eight positions at a time (block_keys). stride is a
// multiple of 8 and keys[len .. stride) repeat a real key, so a block always has eight readable positions;
// the scores past len are set to -inf, which pass 2 turns into probability 0.
template <int R, typename T>
void score(const Item<T>& it, float* widened) {
  fetch_first_keys<R>(it);
  for (int64_t start = 0; start < it.stride; start += 8) {
    const float* k[8];
    block_keys<R>(it, start, widened, k);
    for (int64_t g = 0; g < it.group; ++g) {
      // Every head reads the keys from memory (L1) as FMA operands: without this barrier the compiler
      // hoists the 8 * R key loads out of the head loop and spills them all to the stack.
      asm volatile("" : : : "memory");
      const float* query = it.queries + g * it.dim;
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      for (int r0 = 0; r0 < R; r0 += 4) {  // four query registers and eight accumulators live at a time
        __m256 q[4];
        for (int r = 0; r < 4; ++r) q[r] = _mm256_loadu_ps(query + 8 * (r0 + r));
        for (int r = 0; r < 4; ++r)  // eight independent FMAs in a row: the latency of each chain is covered
          for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(q[r], _mm256_loadu_ps(k[i] + 8 * (r0 + r)), a[i]);
      }
      float* s = it.scores + g * it.stride + start;
      _mm256_storeu_ps(s, _mm256_mul_ps(reduce8(a), _mm256_set1_ps(it.scale)));
      for (int64_t i = it.len - start; i < 8; ++i) s[i] = kMinusInf;
    }
  }
}

// Pass 2 over [group, stride] scores: probabilities exp(s - max) in place, and their sums[g].
inline void softmax(float* scores, int64_t group, int64_t stride, float* sums) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * stride;
    __m256 m = _mm256_set1_ps(kMinusInf);
    for (int64_t i = 0; i < stride; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_permute_ps(m, 0x4e));
    m = _mm256_max_ps(m, _mm256_permute_ps(m, 0xb1));  // the row's max in every lane (finite: position 0 is real)
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < stride; i += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
      _mm256_storeu_ps(s + i, p);
      sum = _mm256_add_ps(sum, p);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum);
    sums[g] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
}

// Pass 3 for heads g0 .. g0+GT-1 and C registers of head_dim from column c: GT * C accumulators, each
// value slice widened once for the GT heads. GT * C + GT broadcasts + 1 value register fit in the 16
// ymm registers with room to spare (at exactly 16 the compiler spills an accumulator, and the
// store/reload chain through the stack halves the speed), and GT * C >= 8 accumulators cover the FMA
// latency except for the last two-register slice of three heads.
template <int GT, int C, typename T>
void weigh_slice(const Item<T>& it, int64_t g0, int64_t column, const float* sums) {
  const float* probs = it.scores + g0 * it.stride;
  __m256 acc[GT][C];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t p = 0; p < it.len; ++p) {
    if (it.ahead) it.ahead->pump(1);
    const T* value = it.keys[p] + it.value_offset;
    __m256 w[GT];
    for (int g = 0; g < GT; ++g) w[g] = _mm256_broadcast_ss(probs + g * it.stride + p);
    for (int c = 0; c < C; ++c) {
      const __m256 v = load8_scaled(value, it.dim, column + 8 * c);
      for (int g = 0; g < GT; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], v, acc[g][c]);
    }
  }
  for (int g = 0; g < GT; ++g) {
    const __m256 inv = _mm256_set1_ps(1.f / sums[g0 + g]);
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(it.out + (g0 + g) * it.dim + column + 8 * c, _mm256_mul_ps(acc[g][c], inv));
  }
}

// Slices across head_dim (dim / 8 registers, a multiple of 4 on this path): eight or four registers
// for one head, four for two, threes and twos for three (8 = 3 + 3 + 2, 16 = 3 + 3 + 3 + 3 + 2 + 2).
template <int GT, typename T>
void weigh_values(const Item<T>& it, int64_t g0, const float* sums) {
  const int64_t regs = it.dim / 8;
  int64_t r = 0;
  auto take = [&](auto width) {
    weigh_slice<GT, decltype(width)::value>(it, g0, 8 * r, sums);
    r += width;
  };
  while (r < regs) {
    const int64_t left = regs - r;
    if constexpr (GT == 1)
      left >= 8 ? take(std::integral_constant<int, 8>{}) : take(std::integral_constant<int, 4>{});
    else if constexpr (GT == 2)
      take(std::integral_constant<int, 4>{});
    else
      left > 4 || left == 3 ? take(std::integral_constant<int, 3>{}) : take(std::integral_constant<int, 2>{});
  }
}

#ifdef __AVX512F__
// The same three passes in 512-bit vectors (builds for CPUs with AVX-512): half the instructions per
// key and value (load16_scaled above). Every row of every step on such a build takes this path, so the
// bits of a row never depend on the step it is in.

// Pass 1, Z = dim / 16 registers per vector: as score(), eight positions at a time.
template <int Z, typename T>
void score512(const Item<T>& it, float* widened) {
  fetch_first_keys<2 * Z>(it);
  for (int64_t start = 0; start < it.stride; start += 8) {
    const float* k[8];
    block_keys<2 * Z>(it, start, widened, k);
    for (int64_t g = 0; g < it.group; ++g) {
      asm volatile("" : : : "memory");  // the keys stay FMA operands from L1 (see score())
      const float* query = it.queries + g * it.dim;
      __m512 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
      for (int z = 0; z < Z; ++z) {
        const __m512 q = _mm512_loadu_ps(query + 16 * z);
        for (int i = 0; i < 8; ++i) a[i] = _mm512_fmadd_ps(q, _mm512_loadu_ps(k[i] + 16 * z), a[i]);
      }
      __m256 halves[8];  // each sum's two 256-bit halves added, then the eight reduced together
      for (int i = 0; i < 8; ++i) halves[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
      float* s = it.scores + g * it.stride + start;
      _mm256_storeu_ps(s, _mm256_mul_ps(reduce8(halves), _mm256_set1_ps(it.scale)));
      for (int64_t i = it.len - start; i < 8; ++i) s[i] = kMinusInf;
    }
  }
}

// Pass 3 for heads g0 .. g0+GT-1 over the whole head_dim (Z registers): GT * Z accumulators in the 32 zmm registers.
template <int GT, int Z, typename T>
void weigh512(const Item<T>& it, int64_t g0, const float* sums) {
  const float* probs = it.scores + g0 * it.stride;
  __m512 acc[GT][Z];
  for (int g = 0; g < GT; ++g)
    for (int z = 0; z < Z; ++z) acc[g][z] = _mm512_setzero_ps();
  for (int64_t p = 0; p < it.len; ++p) {
    if (it.ahead) it.ahead->pump(2);
    const T* value = it.keys[p] + it.value_offset;
    __m512 w[GT];
    for (int g = 0; g < GT; ++g) w[g] = _mm512_set1_ps(probs[g * it.stride + p]);
    for (int z = 0; z < Z; ++z) {
      const __m512 v = load16_scaled(value, it.dim, 16 * z);
      for (int g = 0; g < GT; ++g) acc[g][z] = _mm512_fmadd_ps(w[g], v, acc[g][z]);
    }
  }
  for (int g = 0; g < GT; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / sums[g0 + g]);
    for (int z = 0; z < Z; ++z) _mm512_storeu_ps(it.out + (g0 + g) * it.dim + 16 * z, _mm512_mul_ps(acc[g][z], inv));
  }
}

template <int Z, typename T>
void attend512(const Item<T>& it, float* widened, float* sums) {
  score512<Z>(it, widened);
  softmax(it.scores, it.group, it.stride, sums);
  for (int64_t g0 = 0; g0 < it.group; g0 += 3) {
    switch (std::min<int64_t>(3, it.group - g0)) {
      case 3: weigh512<3, Z>(it, g0, sums); break;
      case 2: weigh512<2, Z>(it, g0, sums); break;
      default: weigh512<1, Z>(it, g0, sums); break;
    }
  }
}
#endif

template <int R, typename T>
void attend(const Item<T>& it, float* widened, float* sums) {
  static_assert(R % 4 == 0, "head_dim a multiple of 32");
#ifdef __AVX512F__
  return attend512<R / 2>(it, widened, sums);
#else
  score<R>(it, widened);
  softmax(it.scores, it.group, it.stride, sums);
  for (int64_t g0 = 0; g0 < it.group; g0 += 3) {
    switch (std::min<int64_t>(3, it.group - g0)) {
      case 3: weigh_values<3>(it, g0, sums); break;
      case 2: weigh_values<2>(it, g0, sums); break;
      default: weigh_values<1>(it, g0, sums); break;
    }
  }
#endif
}
#endif

// Any head_dim, plain loops (what a compiler without AVX2/FMA, or an unusual head_dim, gets).
template <typename T>
void attend_generic(const Item<T>& it) {
  for (int64_t g = 0; g < it.group; ++g) {
    const float* query = it.queries + g * it.dim;
    float* s = it.scores + g * it.stride;
    float max = kMinusInf;
    for (int64_t p = 0; p < it.len; ++p) {
      float dot = 0.f;
      for (int64_t d = 0; d < it.dim; ++d) dot += query[d] * widen(it.keys[p], it.dim, d);
      s[p] = dot * it.scale;
      max = std::max(max, s[p]);
    }
    float sum = 0.f;
    float* o = it.out + g * it.dim;
    std::fill(o, o + it.dim, 0.f);
    for (int64_t p = 0; p < it.len; ++p) {
      const float prob = std::exp(s[p] - max);
      sum += prob;
      const T* value = it.keys[p] + it.value_offset;
      for (int64_t d = 0; d < it.dim; ++d) o[d] += prob * widen(value, it.dim, d);
    }
    for (int64_t d = 0; d < it.dim; ++d) o[d] /= sum;
  }
}

template <typename T>
void attend_any(const Item<T>& it, [[maybe_unused]] float* widened, [[maybe_unused]] float* sums) {  // scratch for the AVX2 path
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  switch (it.dim) {
    case 64: return attend<8, T>(it, widened, sums);
    case 128: return attend<16, T>(it, widened, sums);
    case 96: return attend<12, T>(it, widened, sums);
    case 32: return attend<4, T>(it, widened, sums);
    default: break;
  }
#endif
  attend_generic(it);
}

// keys[p] = position p's key of one kv head (head_base: the cache offset by that head), in place.
template <typename T>
void point_at_cache(const T** keys, const T* head_base, const int32_t* table_row, int64_t len, int64_t block_size, int64_t slot_stride) {
  for (int64_t start = 0; start < len; start += block_size) {
    const T* block = head_base + table_row[start / block_size] * block_size * slot_stride;
    for (int64_t i = 0, n = std::min(block_size, len - start); i < n; ++i) keys[start + i] = block + i * slot_stride;
  }
}

// What every work item of one call reads: the step's queries, the cache and each row's block table.
template <typename T>
struct Step {
  const float* q_ptr;
  const T* cache_ptr;
  const int32_t *table_ptr, *len_ptr;
  int64_t q_row, width, block_size, slot_stride, value_offset, kv_heads, heads, group, dim;
  float scale;
  int64_t batch;

  // Whether whole rows are the work items: enough rows for every thread (see the file's comment).
  bool by_row(int64_t threads) const { return batch >= kRowsPerThreadByRow * threads; }

  // A row that continues a prefill chunk: the previous row is the same request one position earlier.
  bool continues_chunk(int64_t b) const { return b > 0 && len_ptr[b] == len_ptr[b - 1] + 1 && table_ptr[b * width] == table_ptr[(b - 1) * width]; }

  // Row b's kv heads [first_head, end_head) into out (their groups' outputs, one after another). With
  // copy, the row's context is first copied, slot after slot, into this thread's scratch; with read_ahead
  // too (the thread's next row is b + 1), row b + 1's context is asked into L2 while row b computes.
  void attend_heads(int64_t b, int64_t first_head, int64_t end_head, bool copy, bool read_ahead, float* out) const {
    static thread_local std::vector<const T*> keys;  // scratch grown to the longest item met, padded to a multiple of 8
    static thread_local std::vector<float> scores, widened, sums;
    const int64_t len = len_ptr[b], stride = (len + 7) / 8 * 8, slot_bytes = slot_stride * sizeof(T);
    if (static_cast<int64_t>(keys.size()) < stride) keys.resize(stride);
    if (static_cast<int64_t>(scores.size()) < group * stride) scores.resize(group * stride);
    widened.resize(8 * dim);
    sums.resize(group);
    const T* copied = nullptr;
    static thread_local Ahead ahead;
    ahead = Ahead{};
    if (const int64_t n = b + 1; read_ahead && copy && n < batch && len_ptr[n] * slot_bytes <= kCopyMaxBytes && !continues_chunk(n)) {
      ahead.cache = reinterpret_cast<const char*>(cache_ptr);
      ahead.table = table_ptr + n * width;
      ahead.block_bytes = block_size * slot_bytes;
      ahead.blocks = (len_ptr[n] + block_size - 1) / block_size;
      ahead.last_block_bytes = (len_ptr[n] - (ahead.blocks - 1) * block_size) * slot_bytes;
    }
    if (copy && len * slot_bytes <= kCopyMaxBytes && !continues_chunk(b)) {
      char* to = copy_scratch(len * slot_bytes);
      for (int64_t start = 0; start < len; start += block_size)
        std::memcpy(to + start * slot_bytes, cache_ptr + table_ptr[b * width + start / block_size] * block_size * slot_stride,
                    std::min(block_size, len - start) * slot_bytes);
      copied = reinterpret_cast<const T*>(to);
    }
    for (int64_t h = first_head; h < end_head; ++h) {
      if (copied != nullptr) {
        for (int64_t p = 0; p < len; ++p) keys[p] = copied + p * slot_stride + h * head_stride<T>(dim);
      } else {
        point_at_cache(keys.data(), cache_ptr + h * head_stride<T>(dim), table_ptr + b * width, len, block_size, slot_stride);
      }
      std::fill(keys.begin() + len, keys.begin() + stride, keys[len - 1]);  // readable padding (scored -inf)
      const Item<T> it{q_ptr + b * q_row + h * group * dim, keys.data(), scores.data(), out + (h - first_head) * group * dim,
                       len, stride, value_offset, group, dim, scale, ahead.cache ? &ahead : nullptr};
      attend_any(it, widened.data(), sums.data());
    }
  }
};

// A step of few rows as a takeover_pool job: an item is a (row, kv head) read in place, or a whole row
// over its copied context (by_row); its output goes to scratch, then into the output. The job holds the
// tensors it reads.
template <typename T>
struct FewRowsAttention : takeover_pool::Job {
  torch::Tensor q_owner, cache_owner, tables_owner, lens_owner;
  Step<T> step;
  float* out_ptr;
  bool whole_rows;

  int64_t heads_per_item() const { return whole_rows ? step.kv_heads : 1; }
  int64_t scratch_floats() const override { return heads_per_item() * step.group * step.dim; }
  void compute(int64_t item, float* scratch) const override {
    const int64_t per = heads_per_item(), b = item * per / step.kv_heads, h = item * per % step.kv_heads;
    step.attend_heads(b, h, h + per, whole_rows, whole_rows, scratch);  // a thread takes its share's items front to back
  }
  void commit(int64_t item, const float* scratch) const override {
    const int64_t per = heads_per_item(), b = item * per / step.kv_heads, h = item * per % step.kv_heads;
    std::memcpy(out_ptr + (b * step.heads + h * step.group) * step.dim, scratch, scratch_floats() * sizeof(float));
  }
};

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [batch, heads, head_dim] float32");
  TORCH_CHECK(cache.dim() == 4 && cache.size(1) == 2 && cache.is_contiguous(), "cache must be contiguous [slots, 2, kv_heads, head_dim]");
  const bool q8 = cache.scalar_type() == torch::kInt8;
  TORCH_CHECK(cache.scalar_type() == torch::kFloat32 || cache.scalar_type() == torch::kHalf || q8, "cache must be float32, float16 or int8");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt32, "block_tables must be [batch, width] int32");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == torch::kInt32, "context_lens must be [batch] int32");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = cache.size(2), slots = cache.size(0);
  TORCH_CHECK(cache.size(3) == (q8 ? kv_q8::vector_bytes(dim) : dim) && (!q8 || dim % kv_q8::BLOCK == 0) && heads % kv_heads == 0,
              "q and cache disagree on head_dim (an int8 cache's rows: head_dim codes + head_dim / ", kv_q8::BLOCK,
              " fp16 scales, head_dim a multiple of ", kv_q8::BLOCK, "), or heads is not a multiple of kv_heads");
  TORCH_CHECK(block_tables.size(0) >= batch && context_lens.size(0) >= batch, "one block table row and one context length per request");
  const int64_t group = heads / kv_heads, width = block_tables.size(1);

  // Each row's heads contiguous is all the kernel needs: q is usually a view of the step's fused qkv
  // rows, read in place rather than copied.
  const auto qc = q.stride(2) == 1 && q.stride(1) == dim ? q : q.contiguous();
  const int64_t q_row = qc.stride(0);
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  auto out = torch::empty({batch, heads, dim}, q.options());
  const float* q_ptr = qc.data_ptr<float>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t slot_stride = 2 * kv_heads * cache.size(3), value_offset = kv_heads * cache.size(3);  // in the cache's elements
  const float fscale = static_cast<float>(scale);

  for (int64_t b = 0; b < batch; ++b) {  // checked up front: a bad plan must not read outside the cache
    const int64_t len = len_ptr[b];
    TORCH_CHECK(len >= 1 && (len + block_size - 1) / block_size <= width, "context length ", len, " of request ", b, " does not fit its block table");
    for (int64_t j = 0; j < (len + block_size - 1) / block_size; ++j) {
      const int64_t block = table_ptr[b * width + j];
      TORCH_CHECK(block >= 0 && (block + 1) * block_size <= slots, "block ", block, " is outside the KV cache");
    }
  }

  auto run = [&](const auto* cache_ptr) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(cache_ptr)>>;
    const Step<T> step{q_ptr, cache_ptr, table_ptr, len_ptr, q_row, width, block_size, slot_stride, value_offset, kv_heads, heads, group, dim, fscale, batch};
    const int64_t threads = at::get_num_threads();
    const bool by_row = step.by_row(threads);
    if (takeover_pool::runs_on_pool(batch)) {
      auto job = std::make_shared<FewRowsAttention<T>>();
      job->q_owner = qc;
      job->cache_owner = cache;
      job->tables_owner = tables;
      job->lens_owner = lens;
      job->step = step;
      job->out_ptr = out_ptr;
      job->whole_rows = by_row;
      takeover_pool::run(job, by_row ? batch : batch * kv_heads);
      return;
    }
    const int64_t items = by_row ? batch : batch * kv_heads;
    std::atomic<int64_t> next{0};
    // One call per thread; each takes items until none is left (nested in another parallel region,
    // one call takes them all).
    at::parallel_for(0, std::min<int64_t>(items, threads), 1, [&](int64_t, int64_t) {
      for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
        const int64_t b = by_row ? item : item / kv_heads, first_head = by_row ? 0 : item % kv_heads;
        step.attend_heads(b, first_head, by_row ? kv_heads : first_head + 1, by_row, false, out_ptr + (b * heads + first_head * group) * dim);
      }
    });
  };
  if (q8)
    run(cache.data_ptr<int8_t>());
  else if (cache.scalar_type() == torch::kHalf)
    run(cache.data_ptr<c10::Half>());
  else
    run(cache.data_ptr<float>());
  return out;
}
