// The probabilistic chain rules' host work at T > 0 in one call each (specdec.verify, specdec.sampling).
//
// After a target pass the torch version of a round's rule runs ~25 ATen calls over [γ, V] rows
// (V = 49,152 for SmolLM2): ~0.6-0.9 ms a drafted round on two cores, against ~0.1 ms for the
// same arithmetic here.  What the ops return:
//
//   torch.ops.specdec.sample_weights(w, u) -> int
//       One draw from w / sum(w) by inverting the float64 CDF with the uniform u: bitwise
//       specdec.sampling.sample_categorical's ``min(searchsorted(w.double().cumsum(0),
//       u * cdf[-1], right=True), V - 1)`` and its fallback where u * cdf[-1] rounds up to a
//       subnormal total (the CDF is the same sequential float64 sum; torch's CPU cumsum is
//       sequential too, tested).  w: float32 or float64 [V], contiguous.
//
//   torch.ops.specdec.draw_scattered(q, ids, vocab, u) -> (int token, Tensor q_full)
//       A draft token drawn from a row over a reduced draft vocabulary, and that row over the
//       whole vocabulary: q float32 [Vd] (contiguous), ids int64 [Vd] its target ids; returns
//       ids[sample_weights(q, u)] and q scattered into zeros [vocab] — bitwise what the torch
//       version's draw, ids[col] and full_probs give.
//
//   torch.ops.specdec.chain_rule(p, q, tokens, uniforms, block) -> (int n, Tensor emitted, float alpha_mean)
//       Token (block = False) or block (block = True) verification of one chain, given the
//       target's processed rows p [γ+1, V] float32, the draft's q [γ, V] float32, the drafted
//       tokens [γ] int64 and γ + 1 uniforms float64: the rule's eta_1..eta_γ, then the one the next
//       token is drawn with.  Returns the kept draft length n, the emitted tokens [n + 1] int64
//       (the kept prefix, then the recovered-or-bonus token) and the mean of alpha_i =
//       min(1, p_i(x_i) / q_i(x_i)), summed in order.  Every step is the torch version's own
//       floating-point operation (ratios, the weights' recursion and the residual rows
//       max(0, (float) w_i p_i - q_i) bit for bit, -ffp-contract=off), with two exceptions: block
//       verification's residual masses |r_i| are summed in float64 here and in float32 (torch's
//       reduction order) there, so a threshold h_i may differ in its last bits and a decision
//       whose eta lies within that of h_i may go the other way (both are the same rule, this one
//       rounds less); and the mean of the alphas (a statistic) may differ in its last bit.  The
//       next token is drawn from the residual row (or from p_γ when all γ are kept) exactly as
//       sample_weights draws.
//
//   torch.ops.specdec.argmax_rows(x) -> Tensor
//       Each row's arg-max, x float32 [n, V] contiguous -> int64 [n]: the index of the row's first
//       NaN if it holds one, else the first index of its maximum -- what torch's
//       ``x.max(-1).indices`` returns (specdec.sampling.argmax_last), ~15x faster: torch's
//       reduction with indices runs scalar here (~125 us for a 49,152-word row on a Zen 3 core).
//
// Why one call returns everything: right after a target pass every ATen call costs ~40-60 us
// more than when warm (its code and data were pushed out of the caches by the pass's weights),
// so the number of calls after the pass, not their arithmetic, is what a round's rule costs.

#include <ATen/ATen.h>
#include <torch/library.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kChunk = 512;  // CDF checkpoints: the search re-walks at most one chunk

