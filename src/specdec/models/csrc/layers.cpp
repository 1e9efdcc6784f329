// A quantised target's layer loop in one call: models/scripted.py's `_layers` for the passes a
// decoding step, a chain verification pass and a tree verification pass run (every layer matrix
// a 4-bit product or a W8A8 few-row product on the compiled kernels, exact attention on the
// compiled kernel — consecutive rows, or tree nodes over their paths read in place — no mask,
// no taps), without the ~25 interpreted ATen calls per layer that
// the TorchScript loop makes (on SmolLM2's 30 small layers those calls cost ~1.5-2 ms of a ~7 ms
// step; the small draft's 4 layers are almost nothing else).
//
// Bitwise what the TorchScript loop computes, op for op (tested against it in
// tests/models/test_fused_layers.py for 1-17 rows, with and without biases and skipped
// sub-layers).  Each step below names the ATen op it stands for and the arithmetic that op does:
//
//   inverse RMS   rsqrt(addcmul(eps, norm, norm, value=1/D)), norm = linalg_vector_norm(x)
//                 -> the norm from ATen (its reduction order is ATen's), then
//                    1 / sqrt(fma(float(1/D) * norm, norm, eps))  (addcmul is one fused multiply-add
//                    of value * t1 and t2; rsqrt is a correctly rounded 1 / sqrt)
//   4-bit product y = q4_linear(x); y.mul_(s) -> y * s;  addcmul(bias, y, s) -> fma(y, s, bias);  y + bias
//   W8A8 product  (y, t) = q8_linear(x); t * s where rows are scaled; then y * t or fma(y, t, bias)
//   head norms    (Qwen3, before the rotation) x * rsqrt(addcmul(eps, norm, norm, value=1/d)) * gain per
//                 query and key head, norm = linalg_vector_norm over the head -> the norm from ATen on
//                 the same views, then (x * (1 / sqrt(fma(float(1/d) * norm, norm, eps)))) * gain
//   rotary        addcmul(qk * cos, qk.roll(d/2, -1), sin) -> fma(rolled, sin, qk * cos)
//   SiLU          F.silu(gate) -> ATen's silu (its exp is ATen's), then * up
//   GELU (Gemma 3) F.gelu(gate, approximate="tanh") -> ATen's gelu on the same view, then * up
//   output norms  (Gemma 3, on the attention's and the MLP's outputs before each residual add)
//                 h * inv_rms(h) * gain -> (h * (1 / sqrt(fma(float(1/D) * norm, norm, eps)))) * gain
//   residuals     x + y
//
// Every step is per row, so a row's result depends on that row alone (batch invariance).
// Compiled with -ffp-contract=off: the compiler fuses nothing the comment does not name.
//
//   torch.ops.specdec.fused_layers(x [n, D], cos [n, 1, d], sin [n, 1, d] (signed), k_all, v_all
//       [L, Hkv, T, d] (float32, or float16: each row's keys and values rounded to nearest even as
//       they are written, as torch's copy_ rounds them; attend widens them back exactly), start,
//       n_heads, n_kv_heads, head_dim, eps [1], weights (a FusedWeights),
//       plan[] (flattened [layer, attention on, MLP on, cache slot] steps; empty = every layer),
//       final_norm, tree_start, paths, taps[], tap_out, cos_local, sin_local) -> [n, D]: the residual stream after the
//       steps, times its inverse RMS when final_norm (the LM head's input).  taps[] (increasing
//       step counts, 1 .. steps) with tap_out [len(taps), n, D] float32: tap_out[j] receives the
//       residual stream after the first taps[j] steps (a target-aware drafter's features, in the
//       same call: one call per stretch between taps had cost ~0.25-0.5 ms a tap on a 2-core
//       machine).  paths [n, E] (a token tree: each node's ancestors-or-self as cache slots, -1 padded) with tree_start (the prefix every node sees)
//       as torch.ops.specdec.attend takes them; the nodes' keys and values go to start .. start + n.
//   torch.ops.specdec.fused_layers_batch(x [M, D], cos, sin [M, 1, d], k_caches[], v_caches[], starts[],
//       sizes[], n_heads, n_kv_heads, head_dim, eps, weights, taps[], tap_out, cos_local, sin_local) -> [M, D]: a
//       batching server's pass (scripted._layers_batch with exact attention): the rows of several
//       sequences concatenated, the linear layers over all of them, each sequence's attention
//       against its own cache from its own start; every layer, then the final norm.  taps[] and
//       tap_out [len(taps), M, D] as fused_layers takes them (target-aware drafters served in
//       batches: every row's residual stream after those layer counts).
//   torch.classes.specdec.FusedWeights(kinds[], tensors[], n_out[]): a model's layer weights, made
//       (and checked) once.  Four linear layers per layer (qkv, out, gate_up, down), each of kind 4
//       (4-bit: gain, col, packed, packed6 (the Q6_K columns, empty: none), bias) or 0 (W8A8 few-row: smooth, col, packed, comp, bias),
//       five tensors per linear layer in `tensors` (an empty tensor: none); n_out: the 4-bit
//       layers' output features.  W8A8 layers only for at most 16 rows (the few-row kernel's range, as in
//       scripted._linear).  FusedWeights.set_head_norms(tensors[]): Qwen3's query and key norms' gains,
//       two per layer (float32 [d] each, the query's with the attention scale folded in; empty: none).
//       FusedWeights.set_gemma(gains[], local[]): Gemma 3's layer -- the output norms' gains, two per
//       layer (attention's, MLP's; float32 [D]), the tanh-GELU gate, and local[li] = 1 for the layers
//       that turn by the sliding layers' own rotary table, which the calls then take as cos_local /
//       sin_local [n, 1, d] (rows as cos / sin).
//       FusedWeights.set_windows(windows[]): per layer its sliding window W (0: none).  A row at
//       position p >= W of such a layer attends to keys p - W + 1 .. p alone, as attend_op computes a
//       row at position W - 1 over those keys (native._attend_seen); rows below W as before
//       (native._attend_rows_windowed).  In a tree pass reaching the window (tree_start + n > W, as
//       native._TreeLayout.attend_windowed decides) each node attends to the last W keys of the
//       prefix and its path, gathered in position order, as attend_op computes a row over them.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "specdec.h"

