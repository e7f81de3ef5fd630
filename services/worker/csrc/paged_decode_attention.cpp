// Paged attention for decode steps on the CPU: one query token per request, its keys and values read
// in place from the paged KV cache through the block table (no gathered copy of the context).
//
// Layout (services/worker/attention.py): cache [slots, 2, kv_heads, head_dim], position p of a request
// in slot table[p / block_size] * block_size + p % block_size. Query heads h*G .. h*G+G-1 share kv head
// h (GQA), so each (request, kv head) work item streams its keys and values once for G queries.
// Softmax is online per block: scores of one block, then one rescale of the running sums.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "avx2_exp.h"
#include "avx2_sum.h"

#include <algorithm>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// One (request, kv head) work item: its `group` query heads attend over `len` positions, block by block.
// Scratch: scores [group * block_size], acc [group * dim].
template <typename T>  // the cache's element type: float, or c10::Half (fp16 storage, fp32 arithmetic)
struct Item {
  const float* queries;  // [group, dim]
  const T* cache;
  const int32_t* table;
  int64_t len, block_size, slot_stride, value_offset, group, dim;
  float scale;
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// R = dim / 8 registers per row: the query stays in registers while it meets every key of a block,
// the head's output accumulator while it takes every value.
template <int R, typename T>
void attend(const Item<T>& it, float* scores, float* acc, float* running_max, float* running_sum) {
  for (int64_t start = 0; start < it.len; start += it.block_size) {
    const int64_t n = std::min(it.block_size, it.len - start);
    const T* base = it.cache + it.table[start / it.block_size] * it.block_size * it.slot_stride;
    for (int64_t g = 0; g < it.group; ++g) {
      float* s = scores + g * it.block_size;
      __m256 q[R];
      for (int r = 0; r < R; ++r) q[r] = _mm256_loadu_ps(it.queries + g * it.dim + 8 * r);
      float block_max = running_max[g];
      for (int64_t i = 0; i < n; ++i) {
        const T* key = base + i * it.slot_stride;
        __m256 d0 = _mm256_mul_ps(q[0], load8(key));
        __m256 d1 = R > 1 ? _mm256_mul_ps(q[1], load8(key + 8)) : _mm256_setzero_ps();
        for (int r = 2; r + 1 < R; r += 2) {
          d0 = _mm256_fmadd_ps(q[r], load8(key + 8 * r), d0);
          d1 = _mm256_fmadd_ps(q[r + 1], load8(key + 8 * r + 8), d1);
        }
        if (R > 2 && R % 2) d0 = _mm256_fmadd_ps(q[R - 1], load8(key + 8 * (R - 1)), d0);
        s[i] = hsum(_mm256_add_ps(d0, d1)) * it.scale;
        block_max = std::max(block_max, s[i]);
      }
      const __m256 m = _mm256_set1_ps(block_max);
      __m256 block_sum = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
        _mm256_storeu_ps(s + i, p);
        block_sum = _mm256_add_ps(block_sum, p);
      }
      float sum = hsum(block_sum);
      for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - block_max));
      const float correction = std::exp(running_max[g] - block_max);  // exp(-inf) = 0 on the first block
      running_sum[g] = running_sum[g] * correction + sum;
      running_max[g] = block_max;
      __m256 a[R];
      const __m256 c = _mm256_set1_ps(correction);
      for (int r = 0; r < R; ++r) a[r] = _mm256_mul_ps(c, _mm256_loadu_ps(acc + g * it.dim + 8 * r));
      for (int64_t j = 0; j < n; ++j) {
        const T* value = base + j * it.slot_stride + it.value_offset;
        const __m256 p = _mm256_set1_ps(s[j]);
        for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(p, load8(value + 8 * r), a[r]);
      }
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + g * it.dim + 8 * r, a[r]);
    }
  }
}
#endif

