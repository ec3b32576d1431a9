// Python bindings of the GPU selective scan (module vim_ds._scan_cuda; CUDA, or HIP after PyTorch's hipify).
// Interface: csrc/README.md.
//
// The only file of the GPU kernel that includes torch: it checks the arguments, allocates the outputs, takes the
// current stream and calls the plain-C++ launchers of selective_scan_cuda.h. The Python wrapper validates and
// casts before calling; the checks here are a cheap second line of defence so that a wrong call fails with a
// message instead of reading out of bounds.

// pybind11 with torch's tensor casters and the ATen headers of what is used, not torch/extension.h (all of
// torch's C++ API), as in bindings_cpu.cpp: a third of the compile time.
#include <torch/csrc/utils/pybind.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

// Only the light c10 headers (they need just the CUDA runtime headers; ATen/cuda/CUDAContext.h would also need
// the cuBLAS/cuSPARSE headers, which a minimal toolkit lacks). hipify maps them to c10/hip/*.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>
#include <vector>

#include "causal_conv1d_cuda.h"
#include "selective_scan_cuda.h"

namespace {

using OptTensor = std::optional<at::Tensor>;
using vim_ds_scan::ScanArgs;
using vim_ds_scan::ScanDType;

at::ScalarType acc_dtype(at::ScalarType in) { return in == at::kDouble ? at::kDouble : at::kFloat; }

ScanDType to_scan_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScanDType::kFloat32;
    case at::kDouble: return ScanDType::kFloat64;
    case at::kHalf: return ScanDType::kFloat16;
    case at::kBFloat16: return ScanDType::kBFloat16;
    default: break;
  }
  TORCH_CHECK(false, "selective_scan (gpu): input dtype must be float32, float64, float16 or bfloat16, got ", t);
}

bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

void check_tensor(const at::Tensor& t, const char* name, const at::Device& device, at::ScalarType dtype,
                  at::IntArrayRef shape) {
  TORCH_CHECK(t.defined(), "selective_scan (gpu): ", name, " is undefined");
  TORCH_CHECK(t.is_cuda(), "selective_scan (gpu): ", name, " must be a GPU tensor, got ", t.device());
  TORCH_CHECK(t.device() == device, "selective_scan (gpu): ", name, " is on ", t.device(), ", u on ", device);
  TORCH_CHECK(t.scalar_type() == dtype, "selective_scan (gpu): ", name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, "selective_scan (gpu): ", name, " must have shape ", shape, ", got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), "selective_scan (gpu): ", name, " must be contiguous");
}

void check_optional(const OptTensor& t, const char* name, const at::Device& device, at::ScalarType dtype,
                    at::IntArrayRef shape) {
  if (present(t)) check_tensor(*t, name, device, dtype, shape);
}

// Checks everything fwd and bwd share and fills the sizes and input pointers of `args`.
ScanArgs check_inputs(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                      const at::Tensor& C, const OptTensor& D, const OptTensor& z, const OptTensor& delta_bias,
                      bool delta_softplus, bool reverse) {
  TORCH_CHECK(u.defined() && u.dim() == 3, "selective_scan (gpu): u must be 3-D (batch, dim, seqlen)");
  TORCH_CHECK(A.defined() && A.dim() == 2, "selective_scan (gpu): A must be 2-D (dim, d_state)");
  TORCH_CHECK(u.is_cuda(), "selective_scan (gpu): u must be a GPU tensor, got ", u.device());
  const auto in = u.scalar_type();
  const auto acc = acc_dtype(in);
  const int64_t batch = u.size(0), dim = u.size(1), L = u.size(2), N = A.size(1);
  TORCH_CHECK(L >= 1, "selective_scan (gpu): seqlen must be >= 1");
  TORCH_CHECK(N >= 1 && N <= vim_ds_scan::kScanMaxDState, "selective_scan (gpu): d_state must be in [1, ",
              vim_ds_scan::kScanMaxDState, "], got ", N);
  TORCH_CHECK(batch <= INT32_MAX && dim <= INT32_MAX && L <= INT32_MAX, "selective_scan (gpu): sizes too large");
  const at::Device device = u.device();
  check_tensor(u, "u", device, in, {batch, dim, L});
  check_tensor(delta, "delta", device, in, {batch, dim, L});
  check_tensor(A, "A", device, acc, {dim, N});
  check_tensor(B, "B", device, in, {batch, N, L});
  check_tensor(C, "C", device, in, {batch, N, L});
  check_optional(D, "D", device, acc, {dim});
  check_optional(z, "z", device, in, {batch, dim, L});
  check_optional(delta_bias, "delta_bias", device, acc, {dim});

  ScanArgs args = vim_ds_scan::scan_args(batch, dim, L, N, to_scan_dtype(in), delta_softplus, reverse);
  args.u = u.data_ptr();
  args.delta = delta.data_ptr();
  args.A = A.data_ptr();
  args.B = B.data_ptr();
  args.C = C.data_ptr();
  args.D = present(D) ? D->data_ptr() : nullptr;
  args.z = present(z) ? z->data_ptr() : nullptr;
  args.delta_bias = present(delta_bias) ? delta_bias->data_ptr() : nullptr;
  return args;
}

void* current_stream() { return static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()); }

