// Depthwise causal conv1d on the CPU; see causal_conv1d_cpu.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

// x: (batch, dim, seqlen) with contiguous rows; weight: (dim, K) float32 (float64 for float64 x); bias: (dim,).
at::Tensor causal_conv1d_fwd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// Returns {dx, dweight, dbias (undefined without bias)}.
std::vector<at::Tensor> causal_conv1d_bwd(const at::Tensor& x, const at::Tensor& weight,
                                          const std::optional<at::Tensor>& bias, const at::Tensor& dout);
