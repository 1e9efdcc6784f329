// The keyed uniforms of seeded sampling (specdec.sampling.keyed_uniform) in one pass: for each token
// id v, SplitMix64(SplitMix64(v + 0x5DEECE66D) ^ key), its top 53 bits as a double in (0, 1).
// Integer arithmetic modulo 2^64 and exact conversions (a 53-bit integer to double, + 0.5 and the
// power-of-two scale as IEEE operations, -ffp-contract=off), so the bits equal the torch version's
// on every machine; the torch version runs ~15 element-wise passes over the vocabulary instead.
//
//   torch.ops.specdec.keyed_uniform(key, ids, vocab) -> float64 [m]: key is the already mixed
//       (seed, position) key as a signed 64-bit integer; ids int64 [m] (None: 0 .. vocab - 1)
//
//   torch.ops.specdec.gumbel_argmax(probs, key, ids=None, vocab=0) -> int: the Gumbel-max draw of
//       specdec.sampling.gumbel_sample, argmax_v log p(v) - log(-log u(v)) over the ids with
//       p(v) > 0, decided without torch's logarithms, or -1 when this op cannot vouch for torch's
//       answer (the caller then runs the torch ops).  probs: float32 or float64 [V], contiguous.
//       With ids (int64 [m], ids within 0 .. vocab - 1), probs [m] is a compact row: entry j is
//       token id ids[j]'s probability and is keyed as that id; the answer is the column j.
//
// How gumbel_argmax can return torch's token without torch's bits.  In exact arithmetic the key
// log p - log(-log u) is log r with r = p / (-log u), so the winner is the id of the largest r.
// Here r is computed in float64 with our own logarithm (relative error ~1e-15); the op answers
// only when the largest r exceeds every other by a relative margin of 1e-9, and -1 otherwise
// (also for a NaN, infinite or negative p).  Then the exact keys of the winner and of any other id
// differ by more than 1e-9 - 1e-14, while torch's computed keys are within ~1e-13 of the exact
// ones (each of its float64 logs is within an ulp or so, |key| < 150): torch's arg-max is the same
// id, whichever logarithm (SLEEF's vector one or the C library's) it used for each entry.  A row
// falls back with probability ~1e-9 (the gap between the two largest Gumbel keys has a bounded
// density near 0).  One pass over the row (see gumbel_argmax_impl): the uniforms, and a log and a
// division only for the few ids that could win.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

// AVX2 without AVX-512DQ: the uniforms' 64-bit products by hand (with vpmullq the compiler vectorises them)
#if defined(__AVX2__) && !defined(__AVX512DQ__)
#define SPECDEC_KEYED_AVX2 1
#include <immintrin.h>
#else
#define SPECDEC_KEYED_AVX2 0
#endif

namespace {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The uniform of a token id under a mixed key from the id's own hash h = SplitMix64(v + 0x5DEECE66D):
// SplitMix64(h ^ key), its top 53 bits + 1/2, times 2^-53.
inline double keyed_u_of_hash(uint64_t h, uint64_t key) {
  const uint64_t bits = splitmix64(h ^ key);
  return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0);  // 2^-53
}

// The uniform of token id v under a mixed key: SplitMix64(SplitMix64(v + 0x5DEECE66D) ^ key), its top
// 53 bits + 1/2, times 2^-53 (one definition for both ops below).
inline double keyed_u(uint64_t v, uint64_t key) { return keyed_u_of_hash(splitmix64(v + 0x5DEECE66Dull), key); }

// SplitMix64(v + 0x5DEECE66D) for v = 0 .. n - 1 at least: the half of each uniform's hashing that
// does not depend on the key, made once per process (and again for a larger vocabulary; the old
// table lives on with any call still reading it).  Two of a uniform's four 64-bit products.
std::shared_ptr<const std::vector<uint64_t>> id_hashes(int64_t n) {
  static std::mutex mu;
  static std::shared_ptr<const std::vector<uint64_t>> table;
  std::lock_guard<std::mutex> lock(mu);
  if (!table || static_cast<int64_t>(table->size()) < n) {
    auto t = std::make_shared<std::vector<uint64_t>>(static_cast<size_t>(n));
    for (int64_t v = 0; v < n; ++v) (*t)[static_cast<size_t>(v)] = splitmix64(static_cast<uint64_t>(v) + 0x5DEECE66Dull);
    table = std::move(t);
  }
  return table;
}