std::vector<at::Tensor> fwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                            const at::Tensor& C, const OptTensor& D, const OptTensor& z,
                            const OptTensor& delta_bias, bool delta_softplus, bool reverse,
                            bool return_last_state, const OptTensor& h0, const OptTensor& add_to) {
  ScanArgs args = check_inputs(u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse);
  check_optional(h0, "h0", u.device(), A.scalar_type(), {args.batch, args.dim, args.dstate});
  args.h0 = present(h0) ? h0->data_ptr() : nullptr;
  check_optional(add_to, "add_to", u.device(), u.scalar_type(), u.sizes());
  const c10::cuda::CUDAGuard device_guard(u.device());

  // add_to: the output goes into it, added to what it holds (the kernel reads and writes each element once)
  at::Tensor out = present(add_to) ? *add_to : at::empty_like(u);
  args.accumulate = present(add_to);
  const int64_t n_ckpt = vim_ds_scan::scan_num_checkpoints(args.seqlen, args.dstate, args.dtype);
  at::Tensor saved =
      at::empty({args.batch, args.dim, n_ckpt, args.dstate}, u.options().dtype(acc_dtype(u.scalar_type())));
  args.out = out.data_ptr();
  args.saved = n_ckpt > 0 ? saved.data_ptr() : nullptr;
  // The state after the last scan step, written by the kernel's last segment (every element when batch*dim > 0;
  // zeros otherwise, as the CPU kernel gives).
  at::Tensor last_state;
  if (return_last_state) {
    const auto acc_opts = u.options().dtype(acc_dtype(u.scalar_type()));
    last_state = args.batch * args.dim > 0 ? at::empty({args.batch, args.dim, args.dstate}, acc_opts)
                                           : at::zeros({args.batch, args.dim, args.dstate}, acc_opts);
    args.last_state = last_state.data_ptr();
  }
  const int64_t ws_bytes = vim_ds_scan::scan_workspace_bytes(args, false);
  at::Tensor ws = at::empty({ws_bytes}, u.options().dtype(at::kByte));
  args.workspace = ws_bytes > 0 ? ws.data_ptr() : nullptr;

  const char* err = vim_ds_scan::scan_fwd(args, current_stream());
  TORCH_CHECK(err == nullptr, "selective_scan (gpu) forward failed: ", err);
  return {out, saved, last_state};  // an undefined last_state becomes None in Python
}

