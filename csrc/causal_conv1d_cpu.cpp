// Depthwise causal conv1d + SiLU on the CPU, forward and backward: the first op of every Mamba branch.
//
//   pre[b,d,t] = bias[d] + sum_k w[d,k] * x[b,d,t-(K-1)+k]      (x = 0 before t = 0)
//   u[b,d,t]   = silu(pre[b,d,t])
//
// The generic depthwise F.conv1d path is slow on CPU for K = 4 and its autograd backward allocates zero-filled
// gradients per shifted slice; here one pass over each (batch, channel) row does it all. Parallel over channels,
// so the weight gradient (a sum over batch and time) needs no atomics and is deterministic.
#include "causal_conv1d_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <vector>

namespace {

template <typename acc_t>
inline acc_t sigmoid(acc_t v) { return acc_t(1) / (acc_t(1) + std::exp(-v)); }

// Pre-activation of one row at time t.
template <typename scalar_t, typename acc_t>
inline acc_t conv_at(const scalar_t* x, const acc_t* w, acc_t bias, int64_t K, int64_t t) {
  acc_t s = bias;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t src = t - (K - 1) + k;
    if (src >= 0) s += w[k] * static_cast<acc_t>(x[src]);
  }
  return s;
}

template <typename scalar_t, typename acc_t>
void forward_impl(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool silu,
                  at::Tensor& out) {
  const int64_t B = x.size(0), D = x.size(1), L = x.size(2), K = w.size(-1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const acc_t* wp = w.data_ptr<acc_t>();
  const acc_t* bp = bias.has_value() ? bias->data_ptr<acc_t>() : nullptr;
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t sb = x.stride(0);  // x may be a channel slice of a wider tensor (the x half of xz)
  at::parallel_for(0, B * D, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t d = row % D;
      const scalar_t* xr = xp + (row / D) * sb + d * L;
      scalar_t* orow = op + row * L;
      const acc_t* wd = wp + d * K;
      const acc_t bd = bp ? bp[d] : acc_t(0);
      for (int64_t t = 0; t < L; ++t) {
        const acc_t pre = conv_at(xr, wd, bd, K, t);
        orow[t] = static_cast<scalar_t>(silu ? pre * sigmoid(pre) : pre);
      }
    }
  });
}

template <typename scalar_t, typename acc_t>
void backward_impl(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                   const at::Tensor& dout, bool silu, at::Tensor& dx, at::Tensor& dw, at::Tensor& db) {
  const int64_t B = x.size(0), D = x.size(1), L = x.size(2), K = w.size(-1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* gp = dout.data_ptr<scalar_t>();
  const acc_t* wp = w.data_ptr<acc_t>();
  const acc_t* bp = bias.has_value() ? bias->data_ptr<acc_t>() : nullptr;
  scalar_t* dxp = dx.data_ptr<scalar_t>();
  acc_t* dwp = dw.data_ptr<acc_t>();
  acc_t* dbp = db.defined() ? db.data_ptr<acc_t>() : nullptr;
  const int64_t sb = x.stride(0);
  at::parallel_for(0, D, 4, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> dpre(L);
    for (int64_t d = begin; d < end; ++d) {
      const acc_t* wd = wp + d * K;
      const acc_t bd = bp ? bp[d] : acc_t(0);
      std::vector<acc_t> dwd(K, acc_t(0));
      acc_t dbd = 0;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t row = b * D + d;
        const scalar_t* xr = xp + b * sb + d * L;
        const scalar_t* gr = gp + row * L;
        scalar_t* dxr = dxp + row * L;
        // d(pre) through SiLU: silu'(p) = s(p) * (1 + p * (1 - s(p))), pre recomputed.
        for (int64_t t = 0; t < L; ++t) {
          const acc_t g = static_cast<acc_t>(gr[t]);
          if (silu) {
            const acc_t pre = conv_at(xr, wd, bd, K, t);
            const acc_t s = sigmoid(pre);
            dpre[t] = g * s * (acc_t(1) + pre * (acc_t(1) - s));
          } else {
            dpre[t] = g;
          }
          dbd += dpre[t];
        }
        // dx[t] = sum_k w[k] * dpre[t + (K-1) - k];  dw[k] += sum_t dpre[t] * x[t - (K-1) + k]
        for (int64_t t = 0; t < L; ++t) {
          acc_t s = 0;
          for (int64_t k = 0; k < K; ++k) {
            const int64_t dst = t + (K - 1) - k;
            if (dst < L) s += wd[k] * dpre[dst];
          }
          dxr[t] = static_cast<scalar_t>(s);
        }
        for (int64_t k = 0; k < K; ++k) {
          const int64_t shift = (K - 1) - k;
          acc_t s = 0;
          for (int64_t t = shift; t < L; ++t) s += dpre[t] * static_cast<acc_t>(xr[t - shift]);
          dwd[k] += s;
        }
      }
      for (int64_t k = 0; k < K; ++k) dwp[d * K + k] = dwd[k];
      if (dbp) dbp[d] = dbd;
    }
  });
}

void check_inputs(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "causal_conv1d: x must be a CPU tensor (batch, dim, seqlen) with contiguous rows");
  TORCH_CHECK(w.dim() == 2 && w.size(0) == x.size(1) && w.is_contiguous(),
              "causal_conv1d: weight must be contiguous (dim, kernel_size)");
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(w.scalar_type() == acc, "causal_conv1d: weight must be float32 (float64 for float64 x)");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == x.size(1) && bias->scalar_type() == acc &&
                    bias->is_contiguous(),
                "causal_conv1d: bias must be a contiguous (dim,) tensor of the weight's dtype");
  }
}

}  // namespace

at::Tensor causal_conv1d_fwd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             bool silu) {
  check_inputs(x, weight, bias);
  auto out = at::empty(x.sizes(), x.options());
  switch (x.scalar_type()) {
    case at::kFloat: forward_impl<float, float>(x, weight, bias, silu, out); break;
    case at::kDouble: forward_impl<double, double>(x, weight, bias, silu, out); break;
    case at::kBFloat16: forward_impl<c10::BFloat16, float>(x, weight, bias, silu, out); break;
    default: TORCH_CHECK(false, "causal_conv1d: unsupported dtype ", x.scalar_type());
  }
  return out;
}

std::vector<at::Tensor> causal_conv1d_bwd(const at::Tensor& x, const at::Tensor& weight,
                                          const std::optional<at::Tensor>& bias, const at::Tensor& dout,
                                          bool silu) {
  check_inputs(x, weight, bias);
  TORCH_CHECK(dout.sizes() == x.sizes() && dout.scalar_type() == x.scalar_type() && dout.is_contiguous(),
              "causal_conv1d: dout must be contiguous with x's shape and dtype");
  auto dx = at::empty(x.sizes(), x.options());
  auto dw = at::empty_like(weight);
  at::Tensor db = bias.has_value() ? at::empty_like(*bias) : at::Tensor();
  switch (x.scalar_type()) {
    case at::kFloat: backward_impl<float, float>(x, weight, bias, dout, silu, dx, dw, db); break;
    case at::kDouble: backward_impl<double, double>(x, weight, bias, dout, silu, dx, dw, db); break;
    case at::kBFloat16: backward_impl<c10::BFloat16, float>(x, weight, bias, dout, silu, dx, dw, db); break;
    default: TORCH_CHECK(false, "causal_conv1d: unsupported dtype ", x.scalar_type());
  }
  return {dx, dw, db};
}
