// GGUF's Q4_1 weights as shipped, times activations quantised to 8 bits per block of 32 inputs:
// a 4-bit product whose every output row depends on that row alone (batch-invariant by
// construction), with the packed weights streamed once for up to six rows.
//
// A Q4_1 block holds 32 consecutive inputs of one output column j: 4-bit codes w_i (0..15), a
// scale d and a minimum m (float16), weight_i = d * w_i + m.  (Q4_0 is the case m = -8 d.)  Each
// activation row is cut into the same blocks; a block's step is e = max|x_i| / 127 and its codes
// a_i = round(x_i / e) (half to even, 0 where e = 0).  Block b then contributes
//
//   t   = d * e                                   (one float32 multiply)
//   y  += t * float(sum_i w_i a_i)                (an exact int32 sum, one multiply, one add)
//   y  += m * (e * float(sum_i a_i))              (one multiply, one add)
//
// blocks in input order, each an IEEE operation on float32 — the same for every row count,
// thread count and instruction set (the integer sums are exact in any grouping; the float steps
// are element-wise and compiled with -ffp-contract=off), and what specdec's ATen reference
// (linear.q4_reference) computes op for op.  Then y *= col_j where a column factor is given.
//
//   torch.ops.specdec.q4_pack(qs uint8 [N, K/32, 16], d float16 [N, K/32], m float16 [N, K/32])
//       -> uint8 [ceil(N/32), K/32, 640]: per group of 32 columns and block, the codes of 16
//       columns x 4 byte-columns twice (512 bytes: lane j, byte p of row L holds the block's byte
//       4L + p, i.e. inputs 4L + p and 4L + p + 16 in its low and high nibble), then d and m of
//       the 32 columns as float16 (64 + 64 bytes): one contiguous stream per group
//   torch.ops.specdec.q4_linear(x float32 [n, K], gain float32 [K] (empty: none), packed,
//       n_out, col float32 [N] (empty: none)) -> y float32 [n, N], x multiplied by gain first
//   torch.ops.specdec.q4_isa() -> str: the path this build runs: "avx512-vnni", "avx2" (u8 x s8
//       pair products summed in int16, exact: see group_avx2) or "portable" (plain C++, slow)
//
// GGUF's Q6_K weights as shipped, in the same product (the last columns of a layer: packed6).  A
// Q6_K super-block holds 256 inputs of one column: 6-bit codes q_i (0..63), a float16 scale d and
// sixteen int8 scales sc_j, one per sub-block of 16 inputs; weight_i = d * sc_j * (q_i - 32).  The
// activations are the same blocks of 32 (two sub-blocks each), and block b adds
//
//   t   = d * e                                                (one float32 multiply)
//   y  += t * float(sum_j sc_j * sum_i (q_i - 32) a_i)         (an exact int32 sum below 2^24, so
//                                                               its conversion is exact too)
//
// blocks in input order (linear.q6_reference, op for op).
//
//   torch.ops.specdec.q6_pack(codes uint8 [N, K/32, 32] (0..63, input order), d float16 [N, K/32],
//       sc int8 [N, K/32, 2]) -> uint8 [ceil(N/32), K/32, 896]: per group of 32 columns and block,
//       the codes' low nibbles as q4_pack lays them out (512 bytes), their high bits (256 bytes:
//       byte 4 l' + p of lane j in half u, at u * 128 + h * 64, holds the top two bits of inputs
//       8h + 4 + p, 8h + 4 + p + 16, 8h + p and 8h + p + 16 in its bit pairs 0, 1, 2, 3: those of
//       the even quartet where a mask of bits 4-5 finds them), then d
//       of the 32 columns (float16) and sc (int8, sub-block 0's 32 then sub-block 1's)
//   q4_linear(..., packed6): columns 32 * packed.size(0) .. n_out from packed6 (packed may hold
//       no group: a layer of Q6_K blocks alone)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "specdec.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SPECDEC_Q4_VNNI 1
#define SPECDEC_Q4_AVX2 0
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define SPECDEC_Q4_VNNI 0
#define SPECDEC_Q4_AVX2 1
#else
#define SPECDEC_Q4_VNNI 0
#define SPECDEC_Q4_AVX2 0
#endif
// Q6_K columns: the AVX2 kernel wherever AVX2 runs (on AVX-512 builds too), else portable C++
#if defined(__AVX2__) && defined(__F16C__)
#define SPECDEC_Q6_AVX2 1
#else
#define SPECDEC_Q6_AVX2 0
#endif