// The inverse-CDF draw over values given by f(i), i in [0, n): sequential float64 prefix sums from
// 0.0, as torch's CPU cumsum accumulates (the first pass keeps one per chunk), then the first index
// whose prefix sum exceeds u * total, re-walking only the chunk that holds it.
template <typename F>
int64_t draw(int64_t n, double u, F f) {
  std::vector<double> ends;
  ends.reserve(static_cast<size_t>(n / kChunk + 1));
  double acc = 0.0;
  for (int64_t lo = 0; lo < n; lo += kChunk) {
    const int64_t hi = std::min(n, lo + kChunk);
    for (int64_t i = lo; i < hi; ++i) acc += f(i);
    ends.push_back(acc);
  }
  const double x = u * acc;  // torch: u * cdf[-1], a float64 product
  double start = 0.0;
  for (size_t c = 0; c < ends.size(); ++c) {
    if (ends[c] > x) {  // the first index with cdf > x lies in this chunk: walk it again
      double run = start;
      const int64_t lo = static_cast<int64_t>(c) * kChunk, hi = std::min(n, lo + kChunk);
      for (int64_t i = lo; i < hi; ++i) {
        run += f(i);
        if (run > x) return i;
      }
      return hi - 1;  // unreachable: the chunk's end exceeds x
    }
    start = ends[c];
  }
  if (acc > 0.0) {  // x rounded up to the total (a subnormal total): the first index whose sum reaches it
    double run = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      run += f(i);
      if (run >= acc) return i;
    }
  }
  return n - 1;  // all zeros, or NaN: the last index, as min(idx, V - 1)
}

int64_t sample_weights(const at::Tensor& w, double u) {
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.numel() > 0, "sample_weights: w must be a contiguous non-empty [V] tensor");
  const int64_t n = w.numel();
  if (w.scalar_type() == at::kFloat) {
    const float* p = w.data_ptr<float>();
    return draw(n, u, [p](int64_t i) { return static_cast<double>(p[i]); });
  }
  TORCH_CHECK(w.scalar_type() == at::kDouble, "sample_weights: w must be float32 or float64");
  const double* p = w.data_ptr<double>();
  return draw(n, u, [p](int64_t i) { return p[i]; });
}

// clamp_min(0) of one value, NaN kept: (0 > r) ? 0 : r.  As a ternary GCC compiles it to a branch,
// which residual rows (about half their entries below zero, at random) mispredict half the time:
// ~5 ns an entry.  x86's MAXSS / MAXPS (a, b) is exactly "a > b ? a : b", NaN giving b.
inline float relu(float r) {
#if defined(__SSE2__)
  return _mm_cvtss_f32(_mm_max_ss(_mm_setzero_ps(), _mm_set_ss(r)));
#else
  return (0.0f > r) ? 0.0f : r;
#endif
}

std::tuple<int64_t, at::Tensor> draw_scattered(const at::Tensor& q, const at::Tensor& ids, int64_t vocab, double u) {
  TORCH_CHECK(q.dim() == 1 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.numel() > 0,
              "draw_scattered: q must be contiguous float32 [Vd]");
  TORCH_CHECK(ids.dim() == 1 && ids.numel() == q.numel() && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "draw_scattered: ids must be contiguous int64 [Vd]");
  const int64_t n = q.numel();
  const float* qp = q.data_ptr<float>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  at::Tensor full = at::zeros({vocab}, at::TensorOptions().dtype(at::kFloat));
  float* fp = full.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < vocab, "draw_scattered: an id outside the vocabulary");
    fp[ip[i]] = qp[i];
  }
  const int64_t col = draw(n, u, [qp](int64_t i) { return static_cast<double>(qp[i]); });
  return {ip[col], full};
}

inline float residual(float w, float p, float q) {
  return relu(w * p - q);  // two roundings, as torch's separate product and difference
}

