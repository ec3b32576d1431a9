// Depthwise causal conv1d on the CPU, forward and backward: the first op of every Mamba branch.
//
//   y[b,d,t] = bias[d] + sum_k w[d,k] * x[b,d,t-(K-1)+k]      (x = 0 before t = 0)
//
// The generic depthwise F.conv1d (oneDNN) is slow on CPU for K = 4, and slower still in backward; here each
// (batch, channel) row is K vectorised shifted multiply-adds. The backward is parallel over channels, so the
// weight and bias gradients (sums over batch and time) need no atomics and are deterministic.
//
// `reverse` (Vim's backward direction) is the conv of the time-reversed sequence, in the original order: rows are
// read back to front into the row buffer and written back front to back, so the arithmetic is exactly that of
// flipping x and dout before and the results after.
#include "causal_conv1d_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <vector>

namespace {

// One row: out[t] = bias + sum_k w[k] * x[t - (K-1) + k], as K shifted saxpy loops over t that the compiler
// vectorises (no branch inside them).
template <typename scalar_t, typename acc_t>
void conv_row(const scalar_t* x, const acc_t* w, acc_t bias, int64_t K, int64_t L, bool reverse, acc_t* xrow,
              acc_t* out) {
  for (int64_t t = 0; t < L; ++t) {
    xrow[t] = static_cast<acc_t>(x[reverse ? L - 1 - t : t]);
    out[t] = bias;
  }
  for (int64_t k = 0; k < K; ++k) {
    const int64_t shift = (K - 1) - k;  // tap k reads `shift` steps back
    const acc_t wk = w[k];
#pragma omp simd
    for (int64_t t = shift; t < L; ++t) out[t] += wk * xrow[t - shift];
  }
}

template <typename scalar_t, typename acc_t>
void forward_impl(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool reverse,
                  at::Tensor& out) {
  const int64_t B = x.size(0), D = x.size(1), L = x.size(2), K = w.size(-1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const acc_t* wp = w.data_ptr<acc_t>();
  const acc_t* bp = bias.has_value() ? bias->data_ptr<acc_t>() : nullptr;
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t sb = x.stride(0);  // x may be a channel slice of a wider tensor (the x half of xz)
  at::parallel_for(0, B * D, 16, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> xrow(L), orow(L);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t d = row % D;
      conv_row(xp + (row / D) * sb + d * L, wp + d * K, bp ? bp[d] : acc_t(0), K, L, reverse, xrow.data(),
               orow.data());
      scalar_t* o = op + row * L;
      for (int64_t t = 0; t < L; ++t) o[reverse ? L - 1 - t : t] = static_cast<scalar_t>(orow[t]);
    }
  });
}

// dx[t] = sum_k w[k] * dy[t + (K-1) - k];  dw[k] = sum_{b,t} dy[t] * x[t - (K-1) + k];  dbias = sum_{b,t} dy.
template <typename scalar_t, typename acc_t>
void backward_impl(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dout, bool reverse, at::Tensor& dx,
                   at::Tensor& dw, at::Tensor& db) {
  const int64_t B = x.size(0), D = x.size(1), L = x.size(2), K = w.size(-1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* gp = dout.data_ptr<scalar_t>();
  const acc_t* wp = w.data_ptr<acc_t>();
  scalar_t* dxp = dx.data_ptr<scalar_t>();
  acc_t* dwp = dw.data_ptr<acc_t>();
  acc_t* dbp = db.defined() ? db.data_ptr<acc_t>() : nullptr;
  const int64_t sb = x.stride(0);
  // Parallel over channels: the sums over batch and time for dw and dbias stay inside one work item.
  at::parallel_for(0, D, 4, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> xrow(L), grow(L), dxrow(L);
    for (int64_t d = begin; d < end; ++d) {
      const acc_t* wd = wp + d * K;
      std::vector<acc_t> dwd(K, acc_t(0));
      acc_t dbd = 0;
      for (int64_t b = 0; b < B; ++b) {
        const scalar_t* xr = xp + b * sb + d * L;
        const scalar_t* gr = gp + (b * D + d) * L;
        for (int64_t t = 0; t < L; ++t) {
          const int64_t src = reverse ? L - 1 - t : t;
          xrow[t] = static_cast<acc_t>(xr[src]);
          grow[t] = static_cast<acc_t>(gr[src]);
          dxrow[t] = 0;
        }
        acc_t s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t t = 0; t < L; ++t) s += grow[t];
        dbd += s;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t shift = (K - 1) - k;
          const acc_t wk = wd[k];
          acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t t = shift; t < L; ++t) {
            dxrow[t - shift] += wk * grow[t];
            dot += grow[t] * xrow[t - shift];
          }
          dwd[k] += dot;
        }
        scalar_t* dxr = dxp + (b * D + d) * L;
        for (int64_t t = 0; t < L; ++t) dxr[reverse ? L - 1 - t : t] = static_cast<scalar_t>(dxrow[t]);
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
                             bool reverse) {
  check_inputs(x, weight, bias);
  auto out = at::empty(x.sizes(), x.options());
  switch (x.scalar_type()) {
    case at::kFloat: forward_impl<float, float>(x, weight, bias, reverse, out); break;
    case at::kDouble: forward_impl<double, double>(x, weight, bias, reverse, out); break;
    case at::kBFloat16: forward_impl<c10::BFloat16, float>(x, weight, bias, reverse, out); break;
    default: TORCH_CHECK(false, "causal_conv1d: unsupported dtype ", x.scalar_type());
  }
  return out;
}

std::vector<at::Tensor> causal_conv1d_bwd(const at::Tensor& x, const at::Tensor& weight,
                                          const std::optional<at::Tensor>& bias, const at::Tensor& dout,
                                          bool reverse) {
  check_inputs(x, weight, bias);
  TORCH_CHECK(dout.sizes() == x.sizes() && dout.scalar_type() == x.scalar_type() && dout.is_contiguous(),
              "causal_conv1d: dout must be contiguous with x's shape and dtype");
  auto dx = at::empty(x.sizes(), x.options());
  auto dw = at::empty_like(weight);
  at::Tensor db = bias.has_value() ? at::empty_like(*bias) : at::Tensor();
  switch (x.scalar_type()) {
    case at::kFloat: backward_impl<float, float>(x, weight, dout, reverse, dx, dw, db); break;
    case at::kDouble: backward_impl<double, double>(x, weight, dout, reverse, dx, dw, db); break;
    case at::kBFloat16: backward_impl<c10::BFloat16, float>(x, weight, dout, reverse, dx, dw, db); break;
    default: TORCH_CHECK(false, "causal_conv1d: unsupported dtype ", x.scalar_type());
  }
  return {dx, dw, db};
}