namespace {

constexpr int kBlock = 32;      // inputs per quantisation block (GGUF's QK4_1)
constexpr int kCols = 32;       // columns per packed group
constexpr int kCodes = 512;     // code bytes per group and block
constexpr int kStride = 640;    // bytes per group and block: codes, 32 d, 32 m (float16)
constexpr int kRowsMax = 6;     // rows per register block (4 R + 3 of the 32 vector registers)
constexpr int kPrefetch = 4;    // blocks a group's stream is prefetched ahead (AVX2)
// ... on the AVX-512 VNNI path: 10 KB.  Paired against 4 and 8 on a 2-core Zen 5 (machine I in
// NOTES: products bound by memory), 16 took 1-4 row products to ~0.9-0.95 of the time and nine
// rows to ~0.86 of it; 32 lost the few-row gain again.
constexpr int kPrefetchVnni = 16;
constexpr int kHigh = 256;      // Q6: high-bit bytes per group and block
constexpr int kStride6 = 896;   // Q6: bytes per group and block: low nibbles, high bits, 32 d, 64 sc

at::Tensor q4_pack(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == 16 && qs.scalar_type() == at::kByte,
              "q4_pack: codes must be uint8 [N, K/32, 16]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.dim() == 2 &&
                  d.sizes() == m.sizes() && d.size(0) == qs.size(0) && d.size(1) == qs.size(1),
              "q4_pack: d and m must be float16 [N, K/32]");
  const at::Tensor q = qs.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  const int64_t n = q.size(0), nb = q.size(1), ng = (n + kCols - 1) / kCols;
  at::Tensor out = at::zeros({ng, nb, kStride}, q.options());
  const uint8_t* src = q.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mc.data_ptr<at::Half>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t g = j / kCols, c = j % kCols, u = c / 16, lane = c % 16;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* blk = dst + (g * nb + b) * kStride;
      for (int byte = 0; byte < 16; ++byte) blk[u * 256 + (byte / 4) * 64 + lane * 4 + byte % 4] = src[(j * nb + b) * 16 + byte];
      std::memcpy(blk + kCodes + 2 * c, dp + j * nb + b, 2);
      std::memcpy(blk + kCodes + 64 + 2 * c, mp + j * nb + b, 2);
    }
  }
  return out;
}

at::Tensor q6_pack(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& sc) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kBlock && codes.scalar_type() == at::kByte,
              "q6_pack: codes must be uint8 [N, K/32, 32]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.dim() == 2 && d.size(0) == codes.size(0) && d.size(1) == codes.size(1),
              "q6_pack: d must be float16 [N, K/32]");
  TORCH_CHECK(sc.scalar_type() == at::kChar && sc.dim() == 3 && sc.size(0) == codes.size(0) &&
                  sc.size(1) == codes.size(1) && sc.size(2) == 2,
              "q6_pack: sc must be int8 [N, K/32, 2]");
  const at::Tensor q = codes.contiguous(), dc = d.contiguous(), sq = sc.contiguous();
  const int64_t n = q.size(0), nb = q.size(1), ng = (n + kCols - 1) / kCols;
  const uint8_t* src = q.data_ptr<uint8_t>();
  for (int64_t i = 0; i < q.numel(); ++i) TORCH_CHECK(src[i] < 64, "q6_pack: codes must lie in 0..63");
  at::Tensor out = at::zeros({ng, nb, kStride6}, q.options());
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::Half>());
  const int8_t* sp = sq.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t g = j / kCols, c = j % kCols, u = c / 16, lane = c % 16;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* blk = dst + (g * nb + b) * kStride6;
      const uint8_t* w = src + (j * nb + b) * kBlock;
      for (int byte = 0; byte < 16; ++byte) {
        const int l = byte / 4, p = byte % 4;
        blk[u * 256 + l * 64 + lane * 4 + p] = static_cast<uint8_t>((w[byte] & 0x0F) | ((w[byte + 16] & 0x0F) << 4));
      }
      for (int h = 0; h < 2; ++h)
        for (int p = 0; p < 4; ++p) {
          const int i0 = 8 * h + p, i1 = 8 * h + 4 + p;  // quartets 2h and 2h + 1
          blk[kCodes + u * 128 + h * 64 + lane * 4 + p] =
              static_cast<uint8_t>((w[i1] >> 4) | ((w[i1 + 16] >> 4) << 2) | ((w[i0] >> 4) << 4) | ((w[i0 + 16] >> 4) << 6));
        }
      std::memcpy(blk + kCodes + kHigh + 2 * c, dp + j * nb + b, 2);
      blk[kCodes + kHigh + 64 + c] = static_cast<uint8_t>(sp[(j * nb + b) * 2]);
      blk[kCodes + kHigh + 96 + c] = static_cast<uint8_t>(sp[(j * nb + b) * 2 + 1]);
    }
  }
  return out;
}

std::string q4_isa() { return SPECDEC_Q4_VNNI ? "avx512-vnni" : (SPECDEC_Q4_AVX2 ? "avx2" : "portable"); }

