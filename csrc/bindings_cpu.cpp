// Python bindings of the CPU selective scan (module vim_ds._scan_cpu). Interface: csrc/README.md.
//
// The Python wrapper validates and casts before calling; the checks here are a cheap second line of defence so
// that a wrong call fails with a message instead of reading out of bounds.

// pybind11 with torch's tensor casters and the ATen headers of what is used, not torch/extension.h (all of
// torch's C++ API): a third of the compile time (38 to 11 CPU-seconds for this file).
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

#include "causal_conv1d_cpu.h"
#include "selective_scan_cpu.h"

namespace {

using OptTensor = std::optional<at::Tensor>;

at::ScalarType acc_dtype(at::ScalarType in) { return in == at::kDouble ? at::kDouble : at::kFloat; }

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape) {
  TORCH_CHECK(t.defined(), "selective_scan (cpu): ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), "selective_scan (cpu): ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "selective_scan (cpu): ", name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, "selective_scan (cpu): ", name, " must have shape ", shape, ", got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), "selective_scan (cpu): ", name, " must be contiguous");
}

void check_optional(const OptTensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape) {
  if (t.has_value() && t->defined()) check_tensor(*t, name, dtype, shape);
}

// Checks everything fwd and bwd share; returns nothing, throws on the first problem.
void check_inputs(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                  const at::Tensor& C, const OptTensor& D, const OptTensor& z, const OptTensor& delta_bias) {
  TORCH_CHECK(u.defined() && u.dim() == 3, "selective_scan (cpu): u must be 3-D (batch, dim, seqlen)");
  TORCH_CHECK(A.defined() && A.dim() == 2, "selective_scan (cpu): A must be 2-D (dim, d_state)");
  const auto in = u.scalar_type();
  TORCH_CHECK(in == at::kFloat || in == at::kDouble || in == at::kBFloat16,
              "selective_scan (cpu): input dtype must be float32, float64 or bfloat16, got ", in);
  const auto acc = acc_dtype(in);
  const int64_t batch = u.size(0), dim = u.size(1), L = u.size(2), N = A.size(1);
  TORCH_CHECK(L >= 1, "selective_scan (cpu): seqlen must be >= 1");
  TORCH_CHECK(N >= 1 && N <= 256, "selective_scan (cpu): d_state must be in [1, 256], got ", N);
  check_tensor(u, "u", in, {batch, dim, L});
  check_tensor(delta, "delta", in, {batch, dim, L});
  check_tensor(A, "A", acc, {dim, N});
  check_tensor(B, "B", in, {batch, N, L});
  check_tensor(C, "C", in, {batch, N, L});
  check_optional(D, "D", acc, {dim});
  check_optional(z, "z", in, {batch, dim, L});
  check_optional(delta_bias, "delta_bias", acc, {dim});
}

std::vector<at::Tensor> fwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                            const at::Tensor& C, const OptTensor& D, const OptTensor& z,
                            const OptTensor& delta_bias, bool delta_softplus, bool reverse, bool return_last_state,
                            const OptTensor& h0) {
  check_inputs(u, delta, A, B, C, D, z, delta_bias);
  check_optional(h0, "h0", A.scalar_type(), {u.size(0), u.size(1), A.size(1)});
  return vim_ds::scan_cpu::selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse,
                                              return_last_state, h0);
}

std::vector<at::Tensor> bwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                            const at::Tensor& C, const OptTensor& D, const OptTensor& z,
                            const OptTensor& delta_bias, const at::Tensor& dout, const OptTensor& saved,
                            bool delta_softplus, bool reverse, const OptTensor& h0, const OptTensor& dlast) {
  (void)saved;  // the CPU backward recomputes the states; fwd returns an empty `saved`
  check_inputs(u, delta, A, B, C, D, z, delta_bias);
  check_tensor(dout, "dout", u.scalar_type(), u.sizes());
  check_optional(h0, "h0", A.scalar_type(), {u.size(0), u.size(1), A.size(1)});
  check_optional(dlast, "dlast", A.scalar_type(), {u.size(0), u.size(1), A.size(1)});
  return vim_ds::scan_cpu::selective_scan_bwd(u, delta, A, B, C, D, z, delta_bias, dout, delta_softplus,
                                              reverse, h0, dlast);
}