std::vector<at::Tensor> bwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                            const at::Tensor& C, const OptTensor& D, const OptTensor& z,
                            const OptTensor& delta_bias, const at::Tensor& dout, const at::Tensor& saved,
                            bool delta_softplus, bool reverse, const OptTensor& h0, const OptTensor& dlast) {
  ScanArgs args = check_inputs(u, delta, A, B, C, D, z, delta_bias, delta_softplus, reverse);
  const at::Device device = u.device();
  const auto in = u.scalar_type();
  const auto acc = acc_dtype(in);
  check_tensor(dout, "dout", device, in, {args.batch, args.dim, args.seqlen});
  const int64_t n_ckpt = vim_ds_scan::scan_num_checkpoints(args.seqlen, args.dstate, args.dtype);
  check_tensor(saved, "saved", device, acc, {args.batch, args.dim, n_ckpt, args.dstate});
  check_optional(h0, "h0", device, acc, {args.batch, args.dim, args.dstate});
  check_optional(dlast, "dlast", device, acc, {args.batch, args.dim, args.dstate});
  const c10::cuda::CUDAGuard device_guard(device);

  at::Tensor du = at::empty_like(u);
  at::Tensor ddelta = at::empty_like(delta);
  at::Tensor dz = present(z) ? at::empty_like(*z) : at::Tensor();
  // Sums over channels / time / batch, in the accumulation dtype; the kernels write every element (ordered sums,
  // no atomics). Zeroed anyway: batch * dim == 0 launches nothing.
  const auto acc_opts = u.options().dtype(acc);
  at::Tensor dA = at::zeros_like(A);
  at::Tensor dB_acc = at::zeros({args.batch, args.dstate, args.seqlen}, acc_opts);
  at::Tensor dC_acc = at::zeros({args.batch, args.dstate, args.seqlen}, acc_opts);
  at::Tensor dD = present(D) ? at::zeros_like(*D) : at::Tensor();
  at::Tensor ddelta_bias = present(delta_bias) ? at::zeros_like(*delta_bias) : at::Tensor();
  const int64_t ws_bytes = vim_ds_scan::scan_workspace_bytes(args, true);
  at::Tensor ws = at::empty({ws_bytes}, u.options().dtype(at::kByte));
  args.workspace = ws_bytes > 0 ? ws.data_ptr() : nullptr;

  args.dout = dout.data_ptr();
  args.saved = n_ckpt > 0 ? saved.data_ptr() : nullptr;
  args.du = du.data_ptr();
  args.ddelta = ddelta.data_ptr();
  args.dz = dz.defined() ? dz.data_ptr() : nullptr;
  args.dA = dA.data_ptr();
  args.dB = dB_acc.data_ptr();
  args.dC = dC_acc.data_ptr();
  args.dD = dD.defined() ? dD.data_ptr() : nullptr;
  args.ddelta_bias = ddelta_bias.defined() ? ddelta_bias.data_ptr() : nullptr;
  // The initial state's gradient, when there is an initial state: written in full by the kernel's first segment
  // (zeros when batch * dim == 0, which launches nothing). The backward reads h0 itself from `saved`, where the
  // forward stored it as chunk 0's start state.
  at::Tensor dh0;
  if (present(h0)) {
    dh0 = args.batch * args.dim > 0 ? at::empty_like(*h0) : at::zeros_like(*h0);
    args.dh0 = dh0.data_ptr();
  }
  args.dlast = present(dlast) ? dlast->data_ptr() : nullptr;

  const char* err = vim_ds_scan::scan_bwd(args, current_stream());
  TORCH_CHECK(err == nullptr, "selective_scan (gpu) backward failed: ", err);

  // dB, dC in the input dtype (a no-op for float32 / float64).
  at::Tensor dB = dB_acc.to(in);
  at::Tensor dC = dC_acc.to(in);
  // Undefined tensors become None in Python.
  if (dh0.defined()) return {du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dh0};
  return {du, ddelta, dA, dB, dC, dD, dz, ddelta_bias};
}

at::Tensor h0_grad(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                   const at::Tensor& C, const OptTensor& z, const OptTensor& delta_bias, const at::Tensor& dout,
                   bool delta_softplus, bool reverse) {
  ScanArgs args = check_inputs(u, delta, A, B, C, std::nullopt, z, delta_bias, delta_softplus, reverse);
  check_tensor(dout, "dout", u.device(), u.scalar_type(), {args.batch, args.dim, args.seqlen});
  const c10::cuda::CUDAGuard device_guard(u.device());
  // The kernel writes dh0, then the decay product, into its workspace (selective_scan_cuda.h).
  const auto acc_opts = u.options().dtype(acc_dtype(u.scalar_type()));
  at::Tensor result = at::zeros({2, args.batch, args.dim, args.dstate}, acc_opts);
  args.dout = dout.data_ptr();
  args.workspace = vim_ds_scan::scan_h0_grad_workspace_bytes(args) > 0 ? result.data_ptr() : nullptr;
  const char* err = vim_ds_scan::scan_h0_grad(args, current_stream());
  TORCH_CHECK(err == nullptr, "selective_scan (gpu) h0_grad failed: ", err);
  return result[0];
}

