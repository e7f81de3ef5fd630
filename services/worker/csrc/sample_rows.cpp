// Each row's token from fp32 logits, on the CPU: greedy argmax (temperature 0), and temperature sampling
// with top-k, top-p and min-p, as services/worker/sampling.py defines them.
//
// Greedy: torch.argmax(dim=-1)'s answer (the first index of the largest value; a row holding NaN answers
// its first NaN), eight lanes at a time: torch's CPU reduction reads ~7 GB/s (0.85 ms for 32 rows of a
// 49152-token vocabulary), this ~5x faster (0.16 ms).
//
// Temperature: one row in a few passes over its vocabulary, no sort. The scaled logits s = logits / T
// and their weights w = exp(s - max). A row without a cut (top-k, top-p, min-p) draws over every token;
// a row with one finds it among candidates, the tokens within a span of the largest s (widened until
// they hold it), reading the whole row only to compare logits, and to weigh it for top-p without top-k.
// One uniform draw u then picks, in vocabulary order, the first kept token whose running weight exceeds
// u times the kept total (an inverse-CDF draw: exactly the distribution, with one random number per
// row). torch's ops took ~2.2 ms a row at temperature 1 (its exponential_ over the whole vocabulary) and
// ~3.5 ms with top-p; this takes 0.03-0.1 ms.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "avx2_exp.h"
#include "avx2_sum.h"
#include "kernels.h"
#include "takeover_pool.h"

namespace {

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (std::isnan(x[j])) return j;
  return -1;
}

int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float best_value = -std::numeric_limits<float>::infinity();
#if defined(__AVX2__)
  if (n >= 8) {
    // Per lane: the largest value met and the first position holding it (only a strictly larger value
    // replaces it, so ties keep the earlier position); a NaN anywhere sends the row to first_nan.
    __m256 values = _mm256_loadu_ps(x), nan_seen = _mm256_cmp_ps(values, values, _CMP_UNORD_Q);
    __m256i positions = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = positions;
    const __m256i step = _mm256_set1_epi32(8);
    for (i = 8; i + 8 <= n; i += 8) {
      at = _mm256_add_epi32(at, step);
      const __m256 v = _mm256_loadu_ps(x + i);
      nan_seen = _mm256_or_ps(nan_seen, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 larger = _mm256_cmp_ps(v, values, _CMP_GT_OQ);
      values = _mm256_blendv_ps(values, v, larger);
      positions = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(positions), _mm256_castsi256_ps(at), larger));
    }
    if (_mm256_movemask_ps(nan_seen) != 0) return first_nan(x, n);
    alignas(32) float lane_values[8];
    alignas(32) int32_t lane_positions[8];
    _mm256_store_ps(lane_values, values);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_positions), positions);
    best_value = lane_values[0], best = lane_positions[0];
    for (int l = 1; l < 8; ++l)
      if (lane_values[l] > best_value || (lane_values[l] == best_value && lane_positions[l] < best)) best_value = lane_values[l], best = lane_positions[l];
  }
#endif
  for (; i < n; ++i) {  // the tail (or the whole row): positions after every one already met
    if (std::isnan(x[i])) return i;
    if (x[i] > best_value) best_value = x[i], best = i;
  }
  return best;
}

// Temperature sampling. ----------------------------------------------------------------------------
//
// A row without a cut (top-k, top-p, min-p) is drawn over its whole vocabulary: s = x / t and
// w = exp(s - largest) into arrays, then a walk. A row with one keeps a prefix of its descending order,
// looked for among candidates, the tokens whose s lies within a span of the largest: the span starts at
// FIRST_SPAN and grows by SPAN_GROWTH until the candidates hold the cut, and the draw walks the kept
// tokens alone. On the default model's logits at temperature 0.8-1 the tokens within 4 nats number ~5 and
// hold ~80 % of the weight, within 8 ~20-60 holding ~96 %, within 16 hundreds to tens of thousands: so
// the spans start small, and a pass over the row only compares logits. A flat row (a high temperature,
// random logits), whose candidates or kept tokens would be more than a quarter of it, is cut and drawn
// over the whole row's arrays instead.
constexpr float FIRST_SPAN = 4.0f, SPAN_GROWTH = 1.5f, MAX_SPAN = 64.0f;

