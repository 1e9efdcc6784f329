// fbgemm's dynamic int8 product for a few rows, with the weights streamed once for all of them.
//
// W8A8Linear feeds fbgemm rows already divided by their own max-abs value (plus two pinned
// columns), so fbgemm quantises every element with one step and zero point — 2/255 and 128 on
// CPUs with VNNI (8-bit activations), 2/127 and 64 elsewhere (fbgemm's ``reduce_range``: 7-bit
// activations, so that AVX2's u8 x s8 pair sums cannot saturate int16) — accumulates
// sum_k (q_k - zero) w_jk exactly in int32 and multiplies by float32(step * w_scale_j).  This
// kernel computes exactly that — the same quantisation routine (ATen's quantize_per_tensor),
// the same exact integer sums (VNNI u8 x s8 dot products, or AVX2's pair products widened to
// int32, both without saturation), the same single float multiply — so its output is bitwise
// fbgemm's for any row count (tested), and the two can be mixed freely, as the oneDNN path is.
// What differs is the cost curve: fbgemm's grows ~0.8 ms per extra row over SmolLM2's layers on
// two cores; here a few rows share one pass over the int8 weights, which is what a decoding step
// is bound by.  On AVX2 (machine H, a Zen 3) fbgemm's one-row product of SmolLM2's 49,152-row LM
// head read its 28 MB at ~10 GB/s of the ~17 the two cores stream.
//
//   torch.ops.specdec.q8_pack(w int8 [N, K]) -> int8 [ceil(N/G), ceil(K/4), G, 4]: groups of G
//       columns (64 in the VNNI build, 16 in the AVX2 build), each read front to back once per pass
//   torch.ops.specdec.q8_linear(x f32 [n, K], smooth f32 [K] or None, packed, comp int32 [N], col f32 [N])
//       -> (y f32 [n, N], s f32 [n, 1]):  x' = x * smooth, s = max(max_k |x'_k|, 1e-30) per row,
//       q = quantize(x' / s), y_j = float(sum_k q_k w_jk - comp_j) * col_j
//   (the row preparation W8A8Linear does with ATen ops — a product, abs, max, clamp, division,
//   each one IEEE operation per element or an exact max — done here in one call)
//   torch.ops.specdec.q8_supported() -> bool (the CPU and the build have 512-bit VNNI)
//   torch.ops.specdec.q8_zero() -> int: the activations' zero point this build's product runs
//       with: 128 (512-bit VNNI), 64 (AVX2: fbgemm's reduce_range), 0 (no product in this build);
//       used only where fbgemm quantises the activations the same way on this CPU

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "specdec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SPECDEC_Q8 1
#define SPECDEC_Q8_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECDEC_Q8 0
#define SPECDEC_Q8_AVX2 1
#else
#define SPECDEC_Q8 0
#define SPECDEC_Q8_AVX2 0
#endif

namespace {

// fbgemm's step and zero point for rows pinned to [-1, 1]: 8-bit activations with VNNI, 7-bit
// (reduce_range) without
constexpr double kStep = SPECDEC_Q8 ? 2.0 / 255.0 : 2.0 / 127.0;
constexpr int64_t kZero = SPECDEC_Q8 ? 128 : 64;
// rows per block: VNNI 4 rows x 4 accumulators of 16 columns; AVX2 3 rows x 8 of 8
constexpr int kRowsMax = SPECDEC_Q8 ? 4 : 3;
// columns per packed group: four 16-column zmm accumulators (VNNI); one 64-byte line a step of
// four inputs (AVX2: each 16-column group is then one contiguous stream, see line_rows)
constexpr int kGroup = SPECDEC_Q8 ? 64 : 16;
constexpr int kSpan = 64;  // columns per unit of work (a thread's share is whole spans)
constexpr int kPrefetch = 8;  // a stream of weights is prefetched kPrefetch x 256 bytes (2 KB) ahead

at::Tensor q8_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "q8_pack: an int8 [N, K] weight");
  const at::Tensor wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), ng = (n + kGroup - 1) / kGroup, k4 = (k + 3) / 4;
  at::Tensor out = at::zeros({ng, k4, kGroup, 4}, wc.options());
  const int8_t* src = wc.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  // row j's columns 4c..4c+3 go to [j / 64][c][j % 64][0..3]: whole groups in parallel, each row's
  // four-column steps copied as one 32-bit word (a partial last step byte by byte; the rest stays 0)
  at::parallel_for(0, ng, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t j = g * kGroup; j < std::min(n, (g + 1) * kGroup); ++j) {
        const int8_t* row = src + j * k;
        int8_t* at = dst + (g * k4 * kGroup + j % kGroup) * 4;
        int64_t c = 0;
        for (; c + 4 <= k; c += 4, at += kGroup * 4) std::memcpy(at, row + c, 4);
        for (int64_t u = 0; c + u < k; ++u) at[u] = row[c + u];
      }
  });
  return out;
}