namespace {

constexpr int64_t kQ8 = 0, kQ4 = 4;  // scripted.W8A8 / scripted.Q4

void check_weights(const std::vector<int64_t>& kinds, const std::vector<at::Tensor>& weights,
                   const std::vector<int64_t>& n_out) {
  const int64_t n_lin = static_cast<int64_t>(kinds.size());
  TORCH_CHECK(n_lin % 4 == 0 && weights.size() == 5 * kinds.size() && n_out.size() == kinds.size(),
              "fused_layers: four linear layers per layer, five tensors and an output size each");
  for (int64_t i = 0; i < n_lin; ++i) {
    TORCH_CHECK(kinds[i] == kQ4 || kinds[i] == kQ8, "fused_layers: a linear layer of an unknown kind");
    for (int64_t j : {1, 4})
      TORCH_CHECK(weights[5 * i + j].numel() == 0 || (weights[5 * i + j].scalar_type() == at::kFloat &&
                                                      weights[5 * i + j].is_contiguous()),
                  "fused_layers: column factors and biases must be contiguous float32");
  }
}

// A model's layer weights, checked once and handed to every call as one object: passed as a list,
// the ~600 tensors of a 30-layer model cost ~50 us of dispatcher work per call (boxing each one,
// computing the dispatch keys over all of them) -- ~1 % of a decoding step on two cores.
struct FusedWeights : torch::CustomClassHolder {
  std::vector<int64_t> kinds;
  std::vector<at::Tensor> w;
  std::vector<int64_t> n_out;
  std::vector<at::Tensor> norms;  // Qwen3's head norms: two per layer, or none
  std::vector<at::Tensor> post;  // Gemma 3's output norms: two per layer (with them, the tanh-GELU gate), or none
  std::vector<int64_t> local;  // Gemma 3: per layer, 1 = the local rotary table; or none
  std::vector<int64_t> windows;  // per layer its sliding window (0: none), or none at all
  FusedWeights(std::vector<int64_t> kinds_, std::vector<at::Tensor> w_, std::vector<int64_t> n_out_)
      : kinds(std::move(kinds_)), w(std::move(w_)), n_out(std::move(n_out_)) {
    check_weights(kinds, w, n_out);
  }
  void set_head_norms(std::vector<at::Tensor> gains) {
    TORCH_CHECK(gains.size() == kinds.size() / 2, "fused_layers: two head norms per layer (query, key)");
    for (size_t i = 0; i < gains.size(); i += 2) {
      TORCH_CHECK((gains[i].numel() > 0) == (gains[i + 1].numel() > 0), "fused_layers: a layer's query and key norms go together");
      for (size_t j = i; j < i + 2; ++j)
        TORCH_CHECK(gains[j].numel() == 0 || (gains[j].dim() == 1 && gains[j].scalar_type() == at::kFloat && gains[j].is_contiguous()),
                    "fused_layers: head norm gains must be contiguous float32 [d]");
    }
    norms = std::move(gains);
  }
  void set_gemma(std::vector<at::Tensor> gains, std::vector<int64_t> local_layers) {
    const size_t n_layers = kinds.size() / 4;
    TORCH_CHECK(gains.size() == 2 * n_layers && local_layers.size() == n_layers,
                "fused_layers: Gemma 3's layer takes two output norms and a rotary table per layer");
    for (const at::Tensor& g : gains)
      TORCH_CHECK(g.dim() == 1 && g.scalar_type() == at::kFloat && g.is_contiguous(),
                  "fused_layers: output norm gains must be contiguous float32 [D]");
    for (int64_t t : local_layers) TORCH_CHECK(t == 0 || t == 1, "fused_layers: a layer's rotary table is 0 or 1");
    post = std::move(gains);
    local = std::move(local_layers);
  }
  void set_windows(std::vector<int64_t> per_layer) {
    TORCH_CHECK(per_layer.size() == kinds.size() / 4, "fused_layers: one sliding window (0: none) per layer");
    for (int64_t win : per_layer) TORCH_CHECK(win >= 0, "fused_layers: a sliding window is a positive size, or 0");
    windows = std::move(per_layer);
  }
};

// [M, Hq + Hkv, d]: the query and key heads of qkv [M, (Hq + 2 Hkv) d] after their RMS norms (Qwen3),
// as scripted._head_norm computes them on the views native._normed takes (norms from ATen on them)
at::Tensor head_norms(const at::Tensor& qkv, int64_t hq, int64_t hk, int64_t d, const at::Tensor& gq,
                      const at::Tensor& gk, float eps) {
  const int64_t m = qkv.size(0), qkv_w = qkv.size(1), heads = hq + hk;
  at::Tensor out = at::empty({m, heads, d}, qkv.options());
  const float value = static_cast<float>(1.0 / static_cast<double>(d));  // addcmul's value, as a float
  const float* src = qkv.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int part = 0; part < 2; ++part) {
    const int64_t h0 = part == 0 ? 0 : hq, nh = part == 0 ? hq : hk;
    const at::Tensor norm = at::linalg_vector_norm(qkv.narrow(1, h0 * d, nh * d).view({m, nh, d}), 2.0,
                                                   at::IntArrayRef{-1}, true).contiguous();  // [M, nh, 1]
    const float* np = norm.data_ptr<float>();
    const float* g = (part == 0 ? gq : gk).data_ptr<float>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t h = 0; h < nh; ++h) {
        const float nr = np[r * nh + h];
        const float inv = 1.0f / std::sqrt(std::fma(value * nr, nr, eps));
        const float* a = src + r * qkv_w + (h0 + h) * d;
        float* o = dst + (r * heads + h0 + h) * d;
        for (int64_t j = 0; j < d; ++j) o[j] = (a[j] * inv) * g[j];
      }
  }
  return out;
}