struct Candidate {
  float s;  // the scaled logit
  float w;  // exp(s - the row's largest)
};

struct RowFilter {
  float temperature;
  int64_t top_k;  // the vocabulary when unset
  float top_p;    // 1 when unset
  float min_p;    // 0 when unset
  double uniform;  // the row's draw, in [0, 1)

  bool cuts(int64_t n) const { return top_k < n || top_p < 1.0f; }
};

// One thread's buffers for a row: reused from call to call.
struct RowScratch {
  std::vector<float> scaled, weights;  // a row drawn over its whole vocabulary
  std::vector<Candidate> candidates;   // the tokens a cut is selected among; then the kept ones
  std::vector<int32_t> kept_tokens;    // the kept ones' tokens
  std::vector<int32_t> order;          // logprobs: candidates by rank
};

RowScratch& row_scratch() {
  thread_local RowScratch scratch;
  return scratch;
}

// The largest scaled logit x / t (division is monotonic: the largest x's, divided as torch divides);
// false when x holds NaN or that value is not finite (+inf, or every token -inf): not drawable.
bool largest_scaled(const float* x, int64_t n, float t, float& largest) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX2__)
  __m256 lanes = _mm256_set1_ps(best), nan_seen = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan_seen = _mm256_or_ps(nan_seen, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    lanes = _mm256_max_ps(lanes, v);
  }
  if (_mm256_movemask_ps(nan_seen) != 0) return false;
  alignas(32) float lane[8];
  _mm256_store_ps(lane, lanes);
  for (float v : lane) best = std::max(best, v);
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return false;
    best = std::max(best, x[i]);
  }
  largest = best / t;
  return std::isfinite(largest);
}

// s = x / t and w = exp(s - largest) of every token into s and w (each when given); returns the sum of
// the weights, in blocks of eight as draw_whole_row walks them.
double weigh_row(const float* x, int64_t n, float t, float largest, float* s, float* w) {
  int64_t i = 0;
  double total = 0.0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 divisor = _mm256_set1_ps(t), shift = _mm256_set1_ps(largest);
  for (; i + 8 <= n; i += 8) {
    const __m256 scaled = _mm256_div_ps(_mm256_loadu_ps(x + i), divisor);
    const __m256 v = exp8(_mm256_sub_ps(scaled, shift));
    if (s != nullptr) _mm256_storeu_ps(s + i, scaled);
    if (w != nullptr) _mm256_storeu_ps(w + i, v);
    total += hsum(v);
  }
#endif
  for (; i < n; ++i) {
    const float scaled = x[i] / t, v = std::exp(scaled - largest);
    if (s != nullptr) s[i] = scaled;
    if (w != nullptr) w[i] = v;
    total += v;
  }
  return total;
}

// The weights of c[0, size), from their scaled logits.
void weigh_candidates(Candidate* c, size_t size, float largest) {
  size_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  alignas(32) float lane[8];
  for (; j < size; j += 8) {
    const size_t count = std::min<size_t>(8, size - j);
    for (size_t l = 0; l < 8; ++l) lane[l] = l < count ? c[j + l].s - largest : -std::numeric_limits<float>::infinity();
    _mm256_store_ps(lane, exp8(_mm256_load_ps(lane)));
    for (size_t l = 0; l < count; ++l) c[j + l].w = lane[l];
  }
#endif
  for (; j < size; ++j) c[j].w = std::exp(c[j].s - largest);
}

double weight_of(const Candidate* c, int64_t begin, int64_t end) {
  double mass = 0.0;
  for (int64_t j = begin; j < end; ++j) mass += c[j].w;
  return mass;
}