// The activation side of every block: codes (int8 [n, nb * 32]), e (float [n, nb]) and
// e * float(sum of codes) (float [n, nb]).  Scalar code: a few thousand values per call.
void quantize_rows(const float* x, const float* gain, int64_t n, int64_t k, int64_t nb, int8_t* codes, float* step,
                   float* sums) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      float v[kBlock];
      float amax = 0.0f;
      for (int i = 0; i < kBlock; ++i) {
        const int64_t c = b * kBlock + i;
        float xv = 0.0f;
        if (c < k) xv = gain != nullptr ? x[r * k + c] * gain[c] : x[r * k + c];
        v[i] = xv;
        const float a = xv < 0.0f ? -xv : xv;
        amax = a > amax ? a : amax;
      }
      const float e = amax / 127.0f;
      int32_t total = 0;
      int8_t* q = codes + (r * nb + b) * kBlock;
      for (int i = 0; i < kBlock; ++i) {
        float qv = e != 0.0f ? std::nearbyint(v[i] / e) : 0.0f;  // round half to even
        qv = qv > 127.0f ? 127.0f : (qv < -127.0f ? -127.0f : qv);
        q[i] = static_cast<int8_t>(qv);
        total += q[i];
      }
      step[r * nb + b] = e;
      sums[r * nb + b] = e * static_cast<float>(total);
    }
}