// sum_v max(0, w p_v - q_v) in float64, in any order (NaN if one is NaN): > 0 exactly when the
// float32 sum torch takes is, since every term is >= 0 or NaN.
double residual_mass(const float* p, const float* q, float w, int64_t n) {
  int64_t v = 0;
  double acc = 0.0;
#if defined(__AVX512F__)
  const __m512 wv = _mm512_set1_ps(w), zero = _mm512_setzero_ps();
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  for (; v + 16 <= n; v += 16) {
    const __m512 r = _mm512_max_ps(zero, _mm512_sub_ps(_mm512_mul_ps(wv, _mm512_loadu_ps(p + v)), _mm512_loadu_ps(q + v)));
    a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(r)));
    a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1))));
  }
  acc = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#elif defined(__AVX2__)
  const __m256 wv = _mm256_set1_ps(w), zero = _mm256_setzero_ps();
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  for (; v + 8 <= n; v += 8) {
    const __m256 r = _mm256_max_ps(zero, _mm256_sub_ps(_mm256_mul_ps(wv, _mm256_loadu_ps(p + v)), _mm256_loadu_ps(q + v)));
    a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(r)));
    a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(r, 1)));
  }
  double lanes[4];
  _mm256_storeu_pd(lanes, _mm256_add_pd(a0, a1));
  acc = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; v < n; ++v) acc += residual(w, p[v], q[v]);
  return acc;
}

std::tuple<int64_t, at::Tensor, double> chain_rule(const at::Tensor& p, const at::Tensor& q, const at::Tensor& tokens,
                                                   const at::Tensor& uniforms, bool block) {
  TORCH_CHECK(p.dim() == 2 && p.scalar_type() == at::kFloat && p.is_contiguous(), "chain_rule: p must be contiguous float32 [γ+1, V]");
  const int64_t gamma = p.size(0) - 1, vocab = p.size(1);
  TORCH_CHECK(gamma >= 1 && vocab >= 1, "chain_rule: nothing drafted");
  TORCH_CHECK(q.dim() == 2 && q.size(0) == gamma && q.size(1) == vocab && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "chain_rule: q must be contiguous float32 [γ, V]");
  TORCH_CHECK(tokens.dim() == 1 && tokens.numel() == gamma && tokens.scalar_type() == at::kLong && tokens.is_contiguous(),
              "chain_rule: tokens must be contiguous int64 [γ]");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.numel() == gamma + 1 && uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous(),
              "chain_rule: uniforms must be contiguous float64 [γ+1]");
  const float* pp = p.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  const double* ep = uniforms.data_ptr<double>();
  const double u = ep[gamma];
  std::vector<double> ap(static_cast<size_t>(gamma));
  std::vector<double> w(static_cast<size_t>(gamma + 1), 1.0);  // block: w_0 = 1, w_i = min(1, w_{i-1} p/q)
  for (int64_t i = 0; i < gamma; ++i) {
    const int64_t x = tp[i];
    TORCH_CHECK(x >= 0 && x < vocab, "chain_rule: a drafted token outside the vocabulary");
    const double ratio = static_cast<double>(pp[i * vocab + x]) / static_cast<double>(qp[i * vocab + x]);
    ap[i] = ratio > 1.0 ? 1.0 : ratio;  // clamp(max=1): NaN stays NaN
    const double next = w[i] * ratio;
    w[i + 1] = (1.0 < next) ? 1.0 : next;  // Python's min(next, 1.0): NaN stays NaN
  }
  int64_t n = 0;
  if (block) {
    // h_i = |r_i| / (|r_i| + 1 - w_i) for i < γ (0 where that is 0/0), h_γ = w_γ; keep the last i with eta_i < h_i
    for (int64_t i = gamma; i >= 1; --i) {
      double h;
      if (i == gamma) {
        h = w[gamma];
      } else {
        const double mass = residual_mass(pp + i * vocab, qp + i * vocab, static_cast<float>(w[i]), vocab);
        const double denom = mass + (1.0 - w[i]);
        h = denom > 0.0 ? mass / (denom < 1e-300 ? 1e-300 : denom) : 0.0;
      }
      if (ep[i - 1] < h) {
        n = i;
        break;
      }
    }
  } else {
    // token verification: accept while eta_i < min(1, p/q); the residual is max(0, p - q)
    while (n < gamma && ep[n] < ap[n]) ++n;
    std::fill(w.begin(), w.end(), 1.0);
  }
  int64_t token;
  const float* row = pp + n * vocab;
  if (n == gamma) {
    token = draw(vocab, u, [row](int64_t v) { return static_cast<double>(row[v]); });
  } else {
    const float wf = static_cast<float>(w[n]);
    const float* qr = qp + n * vocab;
    // torch: row.sum() > 0, else the target's row (unreachable in exact arithmetic)
    if (residual_mass(row, qr, wf, vocab) > 0.0) {
      token = draw(vocab, u, [=](int64_t v) { return static_cast<double>(residual(wf, row[v], qr[v])); });
    } else {
      token = draw(vocab, u, [row](int64_t v) { return static_cast<double>(row[v]); });
    }
  }
  at::Tensor emitted = at::empty({n + 1}, at::TensorOptions().dtype(at::kLong));
  int64_t* out = emitted.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) out[i] = tp[i];
  out[n] = token;
  double sum = 0.0;
  for (int64_t i = 0; i < gamma; ++i) sum += ap[i];
  return {n, emitted, sum / static_cast<double>(gamma)};
}

