// The decoder's small per-layer ops on the CPU, one call each instead of a handful of torch ops (whose
// per-op dispatch costs more than their arithmetic at decode sizes). fp32 only; the torch references
// are in services/worker/fusions.py (add_rms_norm, silu_and_mul) and services/worker/rotary.py.
//
// - add_rms_norm: h = x + residual written over x, then RMSNorm(h) * weight into a new tensor.
// - silu_and_mul: silu(gate) * up of [gate | up] rows [T, 2I] -> [T, I].
// - rotary_: q and k heads rotated in place, x' = x * cos + roll(x, D/2) * sin, the sign folded into sin.
// - rms_norm_heads_: each q and k head RMSNorm-ed in place by its own weight row (Qwen3's q/k norms).
//
// Rows are split over threads only when a call has enough of them to pay for waking the pool, and never in
// a step whose big calls run on the takeover pool (csrc/takeover_pool.h).

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "avx2_exp.h"
#include "avx2_sum.h"
#include "takeover_pool.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t ELEMENTS_PER_TASK = 16384;  // below this many elements a call stays on one thread

// Items per task for a call of ``items`` items of ``item_elements`` each, in a step of ``rows`` rows: all of
// them (one thread) for a small call, or for any call of a step whose big calls run on the takeover pool.
int64_t grain(int64_t items, int64_t rows, int64_t item_elements) {
  if (takeover_pool::keeps_to_caller(rows)) return std::max<int64_t>(items, 1);
  return std::max<int64_t>(1, ELEMENTS_PER_TASK / std::max<int64_t>(item_elements, 1));
}

// h[i] = x[i] + r[i] stored over x (r null: h = x, read only); returns sum(h[i]^2).
float add_and_square_sum(float* x, const float* r, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m256 h0 = _mm256_loadu_ps(x + i), h1 = _mm256_loadu_ps(x + i + 8);
    if (r != nullptr) {
      h0 = _mm256_add_ps(h0, _mm256_loadu_ps(r + i));
      h1 = _mm256_add_ps(h1, _mm256_loadu_ps(r + i + 8));
      _mm256_storeu_ps(x + i, h0);
      _mm256_storeu_ps(x + i + 8, h1);
    }
    acc0 = _mm256_fmadd_ps(h0, h0, acc0);
    acc1 = _mm256_fmadd_ps(h1, h1, acc1);
  }
  sum = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) {
    const float h = r != nullptr ? (x[i] = x[i] + r[i]) : x[i];
    sum += h * h;
  }
  return sum;
}

void scale_by_weight(const float* h, const float* w, float inv, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(h + i), inv8), _mm256_loadu_ps(w + i)));
#endif
  for (; i < n; ++i) out[i] = h[i] * inv * w[i];
}

void silu_and_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // sigmoid(g) from e = exp(-|g|) <= 1 (no overflow): 1 / (1 + e) for g >= 0, e / (1 + e) below.
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_or_ps(g, sign));  // exp(-|g|)
    const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = gate[i], e = std::exp(-std::fabs(g));
    out[i] = g * ((g >= 0.f ? 1.f : e) / (1.f + e)) * up[i];
  }
}

// One head of `dim` (even) elements: x[i] = x[i] c[i] + x[i ± dim/2] s[i], both halves read before either is written.
void rotate_head(float* x, const float* c, const float* s, int64_t dim) {
  const int64_t half = dim / 2;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= half; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
    _mm256_storeu_ps(x + i, _mm256_fmadd_ps(b, _mm256_loadu_ps(s + i), _mm256_mul_ps(a, _mm256_loadu_ps(c + i))));
    _mm256_storeu_ps(x + half + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(s + half + i), _mm256_mul_ps(b, _mm256_loadu_ps(c + half + i))));
  }
#endif
  for (; i < half; ++i) {
    const float a = x[i], b = x[half + i];
    x[i] = a * c[i] + b * s[i];
    x[half + i] = b * c[half + i] + a * s[half + i];
  }
}

void check_float_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