#if SPECDEC_Q4_VNNI
// quantize_rows on 16 lanes: the same IEEE operations element by element (a product, an exact
// max, one division, rounding half to even, a clamp), so the same codes, steps and sums.
void quantize_rows_avx512(const float* x, const float* gain, int64_t n, int64_t k, int64_t nb, int8_t* codes,
                          float* step, float* sums) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      __m512 v[2];
      for (int h = 0; h < 2; ++h) {
        const int64_t c0 = b * kBlock + 16 * h;
        const int64_t left = k - c0;
        const __mmask16 m = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                                       : (left <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << left) - 1u));
        __m512 xv = _mm512_maskz_loadu_ps(m, x + r * k + c0);
        if (gain != nullptr) xv = _mm512_mul_ps(xv, _mm512_maskz_loadu_ps(m, gain + c0));
        v[h] = xv;
      }
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v[0], absmask), _mm512_and_ps(v[1], absmask)));
      const float e = amax / 127.0f;
      int8_t* q = codes + (r * nb + b) * kBlock;
      int32_t total = 0;
      for (int h = 0; h < 2; ++h) {
        __m512i qi = _mm512_setzero_si512();
        if (e != 0.0f) {
          __m512 qv = _mm512_roundscale_ps(_mm512_div_ps(v[h], _mm512_set1_ps(e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          qv = _mm512_min_ps(_mm512_max_ps(qv, lo), hi);
          qi = _mm512_cvttps_epi32(qv);
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(qi));
        total += _mm512_reduce_add_epi32(qi);
      }
      step[r * nb + b] = e;
      sums[r * nb + b] = e * static_cast<float>(total);
    }
}
#endif

#if SPECDEC_Q4_AVX2
// quantize_rows on 8 lanes (AVX2): the same IEEE operations element by element as the scalar
// code, hence the same codes, steps and sums.
void quantize_rows_avx2(const float* x, const float* gain, int64_t n, int64_t k, int64_t nb, int8_t* codes,
                        float* step, float* sums) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * kBlock;
      __m256 v[4];
      if (c0 + kBlock <= k) {
        for (int h = 0; h < 4; ++h) {
          __m256 xv = _mm256_loadu_ps(x + r * k + c0 + 8 * h);
          if (gain != nullptr) xv = _mm256_mul_ps(xv, _mm256_loadu_ps(gain + c0 + 8 * h));
          v[h] = xv;
        }
      } else {  // a padded last block: the missing inputs are zeros
        alignas(32) float t[kBlock];
        for (int i = 0; i < kBlock; ++i) {
          const int64_t c = c0 + i;
          t[i] = c < k ? (gain != nullptr ? x[r * k + c] * gain[c] : x[r * k + c]) : 0.0f;
        }
        for (int h = 0; h < 4; ++h) v[h] = _mm256_load_ps(t + 8 * h);
      }
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      const float e = _mm_cvtss_f32(m4) / 127.0f;  // the max is exact in any order
      int8_t* q = codes + (r * nb + b) * kBlock;
      __m256i total = _mm256_setzero_si256();
      for (int h = 0; h < 4; ++h) {
        __m256i qi = _mm256_setzero_si256();
        if (e != 0.0f) {
          __m256 qv = _mm256_round_ps(_mm256_div_ps(v[h], _mm256_set1_ps(e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          qv = _mm256_min_ps(_mm256_max_ps(qv, lo), hi);
          qi = _mm256_cvttps_epi32(qv);
        }
        total = _mm256_add_epi32(total, qi);
        const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
        const __m128i p8 = _mm_packs_epi16(p16, p16);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + 8 * h), p8);
      }
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
      step[r * nb + b] = e;
      sums[r * nb + b] = e * static_cast<float>(_mm_cvtsi128_si32(t4));
    }
}
#endif

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// One group of 32 columns for R rows, portable C++: exact integer sums, then the float steps.
template <int R>
void group_portable(const int8_t* codes, const float* step, const float* sums, int64_t nb, const uint8_t* wg,
                    float* out, int64_t out_stride, int64_t valid) {
  float y[R][kCols] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wg + b * kStride;
    for (int r = 0; r < R; ++r) {
      const int8_t* a = codes + (r * nb + b) * kBlock;
      const float e = step[r * nb + b], s = sums[r * nb + b];
      for (int c = 0; c < kCols; ++c) {
        const int u = c / 16, lane = c % 16;
        int32_t acc = 0;
        for (int byte = 0; byte < 16; ++byte) {
          const uint8_t w = blk[u * 256 + (byte / 4) * 64 + lane * 4 + byte % 4];
          acc += static_cast<int32_t>(w & 0x0F) * a[byte] + static_cast<int32_t>(w >> 4) * a[byte + 16];
        }
        const float t = half_to_float(blk + kCodes + 2 * c) * e;
        y[r][c] = y[r][c] + t * static_cast<float>(acc);
        y[r][c] = y[r][c] + half_to_float(blk + kCodes + 64 + 2 * c) * s;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols && c < valid; ++c) out[r * out_stride + c] = y[r][c];
}

#if SPECDEC_Q4_VNNI
// One group of 32 columns for R rows: per block, 2 x R int32 accumulators of 16 columns
// (VNNI u8 x s8 dot products of four inputs, exact), then the float steps on 16 lanes.
template <int R>
void group_vnni(const int8_t* codes, const float* step, const float* sums, int64_t nb, const uint8_t* wg, float* out,
                int64_t out_stride, int64_t valid) {
  __m512 y[R][2];
  for (int r = 0; r < R; ++r) y[r][0] = y[r][1] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wg + b * kStride;
    const uint8_t* ahead = blk + kPrefetchVnni * kStride;
    for (int line = 0; line < kStride; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    __m512i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int l = 0; l < 4; ++l) {
      for (int u = 0; u < 2; ++u) {
        const __m512i v = _mm512_loadu_si512(blk + u * 256 + l * 64);
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = codes + (r * nb + b) * kBlock + 4 * l;
          int32_t a_lo, a_hi;
          std::memcpy(&a_lo, a, 4);
          std::memcpy(&a_hi, a + 16, 4);
          acc[r][u] = _mm512_dpbusd_epi32(acc[r][u], lo, _mm512_set1_epi32(a_lo));
          acc[r][u] = _mm512_dpbusd_epi32(acc[r][u], hi, _mm512_set1_epi32(a_hi));
        }
      }
    }
    for (int u = 0; u < 2; ++u) {
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kCodes + 32 * u)));
      const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kCodes + 64 + 32 * u)));
      for (int r = 0; r < R; ++r) {
        const __m512 t = _mm512_mul_ps(dw, _mm512_set1_ps(step[r * nb + b]));
        y[r][u] = _mm512_add_ps(y[r][u], _mm512_mul_ps(t, _mm512_cvtepi32_ps(acc[r][u])));
        y[r][u] = _mm512_add_ps(y[r][u], _mm512_mul_ps(mw, _mm512_set1_ps(sums[r * nb + b])));
      }
    }
  }
  for (int u = 0; u < 2; ++u) {
    const int64_t v = valid - 16 * u;
    if (v <= 0) break;
    const __mmask16 mask = v >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << v) - 1u);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * out_stride + 16 * u, mask, y[r][u]);
  }
}
#endif

