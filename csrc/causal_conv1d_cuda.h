// Plain C++ interface of the GPU depthwise causal conv1d (launchers in selective_scan_cuda.cu, device code in
// causal_conv1d_kernel.cuh), as selective_scan_cuda.h is for the scan: raw pointers, sizes and the stream as an
// opaque void*, no torch or runtime header.
#pragma once

#include <cstdint>

#include "selective_scan_cuda.h"  // ScanDType: the element type (float32, float64, float16, bfloat16)

namespace vim_ds_scan {

// Widest conv the kernels take.
constexpr int64_t kConvMaxWidth = 8;

// Shapes: x (batch, dim, seqlen) with rows contiguous and x_batch_stride elements between batch rows; out, dout,
// dx (batch, dim, seqlen) contiguous, in the element type; w (dim, width), bias (dim,), dw, dbias in the
// accumulation type (float64 for float64, else float32). bias may be null (then dbias must be null).
struct ConvArgs {
  int64_t batch = 0, dim = 0, seqlen = 0, width = 0, x_batch_stride = 0;
  ScanDType dtype = ScanDType::kFloat32;
  bool reverse = false;  // the conv of the time-reversed sequence, in the original order (anti-causal)
  bool silu = false;     // SiLU fused: the forward writes silu(c), the backward's dout is the gradient of silu(c)
  bool accumulate = false;  // backward: dx += this conv's input gradient (a bidirectional mixer's second direction)
  const void* x = nullptr;
  const void* w = nullptr;
  const void* bias = nullptr;
  const void* dout = nullptr;  // backward input
  void* out = nullptr;         // forward output
  void* dx = nullptr;          // backward outputs, written in full (no atomics: the same bits on every run)
  void* dw = nullptr;
  void* dbias = nullptr;
  void* workspace = nullptr;   // backward: conv_workspace_bytes(args) bytes of scratch, no initialisation needed
};

// ConvArgs of these shapes and options, every pointer null.
inline ConvArgs conv_args(int64_t batch, int64_t dim, int64_t seqlen, int64_t width, int64_t x_batch_stride,
                          ScanDType dtype, bool reverse) {
  ConvArgs a;
  a.batch = batch;
  a.dim = dim;
  a.seqlen = seqlen;
  a.width = width;
  a.x_batch_stride = x_batch_stride;
  a.dtype = dtype;
  a.reverse = reverse;
  return a;
}

// Scratch the backward of these shapes needs (the per-block partial sums of dw and dbias).
int64_t conv_workspace_bytes(const ConvArgs& args);

// Launch on `stream`; nullptr on success, else a static error message. With an empty batch or sequence nothing
// runs: the backward's dw and dbias (sums over nothing) must then be zero already.
const char* conv_fwd(const ConvArgs& args, void* stream);
const char* conv_bwd(const ConvArgs& args, void* stream);

}  // namespace vim_ds_scan