// Any head_dim, plain loops (what a compiler without AVX2/FMA, or an unusual head_dim, gets).
template <typename T>
void attend_generic(const Item<T>& it, float* scores, float* acc, float* running_max, float* running_sum) {
  for (int64_t start = 0; start < it.len; start += it.block_size) {
    const int64_t n = std::min(it.block_size, it.len - start);
    const T* base = it.cache + it.table[start / it.block_size] * it.block_size * it.slot_stride;
    for (int64_t g = 0; g < it.group; ++g) {
      float* s = scores + g * it.block_size;
      const float* query = it.queries + g * it.dim;
      float block_max = running_max[g];
      for (int64_t i = 0; i < n; ++i) {
        const T* key = base + i * it.slot_stride;
        float dot = 0.f;
        for (int64_t d = 0; d < it.dim; ++d) dot += query[d] * static_cast<float>(key[d]);
        s[i] = dot * it.scale;
        block_max = std::max(block_max, s[i]);
      }
      const float correction = std::exp(running_max[g] - block_max);
      float sum = running_sum[g] * correction;
      float* a = acc + g * it.dim;
      for (int64_t d = 0; d < it.dim; ++d) a[d] *= correction;
      for (int64_t i = 0; i < n; ++i) {
        const float p = std::exp(s[i] - block_max);
        sum += p;
        const T* value = base + i * it.slot_stride + it.value_offset;
        for (int64_t d = 0; d < it.dim; ++d) a[d] += p * static_cast<float>(value[d]);
      }
      running_max[g] = block_max;
      running_sum[g] = sum;
    }
  }
}

template <typename T>
void attend_any(const Item<T>& it, float* scores, float* acc, float* running_max, float* running_sum) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  switch (it.dim) {
    case 64: return attend<8, T>(it, scores, acc, running_max, running_sum);
    case 128: return attend<16, T>(it, scores, acc, running_max, running_sum);
    case 96: return attend<12, T>(it, scores, acc, running_max, running_sum);
    case 32: return attend<4, T>(it, scores, acc, running_max, running_sum);
    default: break;
  }
#endif
  attend_generic(it, scores, acc, running_max, running_sum);
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [batch, heads, head_dim] float32");
  TORCH_CHECK(cache.dim() == 4 && cache.size(1) == 2 && cache.is_contiguous(), "cache must be contiguous [slots, 2, kv_heads, head_dim]");
  TORCH_CHECK(cache.scalar_type() == torch::kFloat32 || cache.scalar_type() == torch::kHalf, "cache must be float32 or float16");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt32, "block_tables must be [batch, width] int32");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == torch::kInt32, "context_lens must be [batch] int32");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = cache.size(2), slots = cache.size(0);
  TORCH_CHECK(cache.size(3) == dim && heads % kv_heads == 0, "q and cache disagree on head_dim, or heads is not a multiple of kv_heads");
  TORCH_CHECK(block_tables.size(0) >= batch && context_lens.size(0) >= batch, "one block table row and one context length per request");
  const int64_t group = heads / kv_heads, width = block_tables.size(1);

  const auto qc = q.contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  auto out = torch::empty_like(qc);
  const float* q_ptr = qc.data_ptr<float>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t slot_stride = 2 * kv_heads * dim, value_offset = kv_heads * dim;
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
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(group * block_size), acc(group * dim), running_max(group), running_sum(group);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / kv_heads, h = item % kv_heads;
        const Item<T> it{q_ptr + (b * heads + h * group) * dim, cache_ptr + h * dim, table_ptr + b * width, len_ptr[b], block_size, slot_stride, value_offset, group, dim, fscale};
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
        std::fill(running_sum.begin(), running_sum.end(), 0.f);
        attend_any(it, scores.data(), acc.data(), running_max.data(), running_sum.data());
        float* o = out_ptr + (b * heads + h * group) * dim;
        for (int64_t g = 0; g < group; ++g)
          for (int64_t d = 0; d < dim; ++d) o[g * dim + d] = acc[g * dim + d] / running_sum[g];
      }
    });
  };
  if (cache.scalar_type() == torch::kHalf)
    run(cache.data_ptr<c10::Half>());
  else
    run(cache.data_ptr<float>());
  return out;
}