#if SPECDEC_Q4_AVX2
// One group of 32 columns for R rows (AVX2), in one pass over the group's stream: per block and
// octet of columns, the R rows' products of four inputs summed in int16 lanes (u8 x s8 pairs, then
// 16 products per lane: at most 16 x 15 x 127 = 30,480, so nothing saturates and the sums are
// exact), widened to int32, then the float steps on 8 lanes into the rows' sums, which live in a
// small array on the stack (L1) rather than in registers.  Each block's 640 bytes are unpacked
// once for all R rows and all 32 columns, so the weights stream in from memory while the products
// run.  The kernel this replaced passed over each group once per 16 columns and three rows, and
// the first pass waited on memory with little to compute.  Machine F (Zen 3), SmolLM2's 120 layer
// products on two threads, paired in one process: 0.80 of the time for one row, 0.78 for two,
// 0.89-0.90 for three and four.
template <int R>
void group_avx2(const int8_t* codes, const float* step, const float* sums, int64_t nb, const uint8_t* wg, float* out,
                int64_t out_stride, int64_t valid) {
  alignas(32) float y[R][kCols] = {};
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wg + b * kStride;
    const uint8_t* ahead = blk + kPrefetch * kStride;
    for (int line = 0; line < kStride; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int o = 0; o < 4; ++o) {  // columns 8o .. 8o + 7: half o / 2 of the codes, lanes 8 (o % 2) ..
      __m256i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (o / 2) * 256 + l * 64 + 32 * (o % 2)));
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
          // the four codes of inputs 4l .. 4l + 3 (a + 4: 16 further) in every 32-bit lane, as one
          // vbroadcastss load (a bit-exact move; the codes were written by quantize_rows_*, called
          // before this function through the group table).  Measured on machine F against
          // memcpy + set1 (a move through a general register): ~25 % off 3- and 6-row products
          const float* a = reinterpret_cast<const float*>(codes + (r * nb + b) * kBlock + 4 * l);
          acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(lo, _mm256_castps_si256(_mm256_broadcast_ss(a))));
          acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(hi, _mm256_castps_si256(_mm256_broadcast_ss(a + 4))));
        }
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kCodes + 16 * o)));
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kCodes + 64 + 16 * o)));
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 t = _mm256_mul_ps(dw, _mm256_set1_ps(step[r * nb + b]));
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r], ones));
        __m256 s = _mm256_load_ps(y[r] + 8 * o);
        s = _mm256_add_ps(s, _mm256_mul_ps(t, f));
        s = _mm256_add_ps(s, _mm256_mul_ps(mw, _mm256_set1_ps(sums[r * nb + b])));
        _mm256_store_ps(y[r] + 8 * o, s);
      }
    }
  }
  const int64_t v = valid < kCols ? valid : kCols;
  for (int r = 0; r < R; ++r) std::memcpy(out + r * out_stride, y[r], static_cast<size_t>(v) * sizeof(float));
}
#endif

using GroupFn = void (*)(const int8_t*, const float*, const float*, int64_t, const uint8_t*, float*, int64_t, int64_t);
#if SPECDEC_Q4_VNNI
constexpr GroupFn kGroups[kRowsMax + 1] = {nullptr, group_vnni<1>, group_vnni<2>, group_vnni<3>, group_vnni<4>,
                                           group_vnni<5>, group_vnni<6>};
#elif SPECDEC_Q4_AVX2
// Five and six rows as two passes (three rows, then two or three; the second pass reads the group
// from cache).  In the layer sweep on machine F one pass of five or six rows ran 2 % / 17 % slower
// than the old kernel (though faster in a one-product micro-benchmark; the cause was not found),
// two passes 7 % / 5 % faster.
template <int A, int B>
void group_avx2_split(const int8_t* codes, const float* step, const float* sums, int64_t nb, const uint8_t* wg, float* out,
                      int64_t out_stride, int64_t valid) {
  group_avx2<A>(codes, step, sums, nb, wg, out, out_stride, valid);
  group_avx2<B>(codes + A * nb * kBlock, step + A * nb, sums + A * nb, nb, wg, out + A * out_stride, out_stride, valid);
}
constexpr GroupFn kGroups[kRowsMax + 1] = {nullptr, group_avx2<1>, group_avx2<2>, group_avx2<3>, group_avx2<4>,
                                           group_avx2_split<3, 2>, group_avx2_split<3, 3>};
#else
constexpr GroupFn kGroups[kRowsMax + 1] = {nullptr, group_portable<1>, group_portable<2>, group_portable<3>,
                                           group_portable<4>, group_portable<5>, group_portable<6>};
#endif

