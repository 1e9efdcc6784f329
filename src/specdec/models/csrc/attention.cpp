// Exact attention for the batch-invariant target: one fixed computation per query row.
//
//   torch.ops.specdec.attend(q, k, v, start, paths) -> [n, Hq * d]
//
//   q      [n, Hq, d] float32, pre-scaled query rows (Hq a multiple of Hkv: grouped-query heads)
//   k, v   [Hkv, T, d] float32 or float16 cache buffers (their last dimension contiguous, both of
//          one dtype).  A float16 key or value is widened to float32 exactly as it is read, so a
//          row's bits over a float16 cache are those over a float32 cache holding the same values.
//   start  without paths: row r sees keys [0, start + r] — what token-by-token decoding had cached
//          when it scored that position;
//          with paths: every row sees the prefix [0, start), then the cache slots paths[r, :] in
//          order up to the first -1 (a tree node: its ancestors, then itself) [n, E] int64
//
// A row's bits depend only on its query and the keys and values it sees, never on the other rows,
// the number of threads or how the compiler vectorised a loop:
//
//   * a score q . k_j: feature c into lane c mod 16 (one fused multiply-add per feature, in
//     feature order), then the 16 lanes summed as ((l + l+8) + (l+4 ...)) — the fixed tree of
//     `lane_sum`, which the AVX-512 path computes for 16 keys at once with shuffles and the
//     portable path one key at a time;
//   * the softmax: the max (exact in any order), exp(s_j - max) by a fixed polynomial, the sum
//     with key j in lane j mod 16 and the same tree; the output is sum_j e_j v_j, one fused
//     multiply-add per key and feature in key order, times 1 / sum.  A verification pass's rows
//     share the reads of the keys and values they all see; their sums stay in registers.
//
// Fused multiply-adds are explicit (`fma16`: the AVX-512 instruction, two AVX2 ones on halves, or
// std::fma lane by lane in the portable build: a * b + c rounded once in every case).  Everything
// else is compiled with -ffp-contract=off and without -ffast-math: the compiler may neither fuse a
// multiply-add nor reorder a sum.  Work is split across threads by (KV head, row, query head) units
// only, never within one.
// On AVX2 the hot loops (scores, value sums) run on 8-lane registers directly: GCC lowers the
// 16-lane vector type into halves that go through memory there.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "specdec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;
// 16-lane sums a value-weighting tile keeps in registers: 24 of the 32 AVX-512 registers; with
// 16 AVX2 registers of 8 lanes, 4 (8 registers), so that nothing spills
#if defined(__AVX512F__)
constexpr int kSumRegs = 24;
#else
constexpr int kSumRegs = 4;
#endif
// 16 floats as one value (GCC / clang vector extension): element-wise IEEE arithmetic, so lane l
// of a vector expression is bitwise the scalar expression on lane l's inputs.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