// The tokens whose scaled logit x / t is at least `bound`, in vocabulary order, as candidates (not yet
// weighed: a cut needs the weights of a few of them only), their tokens into `tokens` when given; false,
// with the gathering cut short, when they are more than `limit`. A pass compares x itself against a
// floor below which x / t < bound (bound * t, lowered by far more than the two roundings), and divides
// only the blocks above it.
bool gather_candidates(const float* x, int64_t n, float t, float bound, size_t limit, std::vector<Candidate>& out, std::vector<int32_t>* tokens = nullptr) {
  out.clear();
  if (tokens != nullptr) tokens->clear();
  const float xt = bound * t;
  const float floor = std::isinf(bound) ? bound : xt - (std::fabs(xt) * 0x1p-20f + t * 0x1p-120f);
  auto keep = [&](float s, int64_t j) {
    out.push_back({s, 0.0f});
    if (tokens != nullptr) tokens->push_back(static_cast<int32_t>(j));
  };
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 threshold = _mm256_set1_ps(floor), divisor = _mm256_set1_ps(t), least = _mm256_set1_ps(bound);
  alignas(32) float lane[8];
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, threshold, _CMP_GE_OQ)) == 0) continue;
    const __m256 scaled = _mm256_div_ps(v, divisor);  // correctly rounded: the scalar division's values
    _mm256_store_ps(lane, scaled);
    for (int mask = _mm256_movemask_ps(_mm256_cmp_ps(scaled, least, _CMP_GE_OQ)); mask != 0; mask &= mask - 1) keep(lane[__builtin_ctz(mask)], i + __builtin_ctz(mask));
    if (out.size() > limit) return false;
  }
#endif
  for (; i < n; ++i)
    if (x[i] >= floor && x[i] / t >= bound) keep(x[i] / t, i);
  return out.size() <= limit;
}

// Candidates from spans of FIRST_SPAN, then SPAN_GROWTH times wider, below the largest scaled logit (past
// MAX_SPAN: the whole row), until enough() says they hold what is looked for (it is asked of every span's
// candidates, the whole row's too); false when a span's candidates would be more than limit.
template <typename Enough>
bool gather_widening(const float* x, int64_t n, float t, float largest, size_t limit, std::vector<Candidate>& c, std::vector<int32_t>* tokens,
                     Enough enough) {
  for (float span = FIRST_SPAN;; span *= SPAN_GROWTH) {
    const float bound = span > MAX_SPAN ? -std::numeric_limits<float>::infinity() : largest - span;
    if (!gather_candidates(x, n, t, bound, limit, c, tokens)) return false;
    if (enough() || std::isinf(bound)) return true;
  }
}

// The smallest scaled logit of the shortest descending prefix of c[0, count) whose weight reaches
// `target`: a token stays while the weight ranked above it is below target (the first always stays).
// A quickselect on weight: c is reordered.
float top_p_cut(Candidate* c, int64_t count, double target) {
  if (!(target > 0.0))  // top_p 0: the most likely token alone
    return std::max_element(c, c + count, [](const Candidate& x, const Candidate& y) { return x.s < y.s; })->s;
  int64_t lo = 0, hi = count;
  double above = 0.0;  // the weight of the tokens ranked above c[lo, hi), all kept
  float smallest_kept = std::numeric_limits<float>::infinity();
  while (hi - lo > 16) {
    const float a = c[lo].s, b = c[lo + (hi - lo) / 2].s, d = c[hi - 1].s;
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), d));  // the median of three
    // [lo, greater) > pivot, [greater, i) == pivot, [i, less) unread, [less, hi) < pivot.
    int64_t greater = lo, i = lo, less = hi;
    while (i < less) {
      if (c[i].s > pivot)
        std::swap(c[i++], c[greater++]);
      else if (c[i].s < pivot)
        std::swap(c[i], c[--less]);
      else
        ++i;
    }
    const double greater_mass = weight_of(c, lo, greater);
    if (above + greater_mass >= target) {
      hi = greater;
      continue;
    }
    const double through_ties = above + greater_mass + weight_of(c, greater, less);
    if (through_ties >= target) return pivot;  // the prefix ends among the ties
    above = through_ties;
    smallest_kept = pivot;
    lo = less;
  }
  std::sort(c + lo, c + hi, [](const Candidate& x, const Candidate& y) { return x.s > y.s; });
  for (int64_t j = lo; j < hi && above < target; ++j) smallest_kept = c[j].s, above += c[j].w;
  return smallest_kept;  // the whole range when rounding left the target unreached
}