#if SPECDEC_KEYED_AVX2
// Four lanes of the same integer arithmetic on AVX2, which has no 64-bit product (AVX-512DQ's
// vpmullq; there the compiler vectorises the scalar code): a * c mod 2^64 from three 32 x 32 -> 64
// products, lo(a) lo(c) + ((hi(a) lo(c) + lo(a) hi(c)) << 32), the same bits.
inline __m256i mul64_by(__m256i a, uint64_t c) {
  const __m256i clo = _mm256_set1_epi64x(static_cast<int64_t>(c & 0xFFFFFFFFull));
  const __m256i chi = _mm256_set1_epi64x(static_cast<int64_t>(c >> 32));
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), clo), _mm256_mul_epu32(a, chi));
  return _mm256_add_epi64(_mm256_mul_epu32(a, clo), _mm256_slli_epi64(cross, 32));
}

inline __m256i splitmix64_x4(__m256i x) {
  x = _mm256_add_epi64(x, _mm256_set1_epi64x(static_cast<int64_t>(0x9E3779B97F4A7C15ull)));
  x = mul64_by(_mm256_xor_si256(x, _mm256_srli_epi64(x, 30)), 0xBF58476D1CE4E5B9ull);
  x = mul64_by(_mm256_xor_si256(x, _mm256_srli_epi64(x, 27)), 0x94D049BB133111EBull);
  return _mm256_xor_si256(x, _mm256_srli_epi64(x, 31));
}

// keyed_u_of_hash for four hashes.  A 53-bit integer's double without AVX-512's conversion: each
// 32-bit half exactly through the 2^52 bias, then hi * 2^32 + lo, exact (the sum is an integer
// below 2^53): static_cast<double>'s value.
inline __m256d keyed_u_x4(__m256i h, uint64_t key) {
  const __m256i x = _mm256_srli_epi64(splitmix64_x4(_mm256_xor_si256(h, _mm256_set1_epi64x(static_cast<int64_t>(key)))), 11);
  const __m256i bias_bits = _mm256_set1_epi64x(0x4330000000000000ll);
  const __m256d bias = _mm256_set1_pd(4503599627370496.0);  // 2^52
  const __m256d hi = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(_mm256_srli_epi64(x, 32), bias_bits)), bias);
  const __m256d lo = _mm256_sub_pd(
      _mm256_castsi256_pd(_mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi64x(0xFFFFFFFFll)), bias_bits)), bias);
  const __m256d d = _mm256_add_pd(_mm256_mul_pd(hi, _mm256_set1_pd(4294967296.0)), lo);
  return _mm256_mul_pd(_mm256_add_pd(d, _mm256_set1_pd(0.5)), _mm256_set1_pd(1.0 / 9007199254740992.0));
}

inline __m256d load4_as_double(const float* p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
inline __m256d load4_as_double(const double* p) { return _mm256_loadu_pd(p); }
#endif

at::Tensor keyed_uniform(int64_t key, const c10::optional<at::Tensor>& ids, int64_t vocab) {
  TORCH_CHECK(vocab > 0, "keyed_uniform: the vocabulary must not be empty");
  const bool some = ids.has_value() && ids->defined();
  at::Tensor idc;
  const int64_t* ip = nullptr;
  int64_t n = vocab;
  if (some) {
    idc = ids->to(at::kLong).contiguous();
    TORCH_CHECK(idc.dim() == 1, "keyed_uniform: ids must be int64 [m]");
    n = idc.numel();
    ip = idc.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < vocab, "keyed_uniform: a token id outside the vocabulary");
  }
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
  double* op = out.data_ptr<double>();
  const uint64_t k = static_cast<uint64_t>(key);
  at::parallel_for(0, n, 16384, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const uint64_t v = static_cast<uint64_t>(some ? ip[i] : i);
      op[i] = keyed_u(v, k);
    }
  });
  return out;
}

