// Paged attention for decode steps on the CPU: one query token per request, its keys and values read
// in place from the paged KV cache through the block table (no gathered copy of the context).
//
// Layout (services/worker/attention.py): cache [slots, 2, kv_heads, head_dim], position p of a request
// in slot table[p / block_size] * block_size + p % block_size. Query heads h*G .. h*G+G-1 share kv head
// h (GQA), so each (request, kv head) work item streams its keys and values once for G queries.
// Softmax is online per block: scores of one block, then one rescale of the running sums.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [batch, heads, head_dim] float32");
  TORCH_CHECK(cache.dim() == 4 && cache.size(1) == 2 && cache.scalar_type() == torch::kFloat32 && cache.is_contiguous(),
              "cache must be contiguous [slots, 2, kv_heads, head_dim] float32");
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
  const float* cache_ptr = cache.data_ptr<float>();
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

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * block_size), acc(group * dim), running_max(group), running_sum(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads, len = len_ptr[b];
      const float* queries = q_ptr + (b * heads + h * group) * dim;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(running_sum.begin(), running_sum.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const float* base = cache_ptr + table_ptr[b * width + start / block_size] * block_size * slot_stride + h * dim;
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * block_size;
          float block_max = running_max[g];
          for (int64_t i = 0; i < n; ++i) {
            s[i] = dot(queries + g * dim, base + i * slot_stride, dim) * fscale;
            block_max = std::max(block_max, s[i]);
          }
          const float correction = std::exp(running_max[g] - block_max);  // exp(-inf) = 0 on the first block
          float sum = running_sum[g] * correction;
          float* a = acc.data() + g * dim;
          if (correction != 1.f)
            for (int64_t d = 0; d < dim; ++d) a[d] *= correction;
          for (int64_t i = 0; i < n; ++i) {
            const float p = std::exp(s[i] - block_max);
            sum += p;
            axpy(a, p, base + i * slot_stride + value_offset, dim);
          }
          running_max[g] = block_max;
          running_sum[g] = sum;
        }
      }
      float* o = out_ptr + (b * heads + h * group) * dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d) o[g * dim + d] = acc[g * dim + d] / running_sum[g];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (fp32, CPU)");
}