// ---- Q6_K columns ----------------------------------------------------------------------------
// One group of 32 Q6_K columns for R rows, portable C++: each block's exact integer sum
// z = sum_j sc_j * sum_i (q_i - 32) a_i, then y += (d * e) * float(z).
template <int R>
void group6_portable(const int8_t* codes, const float* step, int64_t nb, const uint8_t* wg, float* out,
                     int64_t out_stride, int64_t valid) {
  float y[R][kCols] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wg + b * kStride6;
    for (int r = 0; r < R; ++r) {
      const int8_t* a = codes + (r * nb + b) * kBlock;
      for (int c = 0; c < kCols; ++c) {
        const int u = c / 16, lane = c % 16;
        int32_t acc[2] = {0, 0};
        for (int byte = 0; byte < 16; ++byte) {
          const int l = byte / 4, p = byte % 4;
          const uint8_t w = blk[u * 256 + l * 64 + lane * 4 + p];
          const uint8_t hb = blk[kCodes + u * 128 + (l / 2) * 64 + lane * 4 + p];
          const int sh = l % 2 ? 0 : 4;  // see q6_pack: the even quartet's bits sit above the odd one's
          const int32_t q0 = (w & 0x0F) | (((hb >> sh) & 0x03) << 4);
          const int32_t q1 = (w >> 4) | (((hb >> (sh + 2)) & 0x03) << 4);
          acc[0] += (q0 - 32) * a[byte];
          acc[1] += (q1 - 32) * a[byte + 16];
        }
        const int32_t z = static_cast<int8_t>(blk[kCodes + kHigh + 64 + c]) * acc[0] +
                          static_cast<int8_t>(blk[kCodes + kHigh + 96 + c]) * acc[1];
        const float t = half_to_float(blk + kCodes + kHigh + 2 * c) * step[r * nb + b];
        y[r][c] = y[r][c] + t * static_cast<float>(z);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols && c < valid; ++c) out[r * out_stride + c] = y[r][c];
}

#if SPECDEC_Q6_AVX2
// One group of 32 Q6_K columns for R rows (AVX2), one pass over the group's stream as group_avx2.
// Per block, octet of columns and pair of quartets: the codes rebuilt from their nibbles and high
// bits, u8 x s8 pair products summed in int16 over the two quartets (at most 4 x 63 x 127 = 32,004),
// less 32 times the activations' pair sums (the same for every column: computed once a block), which
// leaves sum (q - 32) a, at most 4 x 32 x 127 = 16,256 in magnitude (int16 arithmetic wraps, and the
// true difference fits); then one multiply-add by the column's int8 scale into int32.  A block's
// integer sum is at most 32 x 32 x 127 x 128 < 2^24, so its conversion to float is exact.
template <int R>
void group6_avx2(const int8_t* codes, const float* step, int64_t nb, const uint8_t* wg, float* out,
                 int64_t out_stride, int64_t valid) {
  alignas(32) float y[R][kCols] = {};
  alignas(32) int16_t m32[R][2][2][16];  // per row, quartet pair and sub-block: 32 x the pair sums
  const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
  const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wg + b * kStride6;
    const uint8_t* ahead = blk + kPrefetch * kStride6;
    for (int line = 0; line < kStride6; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 2; ++j) {
          const float* a = reinterpret_cast<const float*>(codes + (r * nb + b) * kBlock + 16 * j + 8 * h);
          const __m256i m = _mm256_add_epi16(_mm256_maddubs_epi16(k32, _mm256_castps_si256(_mm256_broadcast_ss(a))),
                                             _mm256_maddubs_epi16(k32, _mm256_castps_si256(_mm256_broadcast_ss(a + 1))));
          _mm256_store_si256(reinterpret_cast<__m256i*>(m32[r][h][j]), m);
        }
#pragma GCC unroll 4
    for (int o = 0; o < 4; ++o) {  // columns 8o .. 8o + 7
      const int u = o / 2, half = 32 * (o % 2);
      // each column's scale in both int16 halves of its 32-bit lane
      const __m256i sc0 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + kCodes + kHigh + 64 + 8 * o)), dup));
      const __m256i sc1 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + kCodes + kHigh + 96 + 8 * o)), dup));
      __m256i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kCodes + u * 128 + h * 64 + half));
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + u * 256 + (2 * h) * 64 + half));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + u * 256 + (2 * h + 1) * 64 + half));
        const __m256i lo0 = _mm256_or_si256(_mm256_and_si256(v0, low), _mm256_and_si256(hbits, high));
        const __m256i hi0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                                            _mm256_and_si256(_mm256_srli_epi16(hbits, 2), high));
        const __m256i lo1 = _mm256_or_si256(_mm256_and_si256(v1, low), _mm256_and_si256(_mm256_slli_epi16(hbits, 4), high));
        const __m256i hi1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low),
                                            _mm256_and_si256(_mm256_slli_epi16(hbits, 2), high));
#pragma GCC unroll 3
        for (int r = 0; r < R; ++r) {
          const float* a = reinterpret_cast<const float*>(codes + (r * nb + b) * kBlock + 8 * h);
          __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, _mm256_castps_si256(_mm256_broadcast_ss(a))),
                                        _mm256_maddubs_epi16(lo1, _mm256_castps_si256(_mm256_broadcast_ss(a + 1))));
          __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(hi0, _mm256_castps_si256(_mm256_broadcast_ss(a + 4))),
                                        _mm256_maddubs_epi16(hi1, _mm256_castps_si256(_mm256_broadcast_ss(a + 5))));
          s0 = _mm256_sub_epi16(s0, _mm256_load_si256(reinterpret_cast<const __m256i*>(m32[r][h][0])));
          s1 = _mm256_sub_epi16(s1, _mm256_load_si256(reinterpret_cast<const __m256i*>(m32[r][h][1])));
          acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(_mm256_madd_epi16(s0, sc0), _mm256_madd_epi16(s1, sc1)));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kCodes + kHigh + 16 * o)));
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) {
        const __m256 t = _mm256_mul_ps(d, _mm256_set1_ps(step[r * nb + b]));
        __m256 s = _mm256_load_ps(y[r] + 8 * o);
        s = _mm256_add_ps(s, _mm256_mul_ps(t, _mm256_cvtepi32_ps(acc[r])));
        _mm256_store_ps(y[r] + 8 * o, s);
      }
    }
  }
  const int64_t v = valid < kCols ? valid : kCols;
  for (int r = 0; r < R; ++r) std::memcpy(out + r * out_stride, y[r], static_cast<size_t>(v) * sizeof(float));
}
#endif