// Rows [T, n] with unit inner stride and no two elements sharing memory (copied to such if not); the row stride is then stride(0).
torch::Tensor unit_inner_stride(const torch::Tensor& t) {
  return t.stride(-1) == 1 && at::has_internal_overlap(t) != at::MemOverlap::Yes ? t : t.contiguous();
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x_in, const std::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                                                      double eps) {
  check_float_cpu(x_in, "x");
  check_float_cpu(weight, "weight");
  TORCH_CHECK(x_in.dim() == 2, "x must be [rows, hidden], got ", x_in.dim(), " dims");
  const int64_t rows = x_in.size(0), hidden = x_in.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, "weight of shape ", weight.sizes(), " does not fit rows of ", hidden);
  // h is written over x: over the caller's tensor when its rows have unit stride, else over a copy.
  torch::Tensor x = unit_inner_stride(x_in), r;
  if (residual.has_value()) {
    check_float_cpu(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual of shape ", residual->sizes(), " does not match x's ", x.sizes());
    r = unit_inner_stride(*residual);
  }
  const auto w = weight.contiguous();
  auto out = torch::empty({rows, hidden}, x.options());
  float* x_ptr = x.data_ptr<float>();
  const float* r_ptr = r.defined() ? r.data_ptr<float>() : nullptr;
  const float* w_ptr = w.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), r_stride = r.defined() ? r.stride(0) : 0;
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(rows, rows, hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* h = x_ptr + t * x_stride;
      const float squares = add_and_square_sum(h, r_ptr ? r_ptr + t * r_stride : nullptr, hidden);
      scale_by_weight(h, w_ptr, 1.f / std::sqrt(squares / static_cast<float>(hidden) + epsf), o_ptr + t * hidden, hidden);
    }
  });
  return {out, x};
}

void rms_norm_heads_(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_float_cpu(x, "x");
  check_float_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 3, "x must be [tokens, heads, head_dim], got ", x.dim(), " dims");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == heads && weight.size(1) == dim, "weight must be [heads, head_dim] = [", heads, ", ", dim, "], got ",
              weight.sizes());
  TORCH_CHECK(x.stride(2) == 1 && at::has_internal_overlap(x) != at::MemOverlap::Yes, "x is normed in place, so its heads need unit stride and their own memory");
  const auto w = weight.contiguous();
  float* x_ptr = x.data_ptr<float>();
  const float* w_ptr = w.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, tokens * heads, grain(tokens * heads, tokens, dim), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % heads;
      float* head = x_ptr + (item / heads) * token_stride + h * head_stride;
      const float squares = add_and_square_sum(head, nullptr, dim);
      scale_by_weight(head, w_ptr + h * dim, 1.f / std::sqrt(squares / static_cast<float>(dim) + epsf), head, dim);
    }
  });
}

torch::Tensor silu_and_mul(const torch::Tensor& gate_up_in) {
  check_float_cpu(gate_up_in, "gate_up");
  TORCH_CHECK(gate_up_in.dim() == 2, "gate_up must be [rows, 2 * intermediate], got ", gate_up_in.dim(), " dims");
  TORCH_CHECK(gate_up_in.size(1) % 2 == 0, "silu_and_mul needs [gate | up] rows of even width, got ", gate_up_in.size(1));
  const auto gate_up = unit_inner_stride(gate_up_in);
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({rows, inter}, gate_up.options());
  const float* in_ptr = gate_up.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(rows, rows, inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_and_mul_row(in_ptr + t * stride, in_ptr + t * stride + inter, o_ptr + t * inter, inter);
  });
  return out;
}

void rotary_(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_float_cpu(x, "x");
  check_float_cpu(cos, "cos");
  check_float_cpu(sin, "sin");
  TORCH_CHECK(x.dim() == 3, "x must be [tokens, heads, rotary_dim], got ", x.dim(), " dims");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "rotary needs an even rotary_dim, got ", dim);
  TORCH_CHECK(x.stride(2) == 1 && at::has_internal_overlap(x) != at::MemOverlap::Yes, "x is rotated in place, so its heads need unit stride and their own memory");
  for (const auto* table : {&cos, &sin}) {  // [T, 1, D] (RotaryEmbedding.lookup) or [T, D]: one row per token, shared by its heads
    const auto& t = *table;
    TORCH_CHECK((t.dim() == 3 && t.size(1) == 1) || t.dim() == 2, "cos/sin must be [tokens, 1, rotary_dim] or [tokens, rotary_dim], got ", t.sizes());
    TORCH_CHECK(t.size(0) == tokens && t.size(-1) == dim, "cos/sin of shape ", t.sizes(), " do not fit x of shape ", x.sizes());
  }
  const auto c = cos.reshape({tokens, dim}).contiguous(), s = sin.reshape({tokens, dim}).contiguous();
  float* x_ptr = x.data_ptr<float>();
  const float* c_ptr = c.data_ptr<float>();
  const float* s_ptr = s.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, tokens * heads, grain(tokens * heads, tokens, dim), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads;
      rotate_head(x_ptr + t * token_stride + h * head_stride, c_ptr + t * dim, s_ptr + t * dim, dim);
    }
  });
}