// The whole quantisation of a W8A8 layer's weight in one pass, what W8A8Linear otherwise does with
// seven ATen calls (smoothing product, per-row aminmax, the scales, quantize_per_channel, int_repr,
// the row sums, q8_pack: ~25 s of loading the int8 Qwen2.5-Coder-1.5B on two cores).  Every number
// comes out as the ATen path makes it, bit for bit (tested): v = w * smooth (one float product),
// m = max(max_k |v_k|, 1e-12), scale = m / 127 (float), q = nearbyint(v * (1 / scale)) clamped to
// [-128, 127] (quantize_per_channel's rule for qint8), col = float(step) * scale, comp = zero * sum_k q.
//   w f32 [N, K], smooth f32 [K] or None -> (packed as q8_pack, comp int32 [N], col f32 [N],
//   scales f64 [N])
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> q8_quantize(const at::Tensor& w_in,
                                                                   const c10::optional<at::Tensor>& smooth) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat, "q8_quantize: a float32 [N, K] weight");
  const at::Tensor w = w_in.contiguous();
  const int64_t n = w.size(0), k = w.size(1), ng = (n + kGroup - 1) / kGroup, k4 = (k + 3) / 4;
  const bool smoothed = smooth.has_value() && smooth->defined();
  at::Tensor sm;
  if (smoothed) {
    sm = smooth->contiguous();
    TORCH_CHECK(sm.scalar_type() == at::kFloat && sm.numel() == k, "q8_quantize: smooth must be float32 [K]");
  }
  at::Tensor packed = at::zeros({ng, k4, kGroup, 4}, w.options().dtype(at::kChar));
  at::Tensor comp = at::empty({n}, w.options().dtype(at::kInt));
  at::Tensor col = at::empty({n}, w.options());
  at::Tensor scales = at::empty({n}, w.options().dtype(at::kDouble));
  const float* wp = w.data_ptr<float>();
  const float* smp = smoothed ? sm.data_ptr<float>() : nullptr;
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* cp = comp.data_ptr<int32_t>();
  float* colp = col.data_ptr<float>();
  double* sp = scales.data_ptr<double>();
  const float step = static_cast<float>(kStep);
  at::parallel_for(0, ng, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> v(static_cast<size_t>(k));
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t j = g * kGroup; j < std::min(n, (g + 1) * kGroup); ++j) {
        const float* row = wp + j * k;
        int64_t c = 0;
        float m = 0.0f;
#if SPECDEC_Q8 || SPECDEC_Q8_AVX2
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 mv = _mm256_setzero_ps();
        for (; c + 8 <= k; c += 8) {
          __m256 x = _mm256_loadu_ps(row + c);
          if (smoothed) x = _mm256_mul_ps(x, _mm256_loadu_ps(smp + c));
          _mm256_storeu_ps(v.data() + c, x);
          mv = _mm256_max_ps(mv, _mm256_andnot_ps(sign, x));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mv);
        for (float a : lanes) m = a > m ? a : m;
#endif
        for (; c < k; ++c) {
          const float x = smoothed ? row[c] * smp[c] : row[c];
          v[c] = x;
          const float a = std::fabs(x);
          m = a > m ? a : m;
        }
        const float scale = (m > 1e-12f ? m : 1e-12f) / 127.0f;
        const float inv = 1.0f / scale;
        int32_t sum = 0;
        int8_t* at = dst + (g * k4 * kGroup + j % kGroup) * 4;
        c = 0;
#if SPECDEC_Q8 || SPECDEC_Q8_AVX2
        const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-128.0f), hi = _mm256_set1_ps(127.0f);
        __m256i vsum = _mm256_setzero_si256();
        for (; c + 8 <= k; c += 8) {
          // nearest, ties to even (nearbyint), then the clamp: integral floats, converted exactly
          __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v.data() + c), vinv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          const __m256i qi = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, lo), hi));
          vsum = _mm256_add_epi32(vsum, qi);
          alignas(32) int32_t t[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(t), qi);
          int8_t* dst0 = at + (c / 4) * kGroup * 4;
          int8_t* dst1 = dst0 + kGroup * 4;
          for (int u = 0; u < 4; ++u) {
            dst0[u] = static_cast<int8_t>(t[u]);
            dst1[u] = static_cast<int8_t>(t[u + 4]);
          }
        }
        alignas(32) int32_t sums[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(sums), vsum);
        for (int32_t x : sums) sum += x;