// The smallest scaled logit that top-k, then top-p (of the top-k renormalised), keep, selected among
// candidates c holding that prefix, weighed when the row has top-p without top-k (c is reordered).
// total: the whole row's weight (read for top-p without top-k only).
float cut_among(std::vector<Candidate>& c, int64_t n, float largest, double total, const RowFilter& f) {
  const bool top_k = f.top_k < n, top_p = f.top_p < 1.0f;
  int64_t count = static_cast<int64_t>(c.size());
  double normaliser = total;
  if (top_k) {
    auto by_value = [](const Candidate& a, const Candidate& b) { return a.s > b.s; };
    std::nth_element(c.begin(), c.begin() + (f.top_k - 1), c.end(), by_value);
    if (!top_p) return c[f.top_k - 1].s;
    count = f.top_k;
    weigh_candidates(c.data(), count, largest);
    normaliser = weight_of(c.data(), 0, count);
  }
  return top_p_cut(c.data(), count, static_cast<double>(f.top_p) * normaliser);
}

// A drawable row: drawn over the tokens whose scaled logit is at least keep_from, either gathered (the
// scratch's candidates, weighed, and kept_tokens) or in the whole row's arrays (scratch.scaled and
// weights; total: their weight). Not drawable (NaN, +inf, or only -inf): the row answers as greedy does.
struct PreparedRow {
  bool drawable;
  bool gathered;
  float keep_from;  // -inf: every token
  double total;
};

// min-p: p >= min_p * p_max  <=>  s >= largest + log(min_p), in float as sampling.py computes it.
float min_p_floor(float largest, const RowFilter& f) {
  return f.min_p > 0.0f ? largest + std::log(f.min_p) : -std::numeric_limits<float>::infinity();
}

// A row with a cut or min-p, among candidates: false when they, or the kept tokens, would be more than
// `limit` (a flat row, or a top_k past it). top-k stops the widening once the candidates number top_k,
// top-p once they hold top_p of the row's weight.
bool prepare_among_candidates(const float* x, int64_t n, float largest, const RowFilter& f, size_t limit, RowScratch& scratch, float& keep_from) {
  std::vector<Candidate>& c = scratch.candidates;
  const bool top_k = f.top_k < n;
  if (top_k && f.top_k > static_cast<int64_t>(limit)) return false;
  keep_from = -std::numeric_limits<float>::infinity();
  if (f.cuts(n)) {
    const double total = top_k ? 0.0 : weigh_row(x, n, f.temperature, largest, nullptr, nullptr);
    const bool held = gather_widening(x, n, f.temperature, largest, limit, c, nullptr, [&] {
      if (top_k) return static_cast<int64_t>(c.size()) >= f.top_k;
      weigh_candidates(c.data(), c.size(), largest);  // top-p of the whole row: the candidates' weight
      return weight_of(c.data(), 0, static_cast<int64_t>(c.size())) >= static_cast<double>(f.top_p) * total;
    });
    if (!held) return false;
    keep_from = cut_among(c, n, largest, total, f);
  }
  keep_from = std::max(keep_from, min_p_floor(largest, f));
  if (!gather_candidates(x, n, f.temperature, keep_from, limit, c, &scratch.kept_tokens)) return false;
  weigh_candidates(c.data(), c.size(), largest);
  return true;
}

PreparedRow prepare_row(const float* x, int64_t n, const RowFilter& f) {
  RowScratch& scratch = row_scratch();
  float largest, keep_from;
  if (!largest_scaled(x, n, f.temperature, largest)) return {false, false, 0.0f, 0.0};
  const bool cut = f.cuts(n) || f.min_p > 0.0f;
  if (cut && prepare_among_candidates(x, n, largest, f, static_cast<size_t>(n / 4), scratch, keep_from)) return {true, true, keep_from, 0.0};
  scratch.scaled.resize(n);
  scratch.weights.resize(n);
  const float *s = scratch.scaled.data(), *w = scratch.weights.data();
  const double total = weigh_row(x, n, f.temperature, largest, scratch.scaled.data(), scratch.weights.data());
  keep_from = min_p_floor(largest, f);
  if (f.cuts(n)) {
    std::vector<Candidate>& c = scratch.candidates;
    c.resize(n);
    for (int64_t j = 0; j < n; ++j) c[j] = {s[j], w[j]};
    keep_from = std::max(keep_from, cut_among(c, n, largest, total, f));
  }
  return {true, false, keep_from, total};
}