using Group6Fn = void (*)(const int8_t*, const float*, int64_t, const uint8_t*, float*, int64_t, int64_t);
#if SPECDEC_Q6_AVX2
template <int A, int B>
void group6_split(const int8_t* codes, const float* step, int64_t nb, const uint8_t* wg, float* out,
                  int64_t out_stride, int64_t valid) {
  group6_avx2<A>(codes, step, nb, wg, out, out_stride, valid);
  group6_avx2<B>(codes + A * nb * kBlock, step + A * nb, nb, wg, out + A * out_stride, out_stride, valid);
}
constexpr Group6Fn kGroups6[kRowsMax + 1] = {nullptr, group6_avx2<1>, group6_avx2<2>, group6_avx2<3>,
                                             group6_avx2<4>, group6_split<3, 2>, group6_split<3, 3>};
#else
constexpr Group6Fn kGroups6[kRowsMax + 1] = {nullptr, group6_portable<1>, group6_portable<2>, group6_portable<3>,
                                             group6_portable<4>, group6_portable<5>, group6_portable<6>};
#endif

at::Tensor q4_linear(const at::Tensor& x_in, const at::Tensor& gain, const at::Tensor& packed, int64_t n_out,
                     const at::Tensor& col, const c10::optional<at::Tensor>& packed6_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "q4_linear: x must be float32 [n, K]");
  const bool has6 = packed6_in.has_value() && packed6_in->defined() && packed6_in->numel() > 0;
  TORCH_CHECK((packed.dim() == 3 && packed.size(2) == kStride && packed.scalar_type() == at::kByte) ||
                  (has6 && packed.numel() == 0),
              "q4_linear: weights packed by q4_pack");
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(0), k = x.size(1);
  const int64_t ng = packed.dim() == 3 ? packed.size(0) : 0;  // 4-bit column groups
  int64_t nb = packed.dim() == 3 ? packed.size(1) : 0, ng6 = 0, n4 = n_out;
  if (has6) {
    const at::Tensor& p6 = *packed6_in;
    TORCH_CHECK(p6.dim() == 3 && p6.size(2) == kStride6 && p6.scalar_type() == at::kByte,
                "q4_linear: Q6_K weights packed by q6_pack");
    TORCH_CHECK(ng == 0 || p6.size(1) == nb, "q4_linear: the 4-bit and the Q6_K columns must have the same inputs");
    nb = p6.size(1);
    ng6 = p6.size(0);
    n4 = ng * kCols;  // the 4-bit columns fill whole groups
    TORCH_CHECK(n_out > n4 && (n_out - n4 + kCols - 1) / kCols == ng6, "q4_linear: shapes do not match");
  } else {
    TORCH_CHECK((n_out + kCols - 1) / kCols == ng, "q4_linear: shapes do not match");
  }
  TORCH_CHECK((k + kBlock - 1) / kBlock == nb, "q4_linear: shapes do not match");
  TORCH_CHECK(gain.numel() == 0 || (gain.scalar_type() == at::kFloat && gain.numel() == k),
              "q4_linear: gain must be float32 [K] or empty");
  TORCH_CHECK(col.numel() == 0 || (col.scalar_type() == at::kFloat && col.numel() == n_out),
              "q4_linear: col must be float32 [N] or empty");
  const at::Tensor g = gain.contiguous(), cf = col.contiguous();
  // The activation side (codes int8 [n, nb * 32], steps and sums float [n, nb]) in buffers the
  // calling thread keeps from call to call: a pass makes 120 of these products, and three tensor
  // allocations each were 2-9 % of a one-row pass (machine I, see NOTES).  Only this call reads them,
  // and it has returned before the thread can call again (they grow to the largest call: a few MB
  // for a long prompt's prefill).
  thread_local std::vector<int8_t> codes_buf;
  thread_local std::vector<float> step_buf, sums_buf;
  // only ever grown: a pass alternates 576- and 1536-wide inputs, and a shrink followed by a grow
  // would zero the difference at every product
  const size_t n_codes = static_cast<size_t>(n * nb * kBlock), n_blocks = static_cast<size_t>(n * nb);
  if (codes_buf.size() < n_codes) codes_buf.resize(n_codes);
  if (step_buf.size() < n_blocks) step_buf.resize(n_blocks);
  if (sums_buf.size() < n_blocks) sums_buf.resize(n_blocks);