// The depthwise causal conv1d, with the CPU module's interface (bindings_cpu.cpp): x (batch, dim, seqlen) with rows
// contiguous (a channel slice of a wider tensor is fine), weight (dim, width) and bias (dim,) in the accumulation
// dtype.
vim_ds_scan::ConvArgs check_conv(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                                 bool reverse) {
  TORCH_CHECK(x.defined() && x.dim() == 3, "causal_conv1d (gpu): x must be 3-D (batch, dim, seqlen)");
  TORCH_CHECK(x.is_cuda(), "causal_conv1d (gpu): x must be a GPU tensor, got ", x.device());
  TORCH_CHECK(weight.defined() && weight.dim() == 2 && weight.size(0) == x.size(1),
              "causal_conv1d (gpu): weight must be (dim, width)");
  const int64_t batch = x.size(0), dim = x.size(1), L = x.size(2), K = weight.size(1);
  TORCH_CHECK(K >= 1 && K <= vim_ds_scan::kConvMaxWidth, "causal_conv1d (gpu): width must be in [1, ",
              vim_ds_scan::kConvMaxWidth, "], got ", K);
  TORCH_CHECK(x.stride(2) == 1 && (dim <= 1 || x.stride(1) == L) && (batch <= 1 || x.stride(0) >= dim * L),
              "causal_conv1d (gpu): x's rows must be contiguous");
  const auto acc = acc_dtype(x.scalar_type());
  check_tensor(weight, "weight", x.device(), acc, {dim, K});
  check_optional(bias, "bias", x.device(), acc, {dim});
  vim_ds_scan::ConvArgs a =
      vim_ds_scan::conv_args(batch, dim, L, K, x.stride(0), to_scan_dtype(x.scalar_type()), reverse);
  a.x = x.data_ptr();
  a.w = weight.data_ptr();
  a.bias = present(bias) ? bias->data_ptr() : nullptr;
  return a;
}

at::Tensor conv_fwd(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, bool reverse, bool silu) {
  vim_ds_scan::ConvArgs a = check_conv(x, weight, bias, reverse);
  a.silu = silu;
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options());
  a.out = out.data_ptr();
  const char* err = vim_ds_scan::conv_fwd(a, current_stream());
  TORCH_CHECK(err == nullptr, "causal_conv1d (gpu) forward failed: ", err);
  return out;
}