inline v16 load(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline void store(float* p, v16 x) { std::memcpy(p, &x, sizeof(x)); }

// A float16 cache's values (IEEE binary16 bits) widened to float32: exact, so every path below
// computes on the same floats whichever instruction widened them.
using half_t = uint16_t;

inline float half_to_float(half_t h) {  // the portable widening (subnormals and inf / NaN kept)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: man x 2^-24, exact in float32
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float to_f(float x) { return x; }
inline float to_f(half_t x) {
#if defined(__F16C__)
  return _cvtsh_ss(x);
#else
  return half_to_float(x);
#endif
}

inline v16 load(const half_t* p) {
#if defined(__AVX512F__)
  const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  v16 r;
  std::memcpy(&r, &x, sizeof(r));
  return r;
#elif defined(__F16C__)
  __m256 x[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                 _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  v16 r;
  std::memcpy(&r, x, sizeof(r));
  return r;
#else
  v16 r;
  for (int l = 0; l < kLanes; ++l) r[l] = half_to_float(p[l]);
  return r;
#endif
}

// n (<= 16) values into floats (a tail of features)
template <class KV>
inline void widen(float* out, const KV* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_f(p[i]);
}

#if defined(__AVX__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#if defined(__F16C__)
inline __m256 load8(const half_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
#endif

// exp(x) for x <= 0 (x = s - max), flushed to 0 below -87: Cody-Waite reduction by ln 2 and a
// degree-6 polynomial (the classic single-precision coefficients).  One template for a float and
// for 16 lanes: the same operations, so a key's weight does not depend on which one computed it.
constexpr float kLog2e = 1.44269504088896341f, kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

inline int32_t to_int(float x) { return static_cast<int32_t>(x); }  // truncation
inline i16 to_int(v16 x) { return __builtin_convertvector(x, i16); }
inline float to_float(int32_t n) { return static_cast<float>(n); }
inline v16 to_float(i16 n) { return __builtin_convertvector(n, v16); }
template <class F, class I>
inline F bits_as(I bits) {
  F f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// a * b + c rounded once, lane by lane: the same bits from the AVX-512 instruction and from
// std::fma (the portable path), so the vector and scalar code of a row agree.
inline v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX__) && defined(__FMA__)
  __m256 x[2], y[2], z[2];
  std::memcpy(x, &a, sizeof(x));
  std::memcpy(y, &b, sizeof(y));
  std::memcpy(z, &c, sizeof(z));
  z[0] = _mm256_fmadd_ps(x[0], y[0], z[0]);
  z[1] = _mm256_fmadd_ps(x[1], y[1], z[1]);
  v16 r;
  std::memcpy(&r, z, sizeof(r));
  return r;
#else
  v16 r;
  for (int l = 0; l < kLanes; ++l) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
#endif
}

inline float fma_(float a, float b, float c) { return std::fma(a, b, c); }
inline v16 fma_(v16 a, v16 b, v16 c) { return fma16(a, b, c); }

template <class F>
inline F exp_neg(F x0) {
  const F lo = F{} - 87.0f;
  const F x = x0 < lo ? lo : x0;
  const auto ni = to_int(x * kLog2e - 0.5f);  // truncation = rounding to nearest for x <= 0
  const F n = to_float(ni);
  F r = x - n * kC1;
  r = r - n * kC2;
  F p = F{} + kP0;
  p = fma_(p, r, F{} + kP1);
  p = fma_(p, r, F{} + kP2);
  p = fma_(p, r, F{} + kP3);
  p = fma_(p, r, F{} + kP4);
  p = fma_(p, r, F{} + kP5);
  p = p * (r * r) + r + 1.0f;
  const F scale = bits_as<F>((ni + 127) << 23);
  return x0 < lo ? F{} : p * scale;
}

// The 16 lanes summed in the fixed tree: h8[l] = a[l] + a[l+8], h4[l] = h8[l] + h8[l+4],
// h2[l] = h4[l] + h4[l+2], then h2[0] + h2[1].
inline float lane_sum(v16 a) {
#if !defined(__AVX512F__) && defined(__AVX__)
  __m256 half[2];  // the same additions on vectors: lanes l and l + 8, then l and l + 4, ...
  std::memcpy(half, &a, sizeof(half));
  const __m256 h8 = _mm256_add_ps(half[0], half[1]);
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));  // [h4[0] + h4[2], h4[1] + h4[3], ...]
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
#else
  float f[kLanes];
  store(f, a);
  float h8[8], h4[4];
  for (int l = 0; l < 8; ++l) h8[l] = f[l] + f[l + 8];
  for (int l = 0; l < 4; ++l) h4[l] = h8[l] + h8[l + 4];
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
#endif
}

#if !defined(__AVX512F__) && defined(__AVX__) && defined(__FMA__)
// exp_neg on 8 lanes (AVX2): the same operations as the template, lane by lane, written on
// 8-lane registers because GCC lowers the 16-lane vector type through memory here.
inline __m256 exp_neg8(__m256 x0) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 below = _mm256_cmp_ps(x0, lo, _CMP_LT_OQ);
  const __m256 x = _mm256_blendv_ps(x0, lo, below);
  const __m256i ni = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _mm256_set1_ps(0.5f)));
  const __m256 n = _mm256_cvtepi32_ps(ni);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(kC1)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(kC2)));
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23));
  return _mm256_blendv_ps(_mm256_mul_ps(p, scale), _mm256_setzero_ps(), below);
}
#endif