#endif
        for (; c < k; ++c) {
          float q = std::nearbyint(v[c] * inv);
          q = q < -128.0f ? -128.0f : (q > 127.0f ? 127.0f : q);
          const int8_t b = static_cast<int8_t>(q);
          sum += b;
          at[(c / 4) * kGroup * 4 + c % 4] = b;
        }
        cp[j] = static_cast<int32_t>(kZero) * sum;
        colp[j] = step * scale;
        sp[j] = static_cast<double>(scale);
      }
  });
  return {packed, comp, col, scales};
}

// max_i |w_ij| per column of a float32 [N, K] weight: w.abs().amax(0) without the N x K copy (a
// max is exact in any order); what SmoothQuant's factors are made from, for every int8 matrix.
at::Tensor absmax_columns(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat, "absmax_columns: a float32 [N, K] weight");
  const at::Tensor w = w_in.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor out = at::zeros({k}, w.options());
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  constexpr int64_t kBlock = 256;  // columns a thread keeps its running maxima for
  at::parallel_for(0, (k + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c0 = b * kBlock, c1 = std::min(k, c0 + kBlock);
      for (int64_t i = 0; i < n; ++i) {
        const float* row = wp + i * k;
        for (int64_t c = c0; c < c1; ++c) {
          const float a = std::fabs(row[c]);
          op[c] = a > op[c] || a != a ? a : op[c];  // a NaN stays, as amax keeps it
        }
      }
    }
  });
  return out;
}

bool q8_supported() { return SPECDEC_Q8 != 0; }

int64_t q8_zero() { return SPECDEC_Q8 || SPECDEC_Q8_AVX2 ? kZero : 0; }

#if SPECDEC_Q8
// R rows x one group of 64 columns: 4 x R independent int32 accumulators of 16 columns (integer
// sums: exact whatever the grouping); the group's weights are read front to back.
template <int R>
void group_rows(const uint8_t* xq, int64_t x_stride, const int8_t* wg, int64_t k4, const int32_t* comp,
                const float* col, float* out, int64_t out_stride, int64_t valid) {
  __m512i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_si512();
  for (int64_t c = 0; c < k4; ++c) {
    const int8_t* wc = wg + c * (kGroup * 4);
    // the weights stream from memory once per pass: ask for them a few steps ahead, so the
    // loads overlap the dot products when several rows make each step longer
    const int8_t* ahead = wc + kPrefetch * (kGroup * 4);
    _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + 192), _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(wc), w1 = _mm512_loadu_si512(wc + 64), w2 = _mm512_loadu_si512(wc + 128),
                  w3 = _mm512_loadu_si512(wc + 192);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, xq + r * x_stride + c * 4, sizeof(four));
      const __m512i a = _mm512_set1_epi32(four);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], a, w1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], a, w2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], a, w3);
    }
  }
  for (int u = 0; u < 4; ++u) {
    const int64_t v = valid - 16 * u;
    if (v <= 0) break;
    const __mmask16 mask = v >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << v) - 1u);
    const __m512i cz = _mm512_maskz_loadu_epi32(mask, comp + 16 * u);
    const __m512 cs = _mm512_maskz_loadu_ps(mask, col + 16 * u);
    for (int r = 0; r < R; ++r) {
      const __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][u], cz)), cs);
      _mm512_mask_storeu_ps(out + r * out_stride + 16 * u, mask, y);
    }
  }
}

using GroupFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const int32_t*, const float*, float*, int64_t,
                         int64_t);