// log(x) for a normal x > 0 in float64: x = 2^e * m with m in [sqrt(1/2), sqrt(2)), then
// log m = 2 atanh(f), f = (m - 1) / (m + 1), |f| < 0.1716, by its series to f^25 (the next term is
// below 1e-20 of the sum), and e ln 2 with ln 2 split in two so the sum rounds once.  Relative
// error a few ulps (near x = 1 too: m - 1 is exact there); only branch-free arithmetic and bit
// moves, so the loop below vectorises.
inline double log_normal(double x) {
  uint64_t b;
  std::memcpy(&b, &x, 8);
  int64_t e = static_cast<int64_t>(b >> 52) - 1023;
  uint64_t mb = (b & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull;  // m in [1, 2)
  double m;
  std::memcpy(&m, &mb, 8);
  const bool big = m > 1.4142135623730951;
  m = big ? m * 0.5 : m;
  e += big ? 1 : 0;
  const double f = (m - 1.0) / (m + 1.0), s = f * f;
  double t = 1.0 / 25;
  t = 1.0 / 23 + s * t;
  t = 1.0 / 21 + s * t;
  t = 1.0 / 19 + s * t;
  t = 1.0 / 17 + s * t;
  t = 1.0 / 15 + s * t;
  t = 1.0 / 13 + s * t;
  t = 1.0 / 11 + s * t;
  t = 1.0 / 9 + s * t;
  t = 1.0 / 7 + s * t;
  t = 1.0 / 5 + s * t;
  t = 1.0 / 3 + s * t;
  const double lm = 2.0 * f + 2.0 * f * (s * t);
  const double de = static_cast<double>(e);
  return de * 6.93147180369123816490e-01 + (de * 1.90821492927058770002e-10 + lm);  // ln 2 = hi + lo
}

constexpr double kMargin = 1e-9;  // the relative gap gumbel_argmax needs between the two largest r
constexpr int64_t kBlock = 512;

// The largest r in one pass without a logarithm for most ids: -log u >= 1 - u, so r <= p / (1 - u),
// and an id with p < t (1 - u), t the best r so far shrunk by the margin, can neither win nor come
// within the margin of the winner (a product and a comparison, vectorised, per id).  Only the ids
// that pass (all of the first block, then ~1 / max r, about one, per row on average: the sum of p
// over the best r) get their log and division.  The top two r seen decide; r < 0 (u rounded to 1,
// -log u = -0) sends the row back to torch like a NaN.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPECDEC_WIDE __attribute__((target("prefer-vector-width=512")))  // GCC's default is 256 bits: ~20 % slower here
#else
#define SPECDEC_WIDE
#endif

template <typename T>
SPECDEC_WIDE int64_t gumbel_argmax_impl(const T* p, int64_t n, uint64_t key, const uint64_t* hashes) {
  double us[kBlock];
  unsigned char pass[kBlock];
  double best = 0.0, second = 0.0;
  int64_t arg = -1;
  int bad = 0;
  // an id that passed the screen: its r and the top two (order does not matter: the top two values
  // are the same whatever the order, and equal ones send the row back anyway)
  auto consider = [&](int64_t id, double u) {
    const double r = static_cast<double>(p[id]) / -log_normal(u);
    bad |= static_cast<int>(!(r >= 0.0));
    if (r > best) {
      second = best;
      best = r;
      arg = id;
    } else if (r > second) {
      second = r;
    }
  };
  for (int64_t lo = 0; lo < n; lo += kBlock) {
    const int64_t m = std::min(kBlock, n - lo);
    const double t = best * (1.0 - kMargin);
    int odd = 0;
    int64_t j = 0;
#if SPECDEC_KEYED_AVX2
    // four ids at a time, the scalar loop's operations on the same doubles; the ids that pass (all
    // of the first block, then about one a row) are kept in a short list instead of every id's
    // uniform and flag being stored
    int64_t cand[kBlock];
    double cand_u[kBlock];
    int count = 0;
    {
      const __m256d tv = _mm256_set1_pd(t), one = _mm256_set1_pd(1.0), zero = _mm256_setzero_pd();
      const __m256d top = _mm256_set1_pd(1.7976931348623157e308);
      for (; j + 4 <= m; j += 4) {
        const __m256d u = keyed_u_x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hashes + lo + j)), key);
        const __m256d v = load4_as_double(p + lo + j);
        odd |= static_cast<int>(_mm256_movemask_pd(_mm256_cmp_pd(v, zero, _CMP_GE_OQ)) != 0xF) |
               static_cast<int>(_mm256_movemask_pd(_mm256_cmp_pd(v, top, _CMP_GT_OQ)) != 0);
        const __m256d thr = _mm256_mul_pd(tv, _mm256_sub_pd(one, u));
        const int ok = _mm256_movemask_pd(_mm256_and_pd(_mm256_cmp_pd(v, zero, _CMP_GT_OQ), _mm256_cmp_pd(v, thr, _CMP_GE_OQ)));
        if (ok) {
          alignas(32) double lanes[4];
          _mm256_store_pd(lanes, u);
          for (int i = 0; i < 4; ++i)
            if ((ok >> i) & 1) {
              cand[count] = lo + j + i;
              cand_u[count++] = lanes[i];
            }
        }
      }
    }