// [n, 1]: 1 / RMS of each row of x [n, D], as scripted._inv_rms computes it
at::Tensor inv_rms(const at::Tensor& x, float eps, float value) {
  at::Tensor norm = at::linalg_vector_norm(x, 2.0, at::IntArrayRef{-1}, true);  // [n, 1]
  float* p = norm.data_ptr<float>();
  for (int64_t r = 0; r < norm.numel(); ++r) p[r] = 1.0f / std::sqrt(std::fma(value * p[r], p[r], eps));
  return norm;
}

// [n, out] = linear layer i of x [n, in]; rows scaled by rs [n] when given (scripted._linear)
at::Tensor linear(const FusedWeights& net, int64_t i, const at::Tensor& x, const float* rs) {
  const at::Tensor* t = net.w.data() + 5 * i;
  const at::Tensor& b = t[4];
  const bool has_bias = b.numel() > 0;
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  if (net.kinds[i] == kQ8) {  // y * (t * s), or fma(y, t * s, bias): the row factor t from the product
    const c10::optional<at::Tensor> smooth = t[0].numel() > 0 ? c10::optional<at::Tensor>(t[0]) : c10::nullopt;
    auto [y, f] = specdec::q8_product(x, smooth, t[2], t[3], t[1]);  // [n, out], [n, 1]
    const int64_t n = y.size(0), m = y.size(1);
    float* yp = y.data_ptr<float>();
    const float* fp = f.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      const float s = rs ? fp[r] * rs[r] : fp[r];
      float* row = yp + r * m;
      if (has_bias) {
        for (int64_t j = 0; j < m; ++j) row[j] = std::fma(row[j], s, bp[j]);
      } else {
        for (int64_t j = 0; j < m; ++j) row[j] = row[j] * s;
      }
    }
    return y;
  }
  at::Tensor y = specdec::q4_product(x, t[0], t[2], net.n_out[i], t[1], t[3]);  // contiguous
  if (!rs && !has_bias) return y;
  const int64_t n = y.size(0), m = y.size(1);
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    float* row = yp + r * m;
    if (rs && has_bias) {
      for (int64_t j = 0; j < m; ++j) row[j] = std::fma(row[j], rs[r], bp[j]);
    } else if (rs) {
      for (int64_t j = 0; j < m; ++j) row[j] = row[j] * rs[r];
    } else {
      for (int64_t j = 0; j < m; ++j) row[j] = row[j] + bp[j];
    }
  }
  return y;
}

