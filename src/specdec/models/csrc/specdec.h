// Entry points the kernels share inside the one library they are built into (see kernels.py).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace specdec {

// csrc/q4.cpp: torch.ops.specdec.q4_linear, called directly (no dispatcher round trip)
at::Tensor q4_product(const at::Tensor& x, const at::Tensor& gain, const at::Tensor& packed, int64_t n_out,
                      const at::Tensor& col);

// csrc/q8.cpp: torch.ops.specdec.q8_linear (the W8A8 few-row product), called directly
std::tuple<at::Tensor, at::Tensor> q8_product(const at::Tensor& x, const c10::optional<at::Tensor>& smooth,
                                              const at::Tensor& packed, const at::Tensor& comp, const at::Tensor& col);

// csrc/attention.cpp: torch.ops.specdec.attend (consecutive rows, or tree nodes over their paths)
at::Tensor attend_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                     const c10::optional<at::Tensor>& paths);

}  // namespace specdec