// The kept tokens' weight in the whole row's arrays, summed in blocks of eight as draw_whole_row walks them.
double kept_weight(const float* s, const float* w, int64_t n, float keep_from) {
  double total = 0.0;
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 threshold = _mm256_set1_ps(keep_from);
  for (; i + 8 <= n; i += 8) total += hsum(_mm256_and_ps(_mm256_loadu_ps(w + i), _mm256_cmp_ps(_mm256_loadu_ps(s + i), threshold, _CMP_GE_OQ)));
#endif
  for (; i < n; ++i)
    if (s[i] >= keep_from) total += w[i];
  return total;
}

// In the whole row's arrays, the first kept token whose running weight exceeds target (the last kept
// one if rounding leaves it unmet).
int64_t draw_whole_row(const float* s, const float* w, int64_t n, float keep_from, double target) {
  double running = 0.0;
  int64_t i = 0, last_kept = -1;
#if defined(__AVX2__)
  const __m256 threshold = _mm256_set1_ps(keep_from);
  for (; i + 8 <= n; i += 8) {
    const __m256 kept = _mm256_cmp_ps(_mm256_loadu_ps(s + i), threshold, _CMP_GE_OQ);
    const int lanes = _mm256_movemask_ps(kept);
    if (lanes == 0) continue;
    const double block = hsum(_mm256_and_ps(_mm256_loadu_ps(w + i), kept));
    if (running + block <= target) {
      running += block;
      last_kept = i + 31 - __builtin_clz(static_cast<unsigned>(lanes));
      continue;
    }
    for (int64_t j = i; j < i + 8; ++j)
      if (s[j] >= keep_from) {
        last_kept = j;
        if ((running += w[j]) > target) return j;
      }
  }
#endif
  for (; i < n; ++i)
    if (s[i] >= keep_from) {
      last_kept = i;
      if ((running += w[i]) > target) return i;
    }
  return last_kept;
}

// Among the gathered kept tokens (in vocabulary order), the first whose running weight exceeds target
// (the last if rounding leaves it unmet; -1 when none is kept).
int64_t draw_gathered(const RowScratch& scratch, double uniform) {
  const std::vector<Candidate>& kept = scratch.candidates;
  const double target = uniform * weight_of(kept.data(), 0, static_cast<int64_t>(kept.size()));
  double running = 0.0;
  for (size_t j = 0; j < kept.size(); ++j)
    if ((running += kept[j].w) > target) return scratch.kept_tokens[j];
  return kept.empty() ? -1 : scratch.kept_tokens.back();
}

int64_t sample_row(const float* x, int64_t n, const RowFilter& f) {
  if (!(f.temperature > 0.0f)) return argmax_row(x, n);
  const PreparedRow row = prepare_row(x, n, f);
  if (!row.drawable) return argmax_row(x, n);
  const RowScratch& scratch = row_scratch();
  int64_t token;
  if (row.gathered) {
    token = draw_gathered(scratch, f.uniform);
  } else {
    const float *s = scratch.scaled.data(), *w = scratch.weights.data();
    const double kept = std::isinf(row.keep_from) ? row.total : kept_weight(s, w, n, row.keep_from);
    token = draw_whole_row(s, w, n, row.keep_from, f.uniform * kept);
  }
  return token >= 0 ? token : argmax_row(x, n);  // nothing kept (a min_p above 1): the most likely token
}