// One (row, head)'s softmax in place over its nk scores sh: the max (exact in any order), then
// e_i = exp_neg(s_i - max) with key i in lane i mod 16, the lanes summed in lane_sum's tree;
// returns 1 / sum.
inline float softmax_inplace(float* sh, int64_t nk) {
#if !defined(__AVX512F__) && defined(__AVX__) && defined(__FMA__)
  __m256 mlo = _mm256_set1_ps(sh[0]), mhi = mlo;  // lanes 0-7 and 8-15; max_ps(x, m) is x > m ? x : m
  int64_t i = 0;
  for (; i + kLanes <= nk; i += kLanes) {
    mlo = _mm256_max_ps(_mm256_loadu_ps(sh + i), mlo);
    mhi = _mm256_max_ps(_mm256_loadu_ps(sh + i + 8), mhi);
  }
  alignas(32) float mv[kLanes];
  _mm256_store_ps(mv, mlo);
  _mm256_store_ps(mv + 8, mhi);
  float m = sh[0];
  for (int l = 0; l < kLanes; ++l) m = mv[l] > m ? mv[l] : m;
  for (; i < nk; ++i) m = sh[i] > m ? sh[i] : m;
  const __m256 mm = _mm256_set1_ps(m);
  __m256 slo = _mm256_setzero_ps(), shi = _mm256_setzero_ps();
  i = 0;
  for (; i + kLanes <= nk; i += kLanes) {
    const __m256 elo = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(sh + i), mm));
    const __m256 ehi = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(sh + i + 8), mm));
    _mm256_storeu_ps(sh + i, elo);
    _mm256_storeu_ps(sh + i + 8, ehi);
    slo = _mm256_add_ps(slo, elo);
    shi = _mm256_add_ps(shi, ehi);
  }
  alignas(32) float tail[kLanes] = {0};
  for (int64_t l = 0; i + l < nk; ++l) tail[l] = sh[i + l] = exp_neg(sh[i + l] - m);
  slo = _mm256_add_ps(slo, _mm256_load_ps(tail));
  shi = _mm256_add_ps(shi, _mm256_load_ps(tail + 8));
  const __m256 h8 = _mm256_add_ps(slo, shi);  // lane_sum's tree on the two halves
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  return 1.0f / _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
#else
  v16 mv = v16{} + sh[0];
  int64_t i = 0;
  for (; i + kLanes <= nk; i += kLanes) {
    const v16 x = load(sh + i);
    mv = x > mv ? x : mv;
  }
  float m = sh[0];
  for (int l = 0; l < kLanes; ++l) m = mv[l] > m ? mv[l] : m;
  for (; i < nk; ++i) m = sh[i] > m ? sh[i] : m;
  v16 lanes{};  // key i in lane i mod 16
  i = 0;
  for (; i + kLanes <= nk; i += kLanes) {
    const v16 e = exp_neg(load(sh + i) - m);
    store(sh + i, e);
    lanes = lanes + e;
  }
  float tail[kLanes] = {0};
  for (int64_t l = 0; i + l < nk; ++l) tail[l] = sh[i + l] = exp_neg(sh[i + l] - m);
  lanes = lanes + load(tail);
  return 1.0f / lane_sum(lanes);
#endif
}

// q . k with feature c in lane c mod 16 (the tail's missing features add exact zeros), not yet summed.
template <int NV, class KV>
inline v16 dot_lanes(const float* q, const KV* k, int64_t d) {
  v16 acc{};
  if constexpr (NV > 0) {
    for (int c = 0; c < NV; ++c) acc = fma16(load(q + 16 * c), load(k + 16 * c), acc);
  } else {
    int64_t c = 0;
    for (; c + kLanes <= d; c += kLanes) acc = fma16(load(q + c), load(k + c), acc);
    if (c < d) {
      float qt[kLanes] = {0}, kt[kLanes] = {0};
      std::memcpy(qt, q + c, sizeof(float) * (d - c));
      widen(kt, k + c, d - c);
      acc = fma16(load(qt), load(kt), acc);
    }
  }
  return acc;
}

// lane_sum(dot_lanes<NV>(q, k, d)): one key's score.
#if !defined(__AVX512F__) && defined(__AVX__) && defined(__FMA__) && defined(__F16C__)
// On AVX2 the 16 lanes are two 8-lane registers: the same fused multiply-adds, lane by lane, and
// the same tree of additions, without the round trips through memory that GCC's lowering of
// 16-lane vectors costs here.
template <int NV, class KV>
inline float dot_sum(const float* q, const KV* k, int64_t d) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + kLanes <= (NV > 0 ? 16 * NV : d); c += kLanes) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8(k + c), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), load8(k + c + 8), hi);
  }
  if (NV == 0 && c < d) {  // the tail: zeros for the missing features, as dot_lanes pads
    alignas(32) float qt[kLanes] = {0}, kt[kLanes] = {0};
    std::memcpy(qt, q + c, sizeof(float) * (d - c));
    widen(kt, k + c, d - c);
    lo = _mm256_fmadd_ps(_mm256_load_ps(qt), _mm256_load_ps(kt), lo);
    hi = _mm256_fmadd_ps(_mm256_load_ps(qt + 8), _mm256_load_ps(kt + 8), hi);
  }
  const __m256 h8 = _mm256_add_ps(lo, hi);
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}
#else
template <int NV, class KV>
inline float dot_sum(const float* q, const KV* k, int64_t d) {
  return lane_sum(dot_lanes<NV>(q, k, d));
}
#endif