std::vector<at::Tensor> conv_bwd(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                                 const at::Tensor& dout, bool reverse, bool silu, const OptTensor& dx_add_to) {
  vim_ds_scan::ConvArgs a = check_conv(x, weight, bias, reverse);
  a.silu = silu;
  check_tensor(dout, "dout", x.device(), x.scalar_type(), {a.batch, a.dim, a.seqlen});
  check_optional(dx_add_to, "dx_add_to", x.device(), x.scalar_type(), x.sizes());
  const c10::cuda::CUDAGuard device_guard(x.device());
  // contiguous; dx_add_to: dx goes into it, added to what it holds
  at::Tensor dx = present(dx_add_to) ? *dx_add_to : at::empty(x.sizes(), x.options());
  a.accumulate = present(dx_add_to);
  // zeroed: with an empty batch or sequence the kernels leave them as they are (sums over nothing)
  at::Tensor dw = at::zeros_like(weight);
  at::Tensor db = present(bias) ? at::zeros_like(*bias) : at::Tensor();
  at::Tensor ws = at::empty({vim_ds_scan::conv_workspace_bytes(a)}, x.options().dtype(at::kByte));
  a.dout = dout.data_ptr();
  a.dx = dx.data_ptr();
  a.dw = dw.data_ptr();
  a.dbias = db.defined() ? db.data_ptr() : nullptr;
  a.workspace = ws.numel() > 0 ? ws.data_ptr() : nullptr;
  const char* err = vim_ds_scan::conv_bwd(a, current_stream());
  TORCH_CHECK(err == nullptr, "causal_conv1d (gpu) backward failed: ", err);
  return {dx, dw, db};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Selective scan (Mamba SSM) forward/backward on CUDA / ROCm GPUs; see csrc/README.md";
  m.def("fwd", &fwd, "selective scan forward (from h0 if given) -> [out, saved, last_state or None]", py::arg("u"),
        py::arg("delta"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("D"), py::arg("z"),
        py::arg("delta_bias"), py::arg("delta_softplus"), py::arg("reverse") = false,
        py::arg("return_last_state") = false, py::arg("h0") = py::none(), py::arg("add_to") = py::none());
  m.def("bwd", &bwd,
        "selective scan backward -> [du, ddelta, dA, dB, dC, dD, dz, ddelta_bias] (+ [dh0] when h0 is given)",
        py::arg("u"), py::arg("delta"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("D"), py::arg("z"),
        py::arg("delta_bias"), py::arg("dout"), py::arg("saved"), py::arg("delta_softplus"),
        py::arg("reverse") = false, py::arg("h0") = py::none(), py::arg("dlast") = py::none());
  m.def("h0_grad", &h0_grad,
        "the gradient of the initial state alone (bwd's dh0 without dlast), from one reverse pass -> dh0",
        py::arg("u"), py::arg("delta"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("z"),
        py::arg("delta_bias"), py::arg("dout"), py::arg("delta_softplus"), py::arg("reverse") = false);
  m.def("conv_fwd", &conv_fwd, "depthwise causal conv1d forward (silu: -> silu(conv))", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("reverse") = false, py::arg("silu") = false);
  m.def("conv_bwd", &conv_bwd,
        "depthwise causal conv1d backward -> [dx, dweight, dbias] (silu: dout is the gradient of silu(conv))",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("dout"), py::arg("reverse") = false,
        py::arg("silu") = false, py::arg("dx_add_to") = py::none());
  m.def(
      "set_tuning",
      [](int64_t chunk, int64_t tiles, int64_t target_blocks, int64_t partials) {
        const vim_ds_scan::ScanTuning before = vim_ds_scan::scan_tuning();
        vim_ds_scan::ScanTuning t;
        t.chunk = chunk;
        t.tiles = tiles;
        t.target_blocks = target_blocks;
        t.partials = partials;
        const char* err = vim_ds_scan::scan_set_tuning(t);
        TORCH_CHECK(err == nullptr, err);
        return std::vector<int64_t>{before.chunk, before.tiles, before.target_blocks, before.partials};
      },
      "cap the launcher's layout (selective_scan_cuda.h, ScanTuning; 0: its own choice) -> the caps before, "
      "[chunk, tiles, target_blocks, partials]",
      py::arg("chunk") = 0, py::arg("tiles") = 0, py::arg("target_blocks") = 0, py::arg("partials") = 0);
  m.def(
      "layout",
      [](int64_t batch, int64_t dim, int64_t seqlen, int64_t dstate, int64_t dtype, bool backward) {
        const auto a = vim_ds_scan::scan_args(batch, dim, seqlen, dstate, ScanDType(dtype));
        const vim_ds_scan::ScanLayout l = vim_ds_scan::scan_layout(a, backward);
        return std::vector<int64_t>{l.chunk, l.tiles, l.channels_per_block, l.blocks_per_batch, l.n_seg,
                                    l.partials};
      },
      "what the launcher picks under the current tuning -> [chunk, tiles, channels per block, blocks per batch "
      "element, segments, partials (1: the backward writes per-block partial sums of dB, dC)]; dtype: 0 float32, "
      "1 float64, 2 float16, 3 bfloat16",
      py::arg("batch"), py::arg("dim"), py::arg("seqlen"), py::arg("d_state"), py::arg("dtype"),
      py::arg("backward"));
  m.def(
      "chunk_length",
      [](int64_t dstate, bool float64) {
        return vim_ds_scan::scan_chunk_length(dstate, float64 ? ScanDType::kFloat64 : ScanDType::kFloat32);
      },
      "time steps between the states the forward stores in `saved` (same for float32, float16 and bfloat16)",
      py::arg("d_state"), py::arg("float64"));
}