// A token per row, row_token(row) each, as a takeover_pool job for a few rows (a step whose other kernels
// run on the pool must not wake OpenMP's threads, whose spinning would then compete with the pool's
// helpers): an item is a row, its token passed through scratch. The job owns the logits and row_token's
// captures, which a helper taken over may still read after the call returned.
template <typename RowToken>
struct FewRowsTokens : takeover_pool::Job {
  FewRowsTokens(torch::Tensor logits, RowToken row_token, int64_t* dst) : logits_owner(std::move(logits)), row_token(std::move(row_token)), dst(dst) {}

  torch::Tensor logits_owner;
  RowToken row_token;
  int64_t* dst;

  int64_t scratch_floats() const override { return sizeof(int64_t) / sizeof(float); }
  void compute(int64_t item, float* scratch) const override {
    const int64_t token = row_token(item);
    std::memcpy(scratch, &token, sizeof token);
  }
  void commit(int64_t item, const float* scratch) const override { std::memcpy(dst + item, scratch, sizeof(int64_t)); }
};

// [rows] int64: row_token(row) for each row of x, on the pool for a few rows, else on OpenMP's threads.
template <typename RowToken>
torch::Tensor tokens_of_rows(const torch::Tensor& x, RowToken row_token) {
  const int64_t rows = x.size(0);
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  if (takeover_pool::runs_on_pool(rows)) {
    takeover_pool::run(std::make_shared<FewRowsTokens<RowToken>>(x, std::move(row_token), dst), rows);
    return out;
  }
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = row_token(r);
  });
  return out;
}

}  // namespace

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.size(1) >= 1, "logits must be [rows, vocab] float32");
  TORCH_CHECK(logits.size(1) <= std::numeric_limits<int32_t>::max(), "a vocabulary of at most 2^31 - 1 entries");
  const auto x = logits.contiguous();
  return tokens_of_rows(x, [src = x.data_ptr<float>(), n = x.size(1)](int64_t r) { return argmax_row(src + r * n, n); });
}

namespace {

// Each row's filter from the per-row lists (a top_k of 0 or past the vocabulary: the vocabulary).
std::vector<RowFilter> row_filters(const torch::Tensor& logits, const std::vector<double>& temperature, const std::vector<int64_t>& top_k,
                                   const std::vector<double>& top_p, const std::vector<double>& min_p, const std::vector<double>& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.size(1) >= 1, "logits must be [rows, vocab] float32");
  const int64_t rows = logits.size(0), n = logits.size(1);
  for (const size_t size : {temperature.size(), top_k.size(), top_p.size(), min_p.size(), uniform.size()})
    TORCH_CHECK(static_cast<int64_t>(size) == rows, "temperature, top_k, top_p, min_p and uniform must hold one value per row");
  std::vector<RowFilter> filters(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t k = top_k[r] > 0 && top_k[r] < n ? top_k[r] : n;
    filters[r] = {static_cast<float>(temperature[r]), k, static_cast<float>(top_p[r]), static_cast<float>(min_p[r]), uniform[r]};
  }
  return filters;
}

}  // namespace

torch::Tensor sample_rows(const torch::Tensor& logits, const std::vector<double>& temperature, const std::vector<int64_t>& top_k,
                          const std::vector<double>& top_p, const std::vector<double>& min_p, const std::vector<double>& uniform) {
  std::vector<RowFilter> filters = row_filters(logits, temperature, top_k, top_p, min_p, uniform);
  const auto x = logits.contiguous();
  return tokens_of_rows(x, [src = x.data_ptr<float>(), n = x.size(1), filters = std::move(filters)](int64_t r) { return sample_row(src + r * n, n, filters[r]); });
}

torch::Tensor sampling_thresholds(const torch::Tensor& logits, const std::vector<double>& temperature, const std::vector<int64_t>& top_k,
                                  const std::vector<double>& top_p, const std::vector<double>& min_p) {
  const std::vector<RowFilter> filters = row_filters(logits, temperature, top_k, top_p, min_p, std::vector<double>(temperature.size()));
  const auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::full({rows}, std::numeric_limits<float>::quiet_NaN(), logits.options());
  for (int64_t r = 0; r < rows; ++r) {
    if (!(filters[r].temperature > 0.0f)) continue;
    const PreparedRow row = prepare_row(x.data_ptr<float>() + r * n, n, filters[r]);
    if (row.drawable) out.data_ptr<float>()[r] = row.keep_from;
  }
  return out;
}