#if defined(__AVX512F__)
// lane_sum of 16 vectors at once: out[i] = lane_sum(a[i]), bitwise (the same additions, paired
// by shuffles instead of one vector at a time).
inline __m512 lane_sums16(const __m512* a) {
  __m512 h8[8], h4[4], h2[2];
  for (int i = 0; i < 8; ++i) {  // [a.lo8 + a.hi8 | b.lo8 + b.hi8]
    const __m512 x = a[2 * i], y = a[2 * i + 1];
    h8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 4 keys x [h8[0..3] + h8[4..7]]
    const __m512 x = h8[2 * i], y = h8[2 * i + 1];
    h4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // per 128-bit block, two keys x [h4[0] + h4[2], h4[1] + h4[3]]
    const __m512 x = h4[2 * i], y = h4[2 * i + 1];
    h2[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
  }
  const __m512 h1 = _mm512_add_ps(_mm512_shuffle_ps(h2[0], h2[1], 0x88), _mm512_shuffle_ps(h2[0], h2[1], 0xDD));
  // lane 4m + p of h1 holds key 4p + m (block m of each step holds keys m, 4 + m, ...): transpose back
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, h1);
}
#endif

// Rows r0 .. r0 + R - 1 of one KV head: row r's keys are its prefix [0, pre[r]) then the slots
// extra[r][0 .. n_extra[r]).  The rows share every read of a prefix key or value (a verification
// pass's rows see nearly the same keys), but each row's arithmetic is exactly what it would be
// alone: its scores, softmax and key-ordered value sums involve only its own keys.
struct Rows {
  const float* q;       // row r0's first query head of this KV head; rows q_stride apart
  int64_t q_stride;     // floats between consecutive rows' query heads
  float* out;           // same layout as q
  const int64_t* pre;   // [R] prefix lengths
  const int64_t* const* extra;  // [R] slot lists (may be null when n_extra[r] == 0)
  const int64_t* n_extra;       // [R]
  int64_t count;        // R
};

// sum_j w[t][j] v_j for NP (row, head) pairs over the same keys 0 .. n-1, one fused
// multiply-add per key and feature in key order; the sums stay in registers, v_j is read once.
template <int NV, int NP, class KV>
inline void pv_tile(const float* const* w, const KV* v, int64_t key_stride, int64_t n, v16 (*acc)[NV]) {
  v16 a[NP][NV];
#pragma GCC unroll 16
  for (int t = 0; t < NP; ++t)
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) a[t][c] = v16{};
  for (int64_t jj = 0; jj < n; ++jj) {
    const KV* vj = v + jj * key_stride;
    v16 x[NV];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) x[c] = load(vj + 16 * c);
#pragma GCC unroll 16
    for (int t = 0; t < NP; ++t) {
      const v16 wt = v16{} + w[t][jj];
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) a[t][c] = fma16(wt, x[c], a[t][c]);
    }
  }
  for (int t = 0; t < NP; ++t)
    for (int c = 0; c < NV; ++c) acc[t][c] = a[t][c];
}

#if !defined(__AVX512F__) && defined(__AVX__) && defined(__FMA__)
// pv_tile in 8-lane registers (AVX2): the same fused multiply-add per key, lane and pair.
template <int NV, int NP, class KV>
inline void pv_tile_avx2(const float* const* w, const KV* v, int64_t key_stride, int64_t n, v16 (*acc)[NV]) {
  __m256 a[NP][2 * NV];
  for (int t = 0; t < NP; ++t)
    for (int c = 0; c < 2 * NV; ++c) a[t][c] = _mm256_setzero_ps();
  for (int64_t jj = 0; jj < n; ++jj) {
    const KV* vj = v + jj * key_stride;
    __m256 x[2 * NV];
    for (int c = 0; c < 2 * NV; ++c) x[c] = load8(vj + 8 * c);
    for (int t = 0; t < NP; ++t) {
      const __m256 wt = _mm256_set1_ps(w[t][jj]);
      for (int c = 0; c < 2 * NV; ++c) a[t][c] = _mm256_fmadd_ps(wt, x[c], a[t][c]);
    }
  }
  for (int t = 0; t < NP; ++t) std::memcpy(acc[t], a[t], sizeof(a[t]));
}
#endif