// y [n, D] := y * inv_rms(y) * gain (Gemma 3's norm of a sub-layer's output), as native._attn_out / _mlp compute it
void post_norm(at::Tensor& y, const at::Tensor& gain, float eps, float value) {
  const at::Tensor rs = inv_rms(y, eps, value);
  const int64_t n = y.size(0), width = y.size(1);
  const float* rp = rs.data_ptr<float>();
  const float* g = gain.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < width; ++j) yp[r * width + j] = (yp[r * width + j] * rp[r]) * g[j];
}

void add_into(at::Tensor& x, const at::Tensor& y) {  // x += y, both contiguous [n, D]
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) xp[i] = xp[i] + yp[i];
}

// One sequence's rows in a pass: rows row .. row + n of x, at cache positions start .. start + n of
// its own cache (k, v: [L, Hkv, T, d]).
struct Segment {
  int64_t row, n, start;
  at::Tensor k, v;
};


// [M, Hq d]: attention of every segment's rows in a layer with sliding window win, some row at or
// past it (native._attend_rows_windowed per sequence): rows below win over every earlier key, a row
// at p >= win over keys p - win + 1 .. p as a row at position win - 1 over those keys alone
at::Tensor windowed_rows(const at::Tensor& qk, const std::vector<Segment>& segs, int64_t slot, int64_t hq, int64_t win) {
  const int64_t m = qk.size(0), d = qk.size(2);
  at::Tensor out = at::empty({m, hq * d}, qk.options());
  const at::Tensor q = qk.narrow(1, 0, hq);  // [M, Hq, d]
  for (const Segment& sg : segs) {
    const at::Tensor k = sg.k.select(0, slot), v = sg.v.select(0, slot);  // [Hkv, T, d]
    const int64_t inside = std::max<int64_t>(0, std::min(sg.n, win - sg.start));  // rows at positions < win
    if (inside > 0)
      out.narrow(0, sg.row, inside).copy_(specdec::attend_op(q.narrow(0, sg.row, inside), k, v, sg.start, c10::nullopt));
    for (int64_t j = inside; j < sg.n; ++j) {
      const int64_t lo = sg.start + j - win + 1;
      out.narrow(0, sg.row + j, 1).copy_(
          specdec::attend_op(q.narrow(0, sg.row + j, 1), k.narrow(1, lo, win), v.narrow(1, lo, win), win - 1, c10::nullopt));
    }
  }
  return out;
}