// The first NaN's index of a row that holds one, else the first index of its maximum (+0 and -0
// are equal, so the first of them wins, as torch's comparisons give).
int64_t argmax_row(const float* x, int64_t n) {
  int64_t v = 0;
  float best;
#if defined(__AVX2__)
  if (n >= 16) {
    // pass 1: the maximum over lanes (two chains for the max's latency), and whether any NaN is seen
    __m256 m0 = _mm256_loadu_ps(x), m1 = _mm256_loadu_ps(x + 8);
    __m256 bad = _mm256_or_ps(_mm256_cmp_ps(m0, m0, _CMP_UNORD_Q), _mm256_cmp_ps(m1, m1, _CMP_UNORD_Q));
    for (v = 16; v + 16 <= n; v += 16) {
      const __m256 a = _mm256_loadu_ps(x + v), b = _mm256_loadu_ps(x + v + 8);
      m0 = _mm256_max_ps(m0, a);
      m1 = _mm256_max_ps(m1, b);
      bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    bool nan = _mm256_movemask_ps(bad) != 0;
    best = lanes[0];
    for (int i = 1; i < 8; ++i) best = lanes[i] > best ? lanes[i] : best;
    for (int64_t i = v; i < n; ++i) {
      nan = nan || x[i] != x[i];
      best = x[i] > best ? x[i] : best;
    }
    if (nan) {
      for (int64_t i = 0; i < n; ++i)
        if (x[i] != x[i]) return i;
    }
    // pass 2: the first index holding the maximum
    const __m256 target = _mm256_set1_ps(best);
    for (v = 0; v + 8 <= n; v += 8) {
      const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + v), target, _CMP_EQ_OQ));
      if (hit != 0) return v + __builtin_ctz(static_cast<unsigned>(hit));
    }
    for (; v < n; ++v)
      if (x[v] == best) return v;
    return 0;  // unreachable: the maximum is in the row
  }
#endif
  int64_t idx = 0;
  best = x[0];
  if (best != best) return 0;
  for (v = 1; v < n; ++v) {
    const float a = x[v];
    if (a != a) return v;
    if (a > best) {
      best = a;
      idx = v;
    }
  }
  return idx;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "argmax_rows: x must be a contiguous float32 [n, V] tensor with V > 0");
  const int64_t rows = x.size(0), n = x.size(1);
  const float* p = x.data_ptr<float>();
  at::Tensor out = at::empty({rows}, at::TensorOptions().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) o[r] = argmax_row(p + r * n, n);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows);
  m.def("sample_weights(Tensor w, float u) -> int", &sample_weights);
  m.def("draw_scattered(Tensor q, Tensor ids, int vocab, float u) -> (int, Tensor)", &draw_scattered);
  m.def("chain_rule(Tensor p, Tensor q, Tensor tokens, Tensor uniforms, bool block) -> (int, Tensor, float)", &chain_rule);
}