template <int NV, int NP, class KV>
void pv_dispatch(int np, const float* const* w, const KV* v, int64_t key_stride, int64_t n, v16 (*acc)[NV]) {
  if constexpr (NP > 1) {
    if (np < NP) return pv_dispatch<NV, NP - 1>(np, w, v, key_stride, n, acc);
  }
#if !defined(__AVX512F__) && defined(__AVX__) && defined(__FMA__) && defined(__F16C__)
  pv_tile_avx2<NV, NP>(w, v, key_stride, n, acc);
#else
  pv_tile<NV, NP>(w, v, key_stride, n, acc);
#endif
}

template <int NV, class KV>
void attend_rows_typed(const Rows& rows, int64_t g, int64_t d, const KV* k, const KV* v, int64_t key_stride,
                       std::vector<float>& buf) {
  const int64_t R = rows.count;
  int64_t max_pre = 0, total = 0;
  std::vector<int64_t> off(static_cast<size_t>(R + 1));
  for (int64_t r = 0; r < R; ++r) {
    max_pre = rows.pre[r] > max_pre ? rows.pre[r] : max_pre;
    off[r] = total;
    total += g * (rows.pre[r] + rows.n_extra[r]);
  }
  off[R] = total;
  buf.resize(static_cast<size_t>(total + R * g));
  float* s = buf.data();            // row r, head h: s + off[r] + h * n_keys(r)
  float* inv = s + total;           // [R, G]
  auto n_keys = [&](int64_t r) { return rows.pre[r] + rows.n_extra[r]; };
  // scores: prefix keys in blocks of 16 shared by the rows that see the whole block
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + kLanes <= max_pre; j += kLanes) {
    for (int64_t r = 0; r < R; ++r) {
      if (j + kLanes > rows.pre[r]) continue;
      const float* qr = rows.q + r * rows.q_stride;
      for (int64_t h = 0; h < g; ++h) {
        __m512 part[kLanes];
        for (int i = 0; i < kLanes; ++i) {
          const v16 a = dot_lanes<NV>(qr + h * d, k + (j + i) * key_stride, d);
          std::memcpy(&part[i], &a, sizeof(a));
        }
        _mm512_storeu_ps(s + off[r] + h * n_keys(r) + j, lane_sums16(part));
      }
    }
  }
#endif
  for (int64_t r = 0; r < R; ++r) {  // what no shared block covered, one key at a time (the same bits)
    const float* qr = rows.q + r * rows.q_stride;
#if defined(__AVX512F__)
    const int64_t done = rows.pre[r] / kLanes * kLanes < j ? rows.pre[r] / kLanes * kLanes : j;  // its shared blocks
#else
    const int64_t done = 0;
#endif
    for (int64_t jj = done; jj < n_keys(r); ++jj) {
      const int64_t slot = jj < rows.pre[r] ? jj : rows.extra[r][jj - rows.pre[r]];
      for (int64_t h = 0; h < g; ++h)
        s[off[r] + h * n_keys(r) + jj] = dot_sum<NV>(qr + h * d, k + slot * key_stride, d);
    }
  }
  // softmax per row and head
  for (int64_t r = 0; r < R; ++r) {
    const int64_t nk = n_keys(r);
    for (int64_t h = 0; h < g; ++h) inv[r * g + h] = softmax_inplace(s + off[r] + h * nk, nk);
  }
  // out = sum_j e_j v_j in each row's key order (the shared prefix values first, then its
  // extras), one fused multiply-add per key and feature, then times 1 / sum
  const int64_t pairs = R * g;
  auto weights = [&](int64_t p) { return s + off[p / g] + (p % g) * n_keys(p / g); };  // pair p's e_j, key order
  auto slot = [&](int64_t p, int64_t jj) { const int64_t r = p / g; return jj < rows.pre[r] ? jj : rows.extra[r][jj - rows.pre[r]]; };
  auto finish = [&](int64_t p, const float* a) {
    const int64_t r = p / g, h = p % g;
    float* o = rows.out + r * rows.q_stride + h * d;
    for (int64_t c = 0; c < d; ++c) o[c] = a[c] * inv[r * g + h];
  };
  if constexpr (NV > 0) {
    constexpr int kTile = NV >= kSumRegs ? 1 : kSumRegs / NV;  // (row, head) pairs whose sums stay in registers
    for (int64_t p0 = 0; p0 < pairs; p0 += kTile) {
      const int np = pairs - p0 < kTile ? static_cast<int>(pairs - p0) : kTile;
      int64_t common = rows.pre[p0 / g];
      for (int t = 1; t < np; ++t) common = rows.pre[(p0 + t) / g] < common ? rows.pre[(p0 + t) / g] : common;
      const float* wrow[kTile];  // each pair's key weights
      for (int t = 0; t < kTile; ++t) {
        const int64_t p = p0 + (t < np ? t : 0);
        wrow[t] = weights(p);
      }
      v16 acc[kTile][NV];
      pv_dispatch<NV, kTile>(np, wrow, v, key_stride, common, acc);
      for (int t = 0; t < kTile; ++t) {
        if (t >= np) break;
        const int64_t p = p0 + t;
        const float* wp = wrow[t];
        v16 sum[NV];
        for (int c = 0; c < NV; ++c) sum[c] = acc[t][c];
        for (int64_t jj = common; jj < n_keys(p / g); ++jj) {  // the rest of this pair's keys, in order
          const KV* vj = v + slot(p, jj) * key_stride;
          const v16 w = v16{} + wp[jj];
          for (int c = 0; c < NV; ++c) sum[c] = fma16(w, load(vj + 16 * c), sum[c]);
        }
        float a[16 * NV];
        for (int c = 0; c < NV; ++c) store(a + 16 * c, sum[c]);
        finish(p, a);
      }
    }
  } else {
    std::vector<float> a(static_cast<size_t>(d));
    for (int64_t p = 0; p < pairs; ++p) {
      for (int64_t c = 0; c < d; ++c) a[c] = 0.0f;
      const float* wp = weights(p);
      for (int64_t jj = 0; jj < n_keys(p / g); ++jj) {
        const KV* vj = v + slot(p, jj) * key_stride;
        const float w = wp[jj];
        for (int64_t c = 0; c < d; ++c) a[c] = std::fma(w, to_f(vj[c]), a[c]);
      }
      finish(p, a.data());
    }
  }
}