// Per tree node, the cache slots it sees in a layer with sliding window win (native._TreeLayout.attend_windowed):
// node j, at position tree_start + len(path) - 1, sees the keys decoding its path token by token
// would -- the prefix's from position max(0, tree_start + len(path) - win) on, then its path's
// slots from there -- in position order.  The same for every layer of that window: made once a pass.
std::vector<at::Tensor> tree_window_slots(const at::Tensor& paths, int64_t tree_start, int64_t win) {
  const int64_t m = paths.size(0), width = paths.size(1);
  const at::Tensor pc = paths.to(at::kLong).contiguous();
  const int64_t* pp = pc.data_ptr<int64_t>();
  std::vector<at::Tensor> out;
  out.reserve(m);
  for (int64_t j = 0; j < m; ++j) {
    const int64_t* path = pp + j * width;
    int64_t len = 0;
    while (len < width && path[len] >= 0) ++len;
    const int64_t lo = std::max<int64_t>(0, tree_start + len - win);  // the first position node j sees
    std::vector<int64_t> slots;
    for (int64_t t = std::min(lo, tree_start); t < tree_start; ++t) slots.push_back(t);
    for (int64_t i = std::max<int64_t>(0, lo - tree_start); i < len; ++i) slots.push_back(path[i]);
    out.push_back(at::from_blob(slots.data(), {static_cast<int64_t>(slots.size())}, at::kLong).clone());
  }
  return out;
}

// [n, Hq d]: a tree pass's nodes in a windowed layer, node j over the keys at seen[j] gathered in
// that order (tree_window_slots), as attend_op computes a row over them
at::Tensor windowed_tree(const at::Tensor& qk, const Segment& sg, int64_t slot, int64_t hq,
                         const std::vector<at::Tensor>& seen) {
  const int64_t m = qk.size(0), d = qk.size(2);
  at::Tensor out = at::empty({m, hq * d}, qk.options());
  const at::Tensor q = qk.narrow(1, 0, hq);  // [n, Hq, d]
  const at::Tensor k = sg.k.select(0, slot), v = sg.v.select(0, slot);  // [Hkv, T, d]
  for (int64_t j = 0; j < m; ++j) {
    const at::Tensor& idx = seen[j];
    out.narrow(0, j, 1).copy_(
        specdec::attend_op(q.narrow(0, j, 1), k.index_select(1, idx), v.index_select(1, idx), idx.numel() - 1, c10::nullopt));
  }
  return out;
}