#endif
    const int64_t tail = j;
    for (; j < m; ++j) {  // vectorised: no branch, comparisons combined bitwise
      const double u = keyed_u_of_hash(hashes[lo + j], key);  // in [2^-54, 1], keyed_uniform's
      const double v = static_cast<double>(p[lo + j]);
      odd |= static_cast<int>(!(v >= 0.0)) | static_cast<int>(v > 1.7976931348623157e308);  // NaN, < 0, inf
      us[j] = u;
      pass[j] = static_cast<unsigned char>(static_cast<int>(v > 0.0) & static_cast<int>(v >= t * (1.0 - u)));
    }
    bad |= odd;
#if SPECDEC_KEYED_AVX2
    for (int c = 0; c < count; ++c) consider(cand[c], cand_u[c]);
#endif
    for (j = tail; j < m; ++j)
      if (pass[j]) consider(lo + j, us[j]);
  }
  if (bad || !(best > 0.0) || !(second < best * (1.0 - kMargin))) return -1;
  return arg;
}

int64_t gumbel_argmax(const at::Tensor& probs, int64_t key, const c10::optional<at::Tensor>& ids, int64_t vocab) {
  TORCH_CHECK(probs.dim() == 1 && probs.is_contiguous() && probs.numel() > 0,
              "gumbel_argmax: probs must be a contiguous, non-empty [V] row");
  const uint64_t k = static_cast<uint64_t>(key);
  TORCH_CHECK(probs.scalar_type() == at::kFloat || probs.scalar_type() == at::kDouble,
              "gumbel_argmax: probs must be float32 or float64");
  const int64_t n = probs.numel();
  const uint64_t* h = nullptr;
  std::vector<uint64_t> gathered;
  std::shared_ptr<const std::vector<uint64_t>> hashes;  // held for the call: a larger vocabulary may replace the table
  if (ids.has_value() && ids->defined()) {  // a compact row: entry j is token id ids[j]'s probability
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->dim() == 1 && ids->is_contiguous() && ids->numel() == n,
                "gumbel_argmax: ids must be a contiguous int64 [m] row as long as probs");
    TORCH_CHECK(vocab > 0, "gumbel_argmax: compact rows need the vocabulary's size");
    hashes = id_hashes(vocab);
    const int64_t* ip = ids->data_ptr<int64_t>();
    gathered.resize(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) {
      TORCH_CHECK(ip[j] >= 0 && ip[j] < vocab, "gumbel_argmax: a token id outside the vocabulary");
      gathered[static_cast<size_t>(j)] = (*hashes)[static_cast<size_t>(ip[j])];
    }
    h = gathered.data();
  } else {
    hashes = id_hashes(n);
    h = hashes->data();
  }
  if (probs.scalar_type() == at::kFloat) return gumbel_argmax_impl(probs.data_ptr<float>(), n, k, h);
  return gumbel_argmax_impl(probs.data_ptr<double>(), n, k, h);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("keyed_uniform(int key, Tensor? ids, int vocab) -> Tensor", &keyed_uniform);
  m.def("gumbel_argmax(Tensor probs, int key, Tensor? ids=None, int vocab=0) -> int", &gumbel_argmax);
}