// attend_rows_typed over a cache of either dtype (k and v untyped, elements of `half` ? 2 : 4 bytes)
template <int NV>
void attend_rows(const Rows& rows, int64_t g, int64_t d, const void* k, const void* v, bool half, int64_t key_stride,
                 std::vector<float>& buf) {
  if (half)
    attend_rows_typed<NV>(rows, g, d, static_cast<const half_t*>(k), static_cast<const half_t*>(v), key_stride, buf);
  else
    attend_rows_typed<NV>(rows, g, d, static_cast<const float*>(k), static_cast<const float*>(v), key_stride, buf);
}

using RowsFn = void (*)(const Rows&, int64_t, int64_t, const void*, const void*, bool, int64_t, std::vector<float>&);

RowsFn rows_fn(int64_t d) {
  switch (d) {
    case 64: return attend_rows<4>;
    case 128: return attend_rows<8>;
    case 256: return attend_rows<16>;
    default: return attend_rows<0>;
  }
}

constexpr int64_t kRowChunk = 8;  // rows sharing key/value reads in one call of attend_rows
// rows of one call from which a float16 cache's keys and values are widened to float32 once, up
// front, instead of in every (row, head)'s reads: with the keys in cache the kernel over float16
// runs at ~0.85 of its float32 speed from two rows on (a prompt's pass is compute), while widening
// 6,000 keys of SmolLM2's three KV heads takes a fraction of a millisecond a layer -- paid back
// from a few dozen rows; verification passes (a few rows) keep reading float16
constexpr int64_t kWidenRows = 32;
// rows x keys x query heads x head size below which a pass stays on the calling thread: 2^16,
// measured on an AVX2 Zen 3 (one row over 200 keys went from ~25-30 us per layer on one core to
// 0.8x that on two) and on an AVX-512 + AMX Xeon (scripts/library_ab.py against 2^19)
constexpr int64_t kParallelWork = 1 << 16;