constexpr GroupFn kGroups[kRowsMax + 1] = {nullptr, group_rows<1>, group_rows<2>, group_rows<3>, group_rows<4>};
#endif

#if SPECDEC_Q8_AVX2
// The last step of a product: 8 columns' exact sums less the zero point's term, times the column
// factor, one float multiply, as fbgemm does; ``v`` of the 8 columns are real (no read or write
// past comp's, col's and the row's ends).
template <int R>
inline void store_octet(const __m256i (&acc)[R], const int32_t* comp, const float* col, float* out, int64_t out_stride,
                        int64_t v) {
  __m256i cz;
  __m256 cs;
  if (v >= 8) {
    cz = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp));
    cs = _mm256_loadu_ps(col);
  } else {
    alignas(32) int32_t tc[8] = {};
    alignas(32) float ts[8] = {};
    std::memcpy(tc, comp, static_cast<size_t>(v) * sizeof(int32_t));
    std::memcpy(ts, col, static_cast<size_t>(v) * sizeof(float));
    cz = _mm256_load_si256(reinterpret_cast<const __m256i*>(tc));
    cs = _mm256_load_ps(ts);
  }
  for (int r = 0; r < R; ++r) {
    const __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r], cz)), cs);
    if (v >= 8) {
      _mm256_storeu_ps(out + r * out_stride, y);
    } else {
      alignas(32) float t[8];
      _mm256_store_ps(t, y);
      std::memcpy(out + r * out_stride, t, static_cast<size_t>(v) * sizeof(float));
    }
  }
}

// u8 codes (at most 128) times int8 weights, four inputs at a time: pair sums in int16 (|128 x 127
// x 2| < 2^15: exact), widened to int32 pair sums against ones and added: sum_k q_k w_jk exactly.
inline __m256i dot4(__m256i acc, __m256i a, __m256i w, __m256i ones) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, w), ones));
}

inline __m256i codes4(const uint8_t* at) {  // a row's four codes, broadcast
  int32_t four;
  std::memcpy(&four, at, sizeof(four));
  return _mm256_set1_epi32(four);
}

// R rows x a span of 64 columns (four 16-column groups, eight octets of 8 columns), one pass over
// the span's weights for all R rows: per step of four inputs, each row's four codes against the
// four groups' lines.  8 x R accumulators are more than AVX2's 16 registers hold from two rows on;
// the compiler keeps the rest in L1, which costs less than passing over the span once per half
// (measured, machine H, SmolLM2's 49,152 x 576 LM head, time against fbgemm's in the same process
// for 1 / 2 / 3 / 4 / 5 / 9 / 16 rows: one pass, blocks of three rows, 0.75 / 0.75 / 0.75 / 0.80 /
// 0.89 / 1.10 / 1.11; a pass per half of the span, 0.73 / 0.87 / 0.94 and ~1.1 from four rows on).
// Products of more rows take line_rows.
template <int R>
void span_rows(const uint8_t* xq, int64_t x_stride, const int8_t* ws, int64_t k4, const int32_t* comp,
               const float* col, float* out, int64_t out_stride) {
  constexpr int kOctets = kSpan / 8;
  const int64_t stride = k4 * kGroup * 4;  // bytes from one 16-column group to the next
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[kOctets][R];
  for (int h = 0; h < kOctets; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_si256();
  for (int64_t c = 0; c < k4; ++c) {
    const int8_t* wc = ws + c * (kGroup * 4);
    for (int g = 0; g < kSpan / kGroup; ++g)
      _mm_prefetch(reinterpret_cast<const char*>(wc + g * stride + kPrefetch * 256), _MM_HINT_T0);
    __m256i a[R];
    for (int r = 0; r < R; ++r) a[r] = codes4(xq + r * x_stride + c * 4);
#pragma GCC unroll 8
    for (int h = 0; h < kOctets; ++h) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + (h / 2) * stride + 32 * (h % 2)));
      for (int r = 0; r < R; ++r) acc[h][r] = dot4(acc[h][r], a[r], w, ones);
    }
  }
  for (int h = 0; h < kOctets; ++h) store_octet<R>(acc[h], comp + 8 * h, col + 8 * h, out + 8 * h, out_stride, 8);
}

using SpanFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const int32_t*, const float*, float*, int64_t);
constexpr SpanFn kSpans[kRowsMax + 1] = {nullptr, span_rows<1>, span_rows<2>, span_rows<3>};

// Products of more than kRowsMax rows (and a matrix's last, partial span): R rows x one 16-column
// group, whose weights are one contiguous stream of 64 bytes a step; the 2R accumulators, the
// step's two weight vectors, the ones, a row's codes and one product fit AVX2's 16 registers
// (2R + 5 <= 16), where span_rows spills.  Each group is read from memory by its first block of
// rows; the later blocks find it in L2 (64 bytes x K/4: 143 KB for 8,960 inputs).
constexpr int kLineRows = 5;

template <int R>
void line_rows(const uint8_t* xq, int64_t x_stride, const int8_t* wl, int64_t k4, const int32_t* comp,
               const float* col, float* out, int64_t out_stride, int64_t valid) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
  for (int64_t c = 0; c < k4; ++c) {
    const int8_t* wc = wl + c * (kGroup * 4);
    _mm_prefetch(reinterpret_cast<const char*>(wc + kPrefetch * 256), _MM_HINT_T0);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32));
    for (int r = 0; r < R; ++r) {
      const __m256i a = codes4(xq + r * x_stride + c * 4);
      lo[r] = dot4(lo[r], a, w0, ones);
      hi[r] = dot4(hi[r], a, w1, ones);
    }
  }
  store_octet<R>(lo, comp, col, out, out_stride, valid);
  if (valid > 8) store_octet<R>(hi, comp + 8, col + 8, out + 8, out_stride, valid - 8);
}

using LineFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const int32_t*, const float*, float*, int64_t,
                        int64_t);
constexpr LineFn kLines[kLineRows + 1] = {nullptr, line_rows<1>, line_rows<2>, line_rows<3>, line_rows<4>,
                                          line_rows<5>};
#endif