// The layer loop over the segments' rows x [M, D] (see the header); tree (paths) for one segment only.
at::Tensor run(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, const std::vector<Segment>& segs,
               int64_t hq, int64_t hk, int64_t d, const at::Tensor& eps_t, const FusedWeights& w, std::vector<int64_t> plan,
               bool final_norm, int64_t tree_start, const c10::optional<at::Tensor>& paths,
               const std::vector<int64_t>& taps = {}, const c10::optional<at::Tensor>& tap_out = c10::nullopt,
               const c10::optional<at::Tensor>& cos_local = c10::nullopt,
               const c10::optional<at::Tensor>& sin_local = c10::nullopt) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "fused_layers: x must be float32 [n, D]");
  const int64_t m = x_in.size(0), width = x_in.size(1), n_lin = static_cast<int64_t>(w.kinds.size());
  TORCH_CHECK(plan.size() % 4 == 0, "fused_layers: plan steps are [layer, attention, mlp, slot]");
  TORCH_CHECK(d % 2 == 0, "fused_layers: the head size must be even");
  std::vector<int64_t> owner(m, -1);  // row -> its segment
  int64_t slots = -1;
  for (size_t g = 0; g < segs.size(); ++g) {
    const Segment& sg = segs[g];
    TORCH_CHECK(sg.k.dim() == 4 && sg.k.sizes() == sg.v.sizes() && sg.k.stride(3) == 1 && sg.v.stride(3) == 1 &&
                    (sg.k.scalar_type() == at::kFloat || sg.k.scalar_type() == at::kHalf) &&
                    sg.v.scalar_type() == sg.k.scalar_type() && sg.k.scalar_type() == segs[0].k.scalar_type(),
                "fused_layers: caches must be float32 or float16 [L, Hkv, T, d] (one dtype) with contiguous features");
    TORCH_CHECK(sg.k.size(1) == hk && sg.k.size(3) == d, "fused_layers: head layout mismatch");
    TORCH_CHECK(sg.k.strides() == sg.v.strides(), "fused_layers: a cache's keys and values must have one layout");
    TORCH_CHECK(sg.start >= 0 && sg.start + sg.n <= sg.k.size(2), "fused_layers: rows beyond the cache");
    TORCH_CHECK(sg.row >= 0 && sg.n >= 0 && sg.row + sg.n <= m, "fused_layers: segment rows beyond x");
    for (int64_t r = sg.row; r < sg.row + sg.n; ++r) {
      TORCH_CHECK(owner[r] < 0, "fused_layers: overlapping segments");
      owner[r] = static_cast<int64_t>(g);
    }
    slots = slots < 0 ? sg.k.size(0) : std::min(slots, sg.k.size(0));
  }
  for (int64_t r = 0; r < m; ++r) TORCH_CHECK(owner[r] >= 0, "fused_layers: a row outside every segment");
  const bool tree = paths.has_value() && paths->defined();  // nodes at per-node positions (cos / sin), see attend
  TORCH_CHECK(!tree || segs.size() == 1, "fused_layers: a tree pass is one sequence");
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(cos.numel() == m * d && sin.numel() == m * d, "fused_layers: cos / sin must be [n, 1, d]");
  const bool any_local = std::find(w.local.begin(), w.local.end(), int64_t{1}) != w.local.end();
  at::Tensor cos_l, sin_l;  // the sliding layers' own rotary rows (Gemma 3)
  if (any_local) {
    TORCH_CHECK(cos_local.has_value() && cos_local->defined() && sin_local.has_value() && sin_local->defined() &&
                    cos_local->numel() == m * d && sin_local->numel() == m * d &&
                    cos_local->scalar_type() == at::kFloat && sin_local->scalar_type() == at::kFloat,
                "fused_layers: this model's sliding layers need cos_local / sin_local [n, 1, d]");
    cos_l = cos_local->contiguous();
    sin_l = sin_local->contiguous();
  }
  const float eps = eps_t.item<float>();
  const float value = static_cast<float>(1.0 / static_cast<double>(width));  // addcmul's value, as a float
  if (plan.empty())
    for (int64_t li = 0; li < n_lin / 4; ++li) plan.insert(plan.end(), {li, 1, 1, li});
  for (size_t s = 0; s < plan.size(); s += 4)
    TORCH_CHECK(plan[s] >= 0 && plan[s] < n_lin / 4 && plan[s + 3] >= 0 && plan[s + 3] < slots,
                "fused_layers: a plan step beyond the layers or the cache");
  const int64_t n_steps = static_cast<int64_t>(plan.size() / 4), n_taps = static_cast<int64_t>(taps.size());
  for (int64_t j = 0; j < n_taps; ++j)
    TORCH_CHECK(taps[j] >= 1 && taps[j] <= n_steps && (j == 0 || taps[j] > taps[j - 1]),
                "fused_layers: taps must be increasing step counts in 1 .. the steps run");
  TORCH_CHECK(n_taps == 0 || (tap_out.has_value() && tap_out->defined() && tap_out->scalar_type() == at::kFloat &&
                              tap_out->is_contiguous() && tap_out->dim() == 3 && tap_out->size(0) == n_taps &&
                              tap_out->size(1) == m && tap_out->size(2) == width),
              "fused_layers: tap_out must be contiguous float32 [len(taps), n, D]");
  int64_t next_tap = 0;
  const int64_t qk_heads = hq + hk, half = d / 2;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float* clp = any_local ? cos_l.data_ptr<float>() : cp;
  const float* slp = any_local ? sin_l.data_ptr<float>() : sp;
  const bool post = !w.post.empty();
  std::vector<at::Tensor> tree_seen;  // a tree pass past a window: each node's slots (tree_window_slots) ...
  int64_t tree_seen_win = 0;  // ... for this window
  at::Tensor x = x_in.contiguous().clone();  // [M, D], the residual stream (the caller's x untouched)
  at::Tensor qk = at::empty({m, qk_heads, d}, x.options());  // rotated q and k heads
  for (size_t s = 0; s < plan.size(); s += 4) {
    const int64_t li = plan[s], slot = plan[s + 3], lin = 4 * li;
    if (plan[s + 1]) {
      const at::Tensor rs = inv_rms(x, eps, value);
      const at::Tensor qkv = linear(w, lin, x, rs.data_ptr<float>());  // [M, (Hq + 2 Hkv) d]
      const int64_t qkv_w = qkv.size(1);
      const float* src = qkv.data_ptr<float>();
      float* dst = qk.data_ptr<float>();
      // the heads the rotation reads: qkv's own, or (Qwen3) after their norms, [M, Hq + Hkv, d]
      const bool normed = !w.norms.empty() && w.norms[2 * li].numel() > 0;
      const at::Tensor nq = normed ? head_norms(qkv, hq, hk, d, w.norms[2 * li], w.norms[2 * li + 1], eps) : at::Tensor();
      const float* heads = normed ? nq.data_ptr<float>() : src;
      const int64_t heads_w = normed ? qk_heads * d : qkv_w;
      const bool turn_local = !w.local.empty() && w.local[li] == 1;
      for (int64_t r = 0; r < m; ++r) {
        const float* c = (turn_local ? clp : cp) + r * d;
        const float* sn = (turn_local ? slp : sp) + r * d;
        for (int64_t h = 0; h < qk_heads; ++h) {
          const float* a = heads + r * heads_w + h * d;
          float* o = dst + (r * qk_heads + h) * d;
          for (int64_t j = 0; j < d; ++j) {
            const float rolled = a[j < half ? j + half : j - half];
            o[j] = std::fma(rolled, sn[j], a[j] * c[j]);
          }
        }
        const Segment& sg = segs[owner[r]];
        const int64_t pos = sg.start + (r - sg.row);
        const int64_t at = slot * sg.k.stride(0) + pos * sg.k.stride(2);
        for (int64_t h = 0; h < hk; ++h) {  // this row's keys and values into its cache
          const float* ks = dst + (r * qk_heads + hq + h) * d;
          const float* vs = src + r * qkv_w + (qk_heads + h) * d;
          if (sg.k.scalar_type() == at::kHalf) {  // rounded to nearest, ties to even: what torch's copy_ writes
            at::Half* kd = sg.k.data_ptr<at::Half>() + at + h * sg.k.stride(1);
            at::Half* vd = sg.v.data_ptr<at::Half>() + at + h * sg.v.stride(1);
            for (int64_t j = 0; j < d; ++j) {
              kd[j] = at::Half(ks[j]);
              vd[j] = at::Half(vs[j]);
            }
          } else {
            float* kd = sg.k.data_ptr<float>() + at + h * sg.k.stride(1);
            float* vd = sg.v.data_ptr<float>() + at + h * sg.v.stride(1);
            for (int64_t j = 0; j < d; ++j) {
              kd[j] = ks[j];
              vd[j] = vs[j];
            }
          }
        }
      }
      at::Tensor attn;  // [M, Hq d]
      const int64_t win = w.windows.empty() ? 0 : w.windows[li];
      bool past = false;  // some row at or past this layer's sliding window
      for (const Segment& sg : segs) past = past || (win > 0 && sg.start + sg.n > win);
      if (past && tree) {
        if (tree_seen_win != win) {
          tree_seen = tree_window_slots(*paths, tree_start, win);
          tree_seen_win = win;
        }
        attn = windowed_tree(qk, segs[0], slot, hq, tree_seen);
      } else if (past) {
        attn = windowed_rows(qk, segs, slot, hq, win);
      } else if (segs.size() == 1) {
        const Segment& sg = segs[0];
        attn = specdec::attend_op(qk.narrow(1, 0, hq), sg.k.select(0, slot), sg.v.select(0, slot),
                                  tree ? tree_start : sg.start, tree ? paths : c10::optional<at::Tensor>());
      } else {  // each sequence against its own cache, bitwise its solo pass, in one parallel region
        const at::Tensor q = qk.narrow(1, 0, hq).contiguous();  // [M, Hq, d]
        attn = at::empty({m, hq * d}, x.options());
        std::vector<specdec::AttnSeq> seqs;
        seqs.reserve(segs.size());
        for (const Segment& sg : segs) {
          const at::Tensor k = sg.k.select(0, slot), v = sg.v.select(0, slot);  // [Hkv, T, d]
          seqs.push_back(specdec::AttnSeq{k.data_ptr(), v.data_ptr(), sg.k.stride(2), sg.k.stride(1), sg.start, sg.row,
                                          sg.n, nullptr, 0, sg.k.scalar_type() == at::kHalf});
        }
        specdec::attend_seqs_op(q.data_ptr<float>(), attn.data_ptr<float>(), hq, hk, d, seqs);
      }
      at::Tensor out = linear(w, lin + 1, attn, nullptr);  // [M, D]
      if (post) post_norm(out, w.post[2 * li], eps, value);
      add_into(x, out);
    }
    if (plan[s + 2]) {
      const at::Tensor rs = inv_rms(x, eps, value);
      const at::Tensor gate_up = linear(w, lin + 2, x, rs.data_ptr<float>());  // [M, 2 I]
      const int64_t inter = gate_up.size(1) / 2;
      // [M, I], ATen's silu (Gemma 3: tanh-GELU) on the same view
      at::Tensor h = post ? at::gelu(gate_up.narrow(1, 0, inter), "tanh") : at::silu(gate_up.narrow(1, 0, inter));
      float* hp = h.data_ptr<float>();
      const float* gp = gate_up.data_ptr<float>();
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < inter; ++j) hp[r * inter + j] = hp[r * inter + j] * gp[r * 2 * inter + inter + j];
      at::Tensor down = linear(w, lin + 3, h, nullptr);  // [M, D]
      if (post) post_norm(down, w.post[2 * li + 1], eps, value);
      add_into(x, down);
    }
    if (next_tap < n_taps && taps[next_tap] == static_cast<int64_t>(s / 4) + 1)
      tap_out->select(0, next_tap++).copy_(x);
  }
  if (!final_norm) return x;
  const at::Tensor rs = inv_rms(x, eps, value);
  const float* rp = rs.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < width; ++j) xp[r * width + j] = xp[r * width + j] * rp[r];
  return x;
}

