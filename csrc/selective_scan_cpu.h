// CPU selective scan (see csrc/README.md for the operation and the interface).
//
// These two functions do the work behind `vim_ds._scan_cpu.fwd` / `.bwd`; bindings_cpu.cpp only checks the
// arguments and forwards them. Inputs must already be validated (contiguous, CPU, consistent shapes/dtypes).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace vim_ds {
namespace scan_cpu {

// `reverse`: scan from t = L-1 down to 0 (h[L] = 0), as if every time-indexed input were flipped before and every
// output flipped after, without the copies.
// Returns {out, saved, last_state}. `saved` is an empty tensor: the backward recomputes the states per channel.
// `last_state` (batch, dim, d_state) in the accumulation dtype (A's): the state after the last scan step (after
// t = 0 in reverse mode) when `return_last_state`, else an undefined tensor (None in Python).
// `h0` (batch, dim, d_state) in the accumulation dtype, optional: the state before the first scan step (before
// t = L-1 in reverse mode) instead of zero; left out, the kernel runs exactly as without it.
std::vector<at::Tensor> selective_scan_fwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                           const at::Tensor& B, const at::Tensor& C,
                                           const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                                           const std::optional<at::Tensor>& delta_bias, bool delta_softplus,
                                           bool reverse, bool return_last_state = false,
                                           const std::optional<at::Tensor>& h0 = std::nullopt);

// Returns {du, ddelta, dA, dB, dC, dD, dz, ddelta_bias}, and dh0 after them when `h0` is given (the forward's h0,
// from which the states are recomputed); dD / dz / ddelta_bias are undefined tensors (None in Python) when D / z /
// delta_bias are not given. `dlast` (batch, dim, d_state) in the accumulation dtype, optional: the gradient of the
// forward's last state, added to what flows back from the outputs.
std::vector<at::Tensor> selective_scan_bwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                           const at::Tensor& B, const at::Tensor& C,
                                           const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                                           const std::optional<at::Tensor>& delta_bias, const at::Tensor& dout,
                                           bool delta_softplus, bool reverse,
                                           const std::optional<at::Tensor>& h0 = std::nullopt,
                                           const std::optional<at::Tensor>& dlast = std::nullopt);

// The gradient of the initial state h0 (batch, dim, d_state) in the accumulation dtype for an output gradient
// `dout`, and nothing else: the dh0 that selective_scan_bwd returns with `dlast` absent, from a reverse pass that
// reads only delta, A, C, z and dout and recomputes no state (about the forward's cost). It does not depend on h0.
at::Tensor selective_scan_h0_grad(const at::Tensor& delta, const at::Tensor& A, const at::Tensor& C,
                                  const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& delta_bias,
                                  const at::Tensor& dout, bool delta_softplus, bool reverse);

// sum over time of delta' = softplus(delta + delta_bias) (or delta + delta_bias), (batch, dim) in the accumulation
// dtype: the exponent of a chunk's decay product, P = exp(A * sum), with the kernels' own softplus.
at::Tensor delta_sum(const at::Tensor& delta, const std::optional<at::Tensor>& delta_bias, bool delta_softplus);

// The instruction-set variants of the kernels, narrowest first (x86-64: sse2, avx2, avx512; aarch64: neon; other
// CPUs: generic): those this CPU can run; the one in use (the widest, unless set_isa chose another); and
// set_isa(name or "auto"), which returns the one in use before and throws for a variant this CPU cannot run.
// Process-wide, for the scan and the causal conv alike (cpu_isa.h).
std::vector<std::string> available_isas();
std::string isa();
std::string set_isa(const std::string& name);

}  // namespace scan_cpu
}  // namespace vim_ds