// The rows of one or more sequences (a batching server's pass), each against its own cache:
// q and out [M, Hq * d] rows; sequence i's rows [seqs[i].row, + n) see its keys as attend's
// rows do.  Work units are (sequence, KV head, row, query head) in that order; part t of P takes
// units [t U / P, (t + 1) U / P), so the threads get equal shares whatever the sequences' sizes,
// in one parallel region per layer for the whole pass (a region per sequence and layer had cost a
// 16-sequence pass ~2.5 ms of its ~12 on two Zen 5 cores).  Within a sequence's KV head a part is a run of rows (the first and the last
// may hold only some of the query heads), taken in chunks of at most kRowChunk rows of even size
// that share their key and value reads.  A (row, query head) pair is one part's, so no split
// changes its arithmetic (a pair's scores, softmax and value sums never involve another pair):
// a sequence's rows are bitwise what attend gives them alone.  The split this replaced within
// one sequence, tasks of (KV head, chunk of 8 rows, share of the query heads) dealt out by count,
// gave one thread 17 of a nine-row pass's 27 (row, KV head) pairs and the other 10, and read a
// one-row pass's keys and values nine times (once per query head) instead of four.  Small passes
// stay on the calling thread.
void attend_seqs(const float* qp, float* op, int64_t hq, int64_t hk, int64_t d,
                 const std::vector<specdec::AttnSeq>& seqs) {
  const int64_t g = hq / hk;
  const RowsFn fn = rows_fn(d);
  std::vector<int64_t> first(seqs.size() + 1, 0);  // sequence i's units start at first[i]
  int64_t work = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    first[i + 1] = first[i] + seqs[i].n * hq;
    work += seqs[i].n * hk * (seqs[i].start + seqs[i].n) * g * d;
  }
  const int64_t units = first.back();
  if (units == 0) return;
  const bool parallel = work >= kParallelWork;
  const int64_t parts = parallel ? std::min<int64_t>(at::get_num_threads(), units) : 1;
  at::parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    int64_t pre[kRowChunk], n_extra[kRowChunk];
    const int64_t* extra[kRowChunk];
    for (int64_t part = lo; part < hi; ++part) {
      const int64_t part_lo = units * part / parts, part_hi = units * (part + 1) / parts;
      for (size_t i = 0; i < seqs.size(); ++i) {
        if (first[i + 1] <= part_lo || first[i] >= part_hi) continue;
        const specdec::AttnSeq& sq = seqs[i];
        const int64_t n = sq.n, start = sq.start, e = sq.e;
        const bool tree = sq.paths != nullptr;
        const int64_t u_end = std::min(part_hi, first[i + 1]) - first[i];  // this sequence's units, its own count
        for (int64_t u = std::max(part_lo, first[i]) - first[i]; u < u_end;) {
          const int64_t h = u / (n * g), r0 = u / g % n, j0 = u % g;
          const int64_t left = std::min(u_end, (h + 1) * n * g) - u;  // units of this part in KV head h
          int64_t count, gt;
          if (j0 > 0 || left < g) {  // one row, some of its query heads
            count = 1;
            gt = std::min(g - j0, left);
          } else {  // whole rows, in chunks of even size
            const int64_t whole = left / g, chunks = (whole + kRowChunk - 1) / kRowChunk;
            count = (whole + chunks - 1) / chunks;
            gt = g;
          }
          for (int64_t c = 0; c < count; ++c) {
            const int64_t r = r0 + c;
            if (tree) {
              pre[c] = start;
              extra[c] = sq.paths + r * e;
              n_extra[c] = 0;
              while (n_extra[c] < e && extra[c][n_extra[c]] >= 0) ++n_extra[c];
            } else {
              pre[c] = start + r + 1;
              extra[c] = nullptr;
              n_extra[c] = 0;
            }
          }
          const int64_t h0 = h * g + j0, at_row = sq.row + r0;
          const Rows rows{qp + (at_row * hq + h0) * d, hq * d, op + (at_row * hq + h0) * d, pre, extra, n_extra, count};
          const int64_t skip = h * sq.head_stride * (sq.half ? 2 : 4);  // bytes to KV head h
          fn(rows, gt, d, static_cast<const char*>(sq.k) + skip, static_cast<const char*>(sq.v) + skip, sq.half,
             sq.key_stride, buf);
          u += count * gt;
        }
      }
    }
  });
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                  const c10::optional<at::Tensor>& paths) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attend: q [n, Hq, d], k and v [Hkv, T, d]");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "attend: q must be float32");
  TORCH_CHECK((k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf) && v.scalar_type() == k.scalar_type(),
              "attend: k and v must both be float32 or both float16");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides(), "attend: k and v must have one layout");
  TORCH_CHECK(k.stride(2) == 1, "attend: the cache's last dimension must be contiguous");
  const at::Tensor qc = q.contiguous();
  const int64_t n = qc.size(0), hq = qc.size(1), d = qc.size(2), hk = k.size(0), t = k.size(1);
  TORCH_CHECK(k.size(2) == d && hk > 0 && hq % hk == 0, "attend: head layout mismatch");
  const bool tree = paths.has_value() && paths->defined();
  at::Tensor pc;
  int64_t e = 0;
  if (tree) {
    pc = paths->to(at::kLong).contiguous();
    TORCH_CHECK(pc.dim() == 2 && pc.size(0) == n, "attend: paths must be [n, E]");
    e = pc.size(1);
    TORCH_CHECK(start >= 0 && start <= t, "attend: prefix beyond the cache");
    const int64_t* pp = pc.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) {
      int64_t len = 0;
      while (len < e && pp[r * e + len] >= 0) {
        TORCH_CHECK(pp[r * e + len] < t, "attend: a path slot beyond the cache");
        ++len;
      }
      TORCH_CHECK(start + len > 0, "attend: a row with no keys");
    }
  } else {
    TORCH_CHECK(start >= 0 && start + n <= t, "attend: rows beyond the cache");
  }
  at::Tensor out = at::empty({n, hq * d}, qc.options());
  const float* qp = qc.data_ptr<float>();
  bool half = k.scalar_type() == at::kHalf;
  float* op = out.data_ptr<float>();
  const int64_t* pp = tree ? pc.data_ptr<int64_t>() : nullptr;
  at::Tensor kw = k, vw = v;
  if (half && n >= kWidenRows) {  // many rows: the keys and values they see widened once, up front
    int64_t used = tree ? start : start + n;
    for (int64_t i = 0; tree && i < n * e; ++i) used = std::max(used, pp[i] + 1);
    kw = k.narrow(1, 0, used).to(at::kFloat);  // [Hkv, used, d] contiguous: the same floats
    vw = v.narrow(1, 0, used).to(at::kFloat);
    half = false;
  }
  const int64_t ks = kw.stride(1), hs = kw.stride(0);
  attend_seqs(qp, op, hq, hk, d, {specdec::AttnSeq{kw.data_ptr(), vw.data_ptr(), ks, hs, start, 0, n, pp, e, half}});
  return out;
}