#if SPECDEC_Q4_VNNI
  quantize_rows_avx512(x.data_ptr<float>(), g.numel() ? g.data_ptr<float>() : nullptr, n, k, nb,
                       codes_buf.data(), step_buf.data(), sums_buf.data());
#elif SPECDEC_Q4_AVX2
  quantize_rows_avx2(x.data_ptr<float>(), g.numel() ? g.data_ptr<float>() : nullptr, n, k, nb,
                     codes_buf.data(), step_buf.data(), sums_buf.data());
#else
  quantize_rows(x.data_ptr<float>(), g.numel() ? g.data_ptr<float>() : nullptr, n, k, nb, codes_buf.data(),
                step_buf.data(), sums_buf.data());
#endif
  at::Tensor out = at::empty({n, n_out}, x.options());
  const int8_t* cp = codes_buf.data();
  const float* sp = step_buf.data();
  const float* up = sums_buf.data();
  const uint8_t* wp = ng > 0 ? packed.data_ptr<uint8_t>() : nullptr;
  float* op = out.data_ptr<float>();
  if (!has6) {
    // groups of 32 output columns, split between threads; a column is computed by one thread
    const int64_t grain = ng * nb * kStride < (1 << 16) ? ng : (ng + 1) / 2;
    at::parallel_for(0, ng, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t gi = lo; gi < hi; ++gi)
        for (int64_t r0 = 0; r0 < n; r0 += kRowsMax) {
          const int64_t rows = n - r0 < kRowsMax ? n - r0 : kRowsMax;
          kGroups[rows](cp + r0 * nb * kBlock, sp + r0 * nb, up + r0 * nb, nb, wp + gi * nb * kStride,
                        op + r0 * n_out + gi * kCols, n_out, n_out - gi * kCols);
        }
    });
  } else {
    const uint8_t* wp6 = packed6_in->data_ptr<uint8_t>();
    // the 4-bit groups, then the Q6_K ones, cut in two at the byte half way (a Q6_K group streams
    // 896 bytes a block against 640): each half one task
    const int64_t total = ng * kStride + ng6 * kStride6;
    int64_t cut = 0;
    while (cut < ng + ng6 && 2 * (std::min(cut, ng) * kStride + std::max<int64_t>(cut - ng, 0) * kStride6) < total) ++cut;
    const int64_t bounds[3] = {0, cut, ng + ng6};
    const int64_t tasks = total * nb < (1 << 16) ? 1 : 2;
    at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t task = lo; task < hi; ++task)
        for (int64_t gi = tasks == 1 ? 0 : bounds[task]; gi < (tasks == 1 ? ng + ng6 : bounds[task + 1]); ++gi)
          for (int64_t r0 = 0; r0 < n; r0 += kRowsMax) {
            const int64_t rows = n - r0 < kRowsMax ? n - r0 : kRowsMax;
            if (gi < ng) {
              kGroups[rows](cp + r0 * nb * kBlock, sp + r0 * nb, up + r0 * nb, nb, wp + gi * nb * kStride,
                            op + r0 * n_out + gi * kCols, n_out, kCols);
            } else {
              const int64_t g6 = gi - ng;
              kGroups6[rows](cp + r0 * nb * kBlock, sp + r0 * nb, nb, wp6 + g6 * nb * kStride6,
                             op + r0 * n_out + n4 + g6 * kCols, n_out, n_out - n4 - g6 * kCols);
            }
          }
    });
  }
  if (cf.numel()) out.mul_(cf);
  return out;
}

}  // namespace

at::Tensor specdec::q4_product(const at::Tensor& x, const at::Tensor& gain, const at::Tensor& packed, int64_t n_out,
                               const at::Tensor& col, const at::Tensor& packed6) {
  return q4_linear(x, gain, packed, n_out, col, packed6.numel() ? c10::optional<at::Tensor>(packed6) : c10::nullopt);
}

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("q4_pack(Tensor qs, Tensor d, Tensor m) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor gain, Tensor packed, int n_out, Tensor col, Tensor? packed6=None) -> Tensor");
  m.def("q6_pack(Tensor codes, Tensor d, Tensor sc) -> Tensor");
  m.def("q4_isa() -> str", &q4_isa);
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("q4_pack", &q4_pack);
  m.impl("q4_linear", &q4_linear);
  m.impl("q6_pack", &q6_pack);
}
