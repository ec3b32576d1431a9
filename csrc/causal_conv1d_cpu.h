// Depthwise causal conv1d on the CPU; see causal_conv1d_cpu.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

// x: (batch, dim, seqlen) with contiguous rows; weight: (dim, K) float32 (float64 for float64 x); bias: (dim,).
// reverse: the conv of the time-reversed sequence, returned in the original order (anti-causal:
// y[t] = bias + sum_k w[k] x[t + (K-1) - k]), bitwise equal to flip(conv(flip(x))).
at::Tensor causal_conv1d_fwd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             bool reverse);

// Returns {dx, dweight, dbias (undefined without bias)}.
std::vector<at::Tensor> causal_conv1d_bwd(const at::Tensor& x, const at::Tensor& weight,
                                          const std::optional<at::Tensor>& bias, const at::Tensor& dout,
                                          bool reverse);