// Logprobs. -----------------------------------------------------------------------------------------
//
// A row's log-softmax at its chosen token, and its k largest values with their tokens (best first; ties by
// token), as torch.log_softmax then gather and topk give them: one pass finds the largest logit, one sums
// the weights (in float, log_softmax is (x - largest) - log(sum)), and the k largest are selected among
// candidates from spans below the largest, so the log-softmax over the whole row is never written.

namespace {

constexpr int64_t LOGPROB_ROWS_ON_CALLER = 8;  // rows whose logprobs the calling thread computes alone

// false (nothing written) for a row holding NaN or no finite largest logit: the caller answers it with torch.
bool row_logprobs(const float* x, int64_t n, int64_t token, int64_t k, float* chosen, float* values, int64_t* ids) {
  RowScratch& scratch = row_scratch();
  float largest;
  if (!largest_scaled(x, n, 1.0f, largest)) return false;
  const float log_total = static_cast<float>(std::log(weigh_row(x, n, 1.0f, largest, nullptr, nullptr)));
  *chosen = (x[token] - largest) - log_total;
  if (k == 0) return true;
  std::vector<Candidate>& c = scratch.candidates;
  gather_widening(x, n, 1.0f, largest, c.max_size(), c, &scratch.kept_tokens, [&] { return static_cast<int64_t>(c.size()) >= k; });
  std::vector<int32_t>& order = scratch.order;
  order.resize(c.size());
  for (size_t j = 0; j < c.size(); ++j) order[j] = static_cast<int32_t>(j);
  const auto best_first = [&](int32_t a, int32_t b) { return c[a].s > c[b].s || (c[a].s == c[b].s && scratch.kept_tokens[a] < scratch.kept_tokens[b]); };
  std::partial_sort(order.begin(), order.begin() + k, order.end(), best_first);
  for (int64_t j = 0; j < k; ++j) values[j] = (c[order[j]].s - largest) - log_total, ids[j] = scratch.kept_tokens[order[j]];
  return true;
}

}  // namespace

std::vector<torch::Tensor> logprobs_rows(const torch::Tensor& logits, const torch::Tensor& tokens, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.size(1) >= 1, "logits must be [rows, vocab] float32");
  TORCH_CHECK(logits.size(1) <= std::numeric_limits<int32_t>::max(), "a vocabulary of at most 2^31 - 1 entries");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == rows && tokens.scalar_type() == torch::kLong, "tokens must be [rows] int64");
  TORCH_CHECK(k >= 0 && k <= n, "k must be in 0 .. vocab, got ", k);
  const auto x = logits.contiguous();
  const auto t = tokens.contiguous();
  const int64_t* token = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(token[r] >= 0 && token[r] < n, "token ", token[r], " is outside the vocabulary of ", n);
  auto chosen = torch::empty({rows}, x.options());
  auto values = torch::empty({rows, k}, x.options());
  auto ids = torch::empty({rows, k}, t.options());
  auto ok = torch::empty({rows}, x.options().dtype(torch::kBool));
  const float* src = x.data_ptr<float>();
  float *chosen_ptr = chosen.data_ptr<float>(), *values_ptr = values.data_ptr<float>();
  int64_t* ids_ptr = ids.data_ptr<int64_t>();
  bool* ok_ptr = ok.data_ptr<bool>();
  auto rows_from = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ok_ptr[r] = row_logprobs(src + r * n, n, token[r], k, chosen_ptr + r, values_ptr + r * k, ids_ptr + r * k);
  };
  // A few rows on the calling thread (~0.03 ms each): waking OpenMP's threads would set them spinning
  // against the takeover pool's helpers. More go to OpenMP, whose threads then spin against the next
  // step's pool calls for a while: one region per step, and only for requests that ask for logprobs.
  if (rows <= LOGPROB_ROWS_ON_CALLER)
    rows_from(0, rows);
  else
    at::parallel_for(0, rows, 1, rows_from);
  return {chosen, values, ids, ok};
}