// Several sequences' rows in one call (see attend_seqs), each against its own cache:
// q [M, Hq, d], k[i] / v[i] [Hkv, T_i, d], sequence i's rows the next sizes[i] of q, at starts[i].
at::Tensor attend_batch(const at::Tensor& q, const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v,
                        const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "attend_batch: q must be float32 [M, Hq, d]");
  TORCH_CHECK(k.size() == sizes.size() && v.size() == sizes.size() && starts.size() == sizes.size(),
              "attend_batch: one k, v, start and size per sequence");
  const at::Tensor qc = q.contiguous();
  const int64_t m = qc.size(0), hq = qc.size(1), d = qc.size(2);
  TORCH_CHECK(!k.empty(), "attend_batch: no sequences");
  const int64_t hk = k[0].dim() == 3 ? k[0].size(0) : 0;
  TORCH_CHECK(hk > 0 && hq % hk == 0, "attend_batch: head layout mismatch");
  std::vector<specdec::AttnSeq> seqs;
  int64_t row = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK(k[i].dim() == 3 && k[i].sizes() == v[i].sizes() && k[i].strides() == v[i].strides() &&
                    (k[i].scalar_type() == at::kFloat || k[i].scalar_type() == at::kHalf) &&
                    v[i].scalar_type() == k[i].scalar_type() && k[i].stride(2) == 1,
                "attend_batch: k and v must be float32 or float16 [Hkv, T, d] of one layout and dtype, features contiguous");
    TORCH_CHECK(k[i].size(0) == hk && k[i].size(2) == d, "attend_batch: head layout mismatch");
    TORCH_CHECK(sizes[i] >= 0 && starts[i] >= 0 && starts[i] + sizes[i] <= k[i].size(1),
                "attend_batch: rows beyond the cache");
    seqs.push_back(specdec::AttnSeq{k[i].data_ptr(), v[i].data_ptr(), k[i].stride(1), k[i].stride(0),
                                    starts[i], row, sizes[i], nullptr, 0, k[i].scalar_type() == at::kHalf});
    row += sizes[i];
  }
  TORCH_CHECK(row == m, "attend_batch: the sizes must add up to q's rows");
  at::Tensor out = at::empty({m, hq * d}, qc.options());
  attend_seqs(qc.data_ptr<float>(), out.data_ptr<float>(), hq, hk, d, seqs);
  return out;
}

}  // namespace

at::Tensor specdec::attend_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                              const c10::optional<at::Tensor>& paths) {
  return attend(q, k, v, start, paths);
}

void specdec::attend_seqs_op(const float* q, float* out, int64_t hq, int64_t hk, int64_t d,
                             const std::vector<AttnSeq>& seqs) {
  attend_seqs(q, out, hq, hk, d, seqs);
}

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, int start, Tensor? paths=None) -> Tensor");
  m.def("attend_batch(Tensor q, Tensor[] k, Tensor[] v, int[] starts, int[] sizes) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("attend", &attend);
  m.impl("attend_batch", &attend_batch);
}
