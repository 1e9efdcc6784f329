// Entry points the kernels share inside the one library they are built into (see kernels.py).
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace specdec {

// csrc/q4.cpp: torch.ops.specdec.q4_linear, called directly (no dispatcher round trip); packed6
// empty: no Q6_K columns
at::Tensor q4_product(const at::Tensor& x, const at::Tensor& gain, const at::Tensor& packed, int64_t n_out,
                      const at::Tensor& col, const at::Tensor& packed6);

// csrc/q8.cpp: torch.ops.specdec.q8_linear (the W8A8 few-row product), called directly
std::tuple<at::Tensor, at::Tensor> q8_product(const at::Tensor& x, const c10::optional<at::Tensor>& smooth,
                                              const at::Tensor& packed, const at::Tensor& comp, const at::Tensor& col);

// csrc/attention.cpp: torch.ops.specdec.attend (consecutive rows, or tree nodes over their paths)
at::Tensor attend_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                     const c10::optional<at::Tensor>& paths);

// One sequence of a batched attention call: its cache's keys and values for one layer ([Hkv, T, d],
// features contiguous, k and v of one layout and dtype) and its rows of q / out (see attend_seqs_op)
struct AttnSeq {
  const void* k;         // float32, or float16 where `half`
  const void* v;
  int64_t key_stride;    // elements between consecutive keys
  int64_t head_stride;   // elements between consecutive KV heads
  int64_t start;         // row r sees keys [0, start + r] (without paths), or the prefix [0, start)
  int64_t row;           // its first row in q and out
  int64_t n;             // its rows
  const int64_t* paths;  // [n, e] slot lists of tree nodes, or null
  int64_t e;
  bool half = false;     // the cache holds float16 (IEEE binary16) values
};

// csrc/attention.cpp: the rows of several sequences, each against its own cache, in one parallel
// region; q and out [M, Hq * d] contiguous, each row bitwise what attend_op gives it alone
void attend_seqs_op(const float* q, float* out, int64_t hq, int64_t hk, int64_t d, const std::vector<AttnSeq>& seqs);

}  // namespace specdec
