// Plain C++ interface between the torch binding (bindings_cuda.cpp) and the GPU launchers
// (selective_scan_cuda.cu).
//
// This header deliberately includes neither torch nor the CUDA/HIP runtime: the binding only hands over raw
// pointers, sizes and the stream (as an opaque void*), and the launchers never see a torch type. That keeps all
// device code free of torch headers, so it compiles on its own with nvcc and, after hipify, with hipcc.
#pragma once

#include <cstdint>

namespace vim_ds_scan {

// Element type of u, delta, z, B, C (the "input dtype"). State and accumulation are float32, or float64 for
// kFloat64 (the "accumulation dtype").
enum class ScanDType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// Everything one forward or backward call needs. Shapes (all tensors contiguous):
//   u, delta, z, out, dout, du, ddelta, dz : (batch, dim, seqlen)           input dtype
//   A                                      : (dim, dstate)                  accumulation dtype
//   B, C                                   : (batch, dstate, seqlen)        input dtype
//   D, delta_bias                          : (dim,)                         accumulation dtype
//   saved                                  : (batch, dim, num_checkpoints, dstate)   accumulation dtype
//   dA (dim, dstate), dB, dC (batch, dstate, seqlen), dD, ddelta_bias (dim,): accumulation dtype, written in
//   full by the backward (no atomics: the same inputs give the same bits on every run).
//   workspace: scan_workspace_bytes(args, backward) bytes of scratch for that call (nullptr when 0), no
//   initialisation needed, 8-byte aligned.
// D, z, delta_bias may be null (then dD / dz / ddelta_bias must be null too). Pointers a call does not use
// (e.g. the gradients in the forward) are ignored.
struct ScanArgs {
  int64_t batch = 0, dim = 0, seqlen = 0, dstate = 0;
  ScanDType dtype = ScanDType::kFloat32;
  bool delta_softplus = false;
  bool reverse = false;  // scan from t = seqlen-1 down to 0 (as if every time-indexed tensor were flipped)
  bool accumulate = false;  // forward: add the output into what out holds instead of overwriting it (the second
                            // direction of a bidirectional mixer sums its output into the first's)

  const void* u = nullptr;
  const void* delta = nullptr;
  const void* A = nullptr;
  const void* B = nullptr;
  const void* C = nullptr;
  const void* D = nullptr;
  const void* z = nullptr;
  const void* delta_bias = nullptr;

  void* out = nullptr;          // forward output
  void* saved = nullptr;        // written by the forward, read by the backward
  void* last_state = nullptr;   // forward, optional: (batch, dim, dstate) accumulation dtype, the state after the
                                // last scan step (after t = 0 in reverse mode)
  const void* h0 = nullptr;     // forward, optional (null: zero): (batch, dim, dstate) accumulation dtype, the
                                // state before the first scan step (before t = seqlen-1 in reverse mode); the
                                // forward stores it in `saved` (chunk 0's start), where the backward reads it
  const void* dout = nullptr;   // backward input
  const void* dlast = nullptr;  // backward, optional (null: zero): the gradient of last_state, as h0
  void* dh0 = nullptr;          // backward, optional: the gradient of h0, as h0, written in full when not null

  void* du = nullptr;
  void* ddelta = nullptr;
  void* dz = nullptr;
  void* dA = nullptr;
  void* dB = nullptr;
  void* dC = nullptr;
  void* dD = nullptr;
  void* ddelta_bias = nullptr;
  void* workspace = nullptr;
};

// ScanArgs of these shapes and options, every pointer null.
inline ScanArgs scan_args(int64_t batch, int64_t dim, int64_t seqlen, int64_t dstate, ScanDType dtype,
                          bool delta_softplus = false, bool reverse = false) {
  ScanArgs a;
  a.batch = batch;
  a.dim = dim;
  a.seqlen = seqlen;
  a.dstate = dstate;
  a.dtype = dtype;
  a.delta_softplus = delta_softplus;
  a.reverse = reverse;
  return a;
}

// Largest supported d_state.
constexpr int64_t kScanMaxDState = 256;

// Time steps between two stored states ("chunk length"); depends only on d_state and the dtype.
int64_t scan_chunk_length(int64_t dstate, ScanDType dtype);

// Number of stored states per (batch, channel): ceil(seqlen / chunk_length), the state at the start of every
// chunk (the first chunk's: h0, or zero).
int64_t scan_num_checkpoints(int64_t seqlen, int64_t dstate, ScanDType dtype);

// Scratch the forward (backward = false) or the backward of these shapes needs in ScanArgs::workspace. Depends
// on batch, dim, seqlen, dstate and the dtype only (the pointers need not be set).
int64_t scan_workspace_bytes(const ScanArgs& args, bool backward);

// The work layout the launcher picks, capped for measurement (`vim-ds bench scan --layouts`; the kernel emulator's
// tests): how a layout choice plays out on a real GPU is measured there, not guessed. Every field 0 means the
// launcher's own choice, which is also what any field leaves free:
//   chunk         the most time steps a chunk may have: a power of two <= 64. The launcher takes the longest
//                 power of two at most this that fits the backward's shared memory. Forward and backward must run
//                 under the same chunk (it sets `saved`'s shape, which the binding checks);
//   tiles         the most channel tiles a backward block walks (1 .. 4; fewer where the instance has fewer);
//   target_blocks the blocks a launch aims at: below it the sequence is split into segments (default 1024; 1:
//                 never split);
//   partials      1: where several blocks of channels share a batch row, the backward's blocks write their sums
//                 of dB, dC as partials that a reduction adds (0, the launcher's: they add them into dB, dC in
//                 turn, a chain; the same bits either way).
// Process-wide, not thread-safe (set it between calls, as a benchmark does).
struct ScanTuning {
  int64_t chunk = 0, tiles = 0, target_blocks = 0, partials = 0;
};
// Set the tuning; returns nullptr, or a static message naming the field out of range (then nothing changes).
const char* scan_set_tuning(const ScanTuning& tuning);
ScanTuning scan_tuning();

// What the launcher picks for these shapes under the current tuning (forward or backward launch).
struct ScanLayout {
  int64_t chunk = 0, tiles = 0, channels_per_block = 0, blocks_per_batch = 0, n_seg = 0;
  int64_t partials = 0;  // backward: 1 when its blocks write per-block partial sums of dB, dC
};
ScanLayout scan_layout(const ScanArgs& args, bool backward);

// Launch the forward / backward on `stream` (the runtime's stream handle, passed as void* so that this header
// needs no runtime header).
// Return nullptr on success, or a static error message (bad arguments, or the launch error reported by the
// runtime).
const char* scan_fwd(const ScanArgs& args, void* stream);
const char* scan_bwd(const ScanArgs& args, void* stream);

// The gradient of the initial state alone for output gradient `dout` (the dh0 of scan_bwd without dlast), from
// one reverse pass that recomputes no state (u, delta, A, B, C, z, delta_bias, dout as for scan_bwd; saved, dlast
// and the gradients' pointers are not used). The result is written to the workspace, which must hold
// scan_h0_grad_workspace_bytes(args) bytes: dh0 (batch, dim, dstate) at its start, then the sequence's decay
// product exp(A * sum of delta'), as dh0, in the accumulation dtype.
int64_t scan_h0_grad_workspace_bytes(const ScanArgs& args);
const char* scan_h0_grad(const ScanArgs& args, void* stream);

}  // namespace vim_ds_scan