at::Tensor h0_grad(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                   const at::Tensor& C, const OptTensor& z, const OptTensor& delta_bias, const at::Tensor& dout,
                   bool delta_softplus, bool reverse) {
  // u and B are checked (the GPU kernel's signature), not read
  check_inputs(u, delta, A, B, C, std::nullopt, z, delta_bias);
  check_tensor(dout, "dout", delta.scalar_type(), delta.sizes());
  return vim_ds::scan_cpu::selective_scan_h0_grad(delta, A, C, z, delta_bias, dout, delta_softplus, reverse);
}

at::Tensor delta_sum(const at::Tensor& delta, const OptTensor& delta_bias, bool delta_softplus) {
  TORCH_CHECK(delta.defined() && delta.dim() == 3, "selective_scan (cpu): delta must be 3-D (batch, dim, seqlen)");
  const auto in = delta.scalar_type();
  TORCH_CHECK(in == at::kFloat || in == at::kDouble || in == at::kBFloat16,
              "selective_scan (cpu): input dtype must be float32, float64 or bfloat16, got ", in);
  check_tensor(delta, "delta", in, delta.sizes());
  check_optional(delta_bias, "delta_bias", acc_dtype(in), {delta.size(1)});
  return vim_ds::scan_cpu::delta_sum(delta, delta_bias, delta_softplus);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Selective scan (Mamba SSM) forward/backward on CPU; see csrc/README.md";
  // The kernels touch no Python object, so other Python threads may run meanwhile.
  m.def("fwd", &fwd, "selective scan forward (from h0 if given) -> [out, saved, last_state or None]", py::arg("u"),
        py::arg("delta"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("D"), py::arg("z"),
        py::arg("delta_bias"), py::arg("delta_softplus"), py::arg("reverse") = false,
        py::arg("return_last_state") = false, py::arg("h0") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("bwd", &bwd,
        "selective scan backward -> [du, ddelta, dA, dB, dC, dD, dz, ddelta_bias] (+ [dh0] when h0 is given)",
        py::arg("u"), py::arg("delta"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("D"), py::arg("z"),
        py::arg("delta_bias"), py::arg("dout"), py::arg("saved"), py::arg("delta_softplus"),
        py::arg("reverse") = false, py::arg("h0") = py::none(), py::arg("dlast") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("h0_grad", &h0_grad,
        "the gradient of the initial state alone (bwd's dh0 without dlast), from one reverse pass -> dh0",
        py::arg("u"), py::arg("delta"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("z"),
        py::arg("delta_bias"), py::arg("dout"), py::arg("delta_softplus"), py::arg("reverse") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("delta_sum", &delta_sum, "sum over time of softplus(delta + delta_bias) -> (batch, dim)", py::arg("delta"),
        py::arg("delta_bias"), py::arg("delta_softplus"), py::call_guard<py::gil_scoped_release>());
  m.def("available_isas", &vim_ds::scan_cpu::available_isas,
        "the instruction-set variants of the scan this CPU can run, narrowest first");
  m.def("isa", &vim_ds::scan_cpu::isa, "the instruction-set variant of the scan in use");
  m.def("set_isa", &vim_ds::scan_cpu::set_isa,
        "use this variant of the scan (one of available_isas(), or 'auto' for the widest); returns the one before",
        py::arg("name"));
  m.def("conv_fwd", &causal_conv1d_fwd, "depthwise causal conv1d forward", py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("reverse") = false, py::call_guard<py::gil_scoped_release>());
  m.def("conv_bwd", &causal_conv1d_bwd, "depthwise causal conv1d backward -> [dx, dweight, dbias]", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("dout"), py::arg("reverse") = false, py::call_guard<py::gil_scoped_release>());
}