std::tuple<at::Tensor, at::Tensor> q8_linear(const at::Tensor& x_in, const c10::optional<at::Tensor>& smooth,
                                             const at::Tensor& packed, const at::Tensor& comp, const at::Tensor& col) {
#if SPECDEC_Q8 || SPECDEC_Q8_AVX2
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "q8_linear: x must be float32 [n, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kGroup && packed.size(3) == 4 && packed.scalar_type() == at::kChar,
              "q8_linear: weights packed by q8_pack");
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(0), k = x.size(1), ng = packed.size(0), k4 = packed.size(1), nout = comp.size(0);
  TORCH_CHECK((k + 3) / 4 == k4 && (nout + kGroup - 1) / kGroup == ng && col.numel() == nout,
              "q8_linear: shapes do not match");
  TORCH_CHECK(comp.scalar_type() == at::kInt && col.scalar_type() == at::kFloat, "q8_linear: comp int32, col float32");
  const bool smoothed = smooth.has_value() && smooth->defined();
  at::Tensor sm;
  if (smoothed) {
    sm = smooth->contiguous();
    TORCH_CHECK(sm.scalar_type() == at::kFloat && sm.numel() == k, "q8_linear: smooth must be float32 [K]");
  }
  // the row preparation: x * smooth, the row's max |.| clamped at 1e-30, the division
  at::Tensor xn = at::empty({n, k}, x.options());
  at::Tensor s = at::empty({n, 1}, x.options());
  {
    const float* xp = x.data_ptr<float>();
    const float* smp = smoothed ? sm.data_ptr<float>() : nullptr;
    float* np = xn.data_ptr<float>();
    float* sp = s.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      float* row = np + r * k;
      float m = 0.0f;
      for (int64_t c = 0; c < k; ++c) {
        const float v = smoothed ? xp[r * k + c] * smp[c] : xp[r * k + c];
        row[c] = v;
        const float a = v < 0.0f ? -v : v;
        m = a > m ? a : m;
      }
      m = m > 1e-30f ? m : 1e-30f;
      sp[r] = m;
      for (int64_t c = 0; c < k; ++c) row[c] = row[c] / m;
    }
  }
  // fbgemm's quantisation (what ATen's quantize_per_tensor runs for quint8): one fused multiply-add
  // x * float(1 / float(step)) + zero in float32, rounded half to even, clamped to [0, 255] (a
  // separate multiply and add differs from it about once in 10^5 values); written here, padded to
  // whole groups of four (the padded weights are zero), instead of two ATen calls and a copy
  // (~7 us a call: a fifth of a small draft model's step). Tested bit for bit against ATen.
  at::Tensor xq = at::empty({n, k4 * 4}, x.options().dtype(at::kByte));
  {
    const float inv = 1.0f / static_cast<float>(kStep);
    const float* np = xn.data_ptr<float>();
    uint8_t* qp = xq.data_ptr<uint8_t>();
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        const float v = std::nearbyint(std::fma(np[r * k + c], inv, static_cast<float>(kZero)));
        qp[r * k4 * 4 + c] = static_cast<uint8_t>(v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v));
      }
      for (int64_t c = k; c < k4 * 4; ++c) qp[r * k4 * 4 + c] = 0;
    }
  }
  at::Tensor out = at::empty({n, nout}, x.options());
  const uint8_t* xp = xq.data_ptr<uint8_t>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* cp = comp.data_ptr<int32_t>();
  const float* sp = col.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = xq.size(1);
  // groups of 64 output columns, split between threads; a column's sum is computed by one thread
  // (and integer sums are exact in any order anyway)
  const int64_t spans = (nout + kSpan - 1) / kSpan;
  const int64_t grain = ng * k4 * kGroup * 4 < (1 << 16) ? spans : (spans + 1) / 2;
  at::parallel_for(0, spans, grain, [&](int64_t lo, int64_t hi) {
#if SPECDEC_Q8
    for (int64_t g = lo; g < hi; ++g)
      for (int64_t r0 = 0; r0 < n; r0 += kRowsMax) {
        const int64_t rows = n - r0 < kRowsMax ? n - r0 : kRowsMax;
        kGroups[rows](xp + r0 * xs, xs, wp + g * k4 * kGroup * 4, k4, cp + g * kGroup, sp + g * kGroup,
                      op + r0 * nout + g * kGroup, nout, nout - g * kGroup);
      }
#else
    for (int64_t sp0 = lo; sp0 < hi; ++sp0) {
      const int64_t first = sp0 * kSpan, cols = std::min<int64_t>(kSpan, nout - first);
      const int8_t* ws = wp + (first / kGroup) * k4 * kGroup * 4;
      if (n <= kRowsMax && cols == kSpan) {
        for (int64_t r0 = 0; r0 < n; r0 += kRowsMax) {
          const int64_t rows = n - r0 < kRowsMax ? n - r0 : kRowsMax;
          kSpans[rows](xp + r0 * xs, xs, ws, k4, cp + first, sp + first, op + r0 * nout + first, nout);
        }
        continue;
      }
      for (int64_t g = 0; g * kGroup < cols; ++g)
        for (int64_t r0 = 0; r0 < n; r0 += kLineRows) {
          const int64_t rows = n - r0 < kLineRows ? n - r0 : kLineRows, c0 = first + g * kGroup;
          kLines[rows](xp + r0 * xs, xs, ws + g * k4 * kGroup * 4, k4, cp + c0, sp + c0, op + r0 * nout + c0, nout,
                       nout - c0);
        }
    }
#endif
  });
  return {out, s};
#else
  TORCH_CHECK(false, "q8_linear: this build has neither 512-bit VNNI nor AVX2");
  return {x_in, x_in};
#endif
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> specdec::q8_product(const at::Tensor& x, const c10::optional<at::Tensor>& smooth,
                                                       const at::Tensor& packed, const at::Tensor& comp,
                                                       const at::Tensor& col) {
  return q8_linear(x, smooth, packed, comp, col);
}

TORCH_LIBRARY(specdec, m) {
  m.def("q8_pack(Tensor w) -> Tensor");
  m.def("q8_quantize(Tensor w, Tensor? smooth) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("absmax_columns(Tensor w) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor? smooth, Tensor packed, Tensor comp, Tensor col) -> (Tensor, Tensor)");
  m.def("q8_supported() -> bool", &q8_supported);
  m.def("q8_zero() -> int", &q8_zero);
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("q8_pack", &q8_pack);
  m.impl("q8_quantize", &q8_quantize);
  m.impl("absmax_columns", &absmax_columns);
  m.impl("q8_linear", &q8_linear);
}