at::Tensor fused_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_all,
                        const at::Tensor& v_all, int64_t start, int64_t hq, int64_t hk, int64_t d, const at::Tensor& eps,
                        const c10::intrusive_ptr<FusedWeights>& weights, std::vector<int64_t> plan, bool final_norm,
                        int64_t tree_start, const c10::optional<at::Tensor>& paths, std::vector<int64_t> taps,
                        const c10::optional<at::Tensor>& tap_out, const c10::optional<at::Tensor>& cos_local,
                        const c10::optional<at::Tensor>& sin_local) {
  return run(x, cos, sin, {Segment{0, x.size(0), start, k_all, v_all}}, hq, hk, d, eps, *weights, std::move(plan), final_norm,
             tree_start, paths, taps, tap_out, cos_local, sin_local);
}

at::Tensor fused_layers_batch(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                              std::vector<int64_t> starts, std::vector<int64_t> sizes, int64_t hq, int64_t hk, int64_t d,
                              const at::Tensor& eps, const c10::intrusive_ptr<FusedWeights>& weights,
                              std::vector<int64_t> taps, const c10::optional<at::Tensor>& tap_out,
                              const c10::optional<at::Tensor>& cos_local, const c10::optional<at::Tensor>& sin_local) {
  TORCH_CHECK(k_caches.size() == sizes.size() && v_caches.size() == sizes.size() && starts.size() == sizes.size(),
              "fused_layers_batch: one cache, start and size per sequence");
  std::vector<Segment> segs;
  int64_t row = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    segs.push_back(Segment{row, sizes[i], starts[i], k_caches[i], v_caches[i]});
    row += sizes[i];
  }
  TORCH_CHECK(row == x.size(0), "fused_layers_batch: the sizes must add up to x's rows");
  return run(x, cos, sin, segs, hq, hk, d, eps, *weights, {}, true, -1, c10::nullopt, taps, tap_out, cos_local, sin_local);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.class_<FusedWeights>("FusedWeights")
      .def(torch::init<std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("parts", [](const c10::intrusive_ptr<FusedWeights>& self) {  // (kinds, tensors, n_out), as made
        return std::make_tuple(self->kinds, self->w, self->n_out);
      })
      .def("set_head_norms", &FusedWeights::set_head_norms)
      .def("set_gemma", &FusedWeights::set_gemma)
      .def("set_windows", &FusedWeights::set_windows);
  m.def("fused_layers(Tensor x, Tensor cos, Tensor sin, Tensor k_all, Tensor v_all, int start, int n_heads, "
        "int n_kv_heads, int head_dim, Tensor eps, __torch__.torch.classes.specdec.FusedWeights weights, int[] plan, "
        "bool final_norm, int tree_start=-1, Tensor? paths=None, int[] taps=[], Tensor(a!)? tap_out=None, Tensor? cos_local=None, Tensor? sin_local=None) -> Tensor");
  m.def("fused_layers_batch(Tensor x, Tensor cos, Tensor sin, Tensor[] k_caches, Tensor[] v_caches, int[] starts, "
        "int[] sizes, int n_heads, int n_kv_heads, int head_dim, Tensor eps, "
        "__torch__.torch.classes.specdec.FusedWeights weights, int[] taps=[], Tensor(a!)? tap_out=None, Tensor? cos_local=None, Tensor? sin_local=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("fused_layers", &fused_layers);
  m.impl("fused_layers_batch", &fused_layers_batch);
}
