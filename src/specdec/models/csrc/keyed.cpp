// The keyed uniforms of seeded sampling (specdec.sampling.keyed_uniform) in one pass: for each token
// id v, SplitMix64(SplitMix64(v + 0x5DEECE66D) ^ key), its top 53 bits as a double in (0, 1).
// Integer arithmetic modulo 2^64 and exact conversions (a 53-bit integer to double, + 0.5 and the
// power-of-two scale as IEEE operations, -ffp-contract=off), so the bits equal the torch version's
// on every machine; the torch version runs ~15 element-wise passes over the vocabulary instead.
//
//   torch.ops.specdec.keyed_uniform(key, ids, vocab) -> float64 [m]: key is the already mixed
//       (seed, position) key as a signed 64-bit integer; ids int64 [m] (None: 0 .. vocab - 1)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

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
      const uint64_t bits = splitmix64(splitmix64(v + 0x5DEECE66Dull) ^ k);
      op[i] = (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0);  // 2^-53
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("keyed_uniform(int key, Tensor? ids, int vocab) -> Tensor", &keyed_uniform);
}
