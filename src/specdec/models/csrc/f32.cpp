// The float32 target's product, batch-invariant by construction: y_j = sum_k x_k w_jk summed
// front to back, one multiply and one add per term (no fused multiply-add, compiled with
// -ffp-contract=off), for every row on its own.  A row's bits therefore depend on that row
// alone — not on how many rows share the pass, how the columns are split between threads or
// between register blocks, or whether the AVX-512 or the portable path ran — and the weights
// are streamed once for up to four rows.
//
//   torch.ops.specdec.f32_pack(w float32 [N, K]) -> float32 [ceil(N/64), K, 64]: groups of 64
//       columns, input k's 64 weights contiguous (one group read front to back per pass)
//   torch.ops.specdec.f32_linear(x float32 [n, K], packed, n_out) -> float32 [n, N]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kGroup = 64;   // columns per packed group
constexpr int kRowsMax = 4;  // rows per register block
constexpr int kPrefetch = 8;  // inputs (of 256 bytes) a group's weights are prefetched ahead

at::Tensor f32_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "f32_pack: a float32 [N, K] weight");
  const at::Tensor wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), ng = (n + kGroup - 1) / kGroup;
  at::Tensor out = at::zeros({ng, k, kGroup}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < k; ++c) dst[((j / kGroup) * k + c) * kGroup + j % kGroup] = src[j * k + c];
  return out;
}

#if defined(__AVX512F__)
// R rows x G consecutive groups: 4 x R x G accumulators of 16 columns (at most 16 registers).
// Several groups at once keep several weight streams in flight per core: one row over SmolLM2's
// matrices ran at ~20 GB/s with one stream, ~24 GB/s with four (measured on this CPU).
template <int R, int G>
void group_rows(const float* x, int64_t k, const float* wg, int64_t gstride, float* out, int64_t out_stride,
                int64_t valid) {
  __m512 acc[R][G][4];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      for (int u = 0; u < 4; ++u) acc[r][g][u] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; ++c) {
    for (int g = 0; g < G; ++g) {
      const float* wc = wg + g * gstride + c * kGroup;
      const float* ahead = wc + kPrefetch * kGroup;
      for (int line = 0; line < kGroup; line += 16) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
      const __m512 w0 = _mm512_loadu_ps(wc), w1 = _mm512_loadu_ps(wc + 16), w2 = _mm512_loadu_ps(wc + 32),
                   w3 = _mm512_loadu_ps(wc + 48);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * k + c]);
        acc[r][g][0] = _mm512_add_ps(acc[r][g][0], _mm512_mul_ps(a, w0));
        acc[r][g][1] = _mm512_add_ps(acc[r][g][1], _mm512_mul_ps(a, w1));
        acc[r][g][2] = _mm512_add_ps(acc[r][g][2], _mm512_mul_ps(a, w2));
        acc[r][g][3] = _mm512_add_ps(acc[r][g][3], _mm512_mul_ps(a, w3));
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < 4; ++u) {
      const int64_t v = valid - g * kGroup - 16 * u;
      if (v <= 0) break;
      const __mmask16 mask = v >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << v) - 1u);
      for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * out_stride + g * kGroup + 16 * u, mask, acc[r][g][u]);
    }
}
#else
template <int R, int G>
void group_rows(const float* x, int64_t k, const float* wg, int64_t gstride, float* out, int64_t out_stride,
                int64_t valid) {
  for (int g = 0; g < G; ++g) {
    float acc[R][kGroup] = {};
    for (int64_t c = 0; c < k; ++c) {
      const float* wc = wg + g * gstride + c * kGroup;
      for (int r = 0; r < R; ++r) {
        const float a = x[r * k + c];
        for (int j = 0; j < kGroup; ++j) acc[r][j] = acc[r][j] + a * wc[j];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kGroup && j < valid - g * kGroup; ++j) out[r * out_stride + g * kGroup + j] = acc[r][j];
  }
}
#endif

using GroupFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
// per row count: the kernel for that many groups at once, and for one group (the remainder)
constexpr GroupFn kMany[kRowsMax + 1] = {nullptr, group_rows<1, 4>, group_rows<2, 2>, group_rows<3, 1>, group_rows<4, 1>};
constexpr int kManyGroups[kRowsMax + 1] = {0, 4, 2, 1, 1};
constexpr GroupFn kOne[kRowsMax + 1] = {nullptr, group_rows<1, 1>, group_rows<2, 1>, group_rows<3, 1>, group_rows<4, 1>};

at::Tensor f32_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n_out) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "f32_linear: x must be float32 [n, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kGroup && packed.scalar_type() == at::kFloat,
              "f32_linear: weights packed by f32_pack");
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(0), k = x.size(1), ng = packed.size(0);
  TORCH_CHECK(packed.size(1) == k && (n_out + kGroup - 1) / kGroup == ng, "f32_linear: shapes do not match");
  at::Tensor out = at::empty({n, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t grain = ng * k * kGroup < (1 << 14) ? ng : (ng + 1) / 2;
  const int64_t gstride = k * kGroup;
  at::parallel_for(0, ng, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r0 = 0; r0 < n; r0 += kRowsMax) {
      const int64_t rows = n - r0 < kRowsMax ? n - r0 : kRowsMax;
      const int64_t many = kManyGroups[rows];
      int64_t g = lo;
      for (; g + many <= hi; g += many)
        kMany[rows](xp + r0 * k, k, wp + g * gstride, gstride, op + r0 * n_out + g * kGroup, n_out, n_out - g * kGroup);
      for (; g < hi; ++g)
        kOne[rows](xp + r0 * k, k, wp + g * gstride, gstride, op + r0 * n_out + g * kGroup, n_out, n_out - g * kGroup);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("f32_pack(Tensor w) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor packed, int n_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("f32_pack", &f32_pack);
  m.impl("f32_linear", &f32_linear);
}
