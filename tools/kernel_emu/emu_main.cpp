// C entry points (for ctypes) around the *real* launchers and kernels, compiled for the CPU with the shim headers.
// gen/ holds copies of csrc/selective_scan_{kernel.cuh,cuda.cu,cuda.h} with two mechanical rewrites (like hipify):
// kernel<<<g, b, smem, stream>>>(p) -> emu::launch(kernel, g, b, smem, stream, p), and the extern __shared__
// declaration -> a pointer the emulator points at a guarded buffer.
#include "selective_scan_cuda.cu"

namespace ssk {
double* ss_smem_raw = nullptr;
}

using vim_ds_scan::ScanArgs;
using vim_ds_scan::ScanDType;

namespace {

size_t in_size(ScanDType t) { return t == ScanDType::kFloat64 ? 8 : t == ScanDType::kFloat32 ? 4 : 2; }
size_t acc_size(ScanDType t) { return t == ScanDType::kFloat64 ? 8 : 4; }

struct Buf {
  emu::Guarded g;
  void* host = nullptr;
  size_t bytes = 0;
};

// Copy a host array (or nothing) into a guarded buffer.
void* put(std::vector<Buf>& bufs, const void* host, size_t bytes, bool copy_back, int fill) {
  if (host == nullptr) return nullptr;
  bufs.emplace_back();
  Buf& b = bufs.back();
  b.g = emu::Guarded(bytes);
  b.bytes = bytes;
  b.host = copy_back ? const_cast<void*>(host) : nullptr;
  if (fill >= 0)
    std::memset(b.g.ptr, fill, bytes);
  else
    std::memcpy(b.g.ptr, host, bytes);
  EMU_COUNT_HOOK(emu::count_global(b.g.ptr, bytes));
  return b.g.ptr;
}

// A launch's workspace: `bytes` of scratch that start as NaN bytes, so that reading an entry nobody wrote shows up
// in the results; empty (null) for 0 bytes. It starts on 256 bytes, as torch's allocations on a GPU do, so that its
// regions lie on 32-byte sectors as there (the counting build counts sectors).
void* scratch(emu::Guarded& ws, size_t bytes) {
  if (bytes == 0) return nullptr;
  ws = emu::Guarded(bytes, 256);
  std::memset(ws.ptr, 0xff, bytes);
  EMU_COUNT_HOOK(emu::count_global(ws.ptr, bytes));
  return ws.ptr;
}

// The outputs back into the caller's arrays.
void copy_back(const std::vector<Buf>& bufs) {
  for (const Buf& b : bufs)
    if (b.host) std::memcpy(b.host, b.g.ptr, b.bytes);
}

}  // namespace

extern "C" {

// The scan direction of the next emu_run calls (ScanArgs::reverse).
bool g_reverse = false;
// Whether the next emu_run / emu_conv calls add into their output (the scan's forward out, the conv's backward dx)
// instead of overwriting it (ScanArgs::accumulate, ConvArgs::accumulate): it then starts as the caller's array.
bool g_accumulate = false;

void emu_config(int order_mode, unsigned seed, int guard_front) {
#if defined(__HIP_PLATFORM_AMD__)
  emu::config().warp = __AMDGCN_WAVEFRONT_SIZE;  // wavefronts of 64 lanes, as on CDNA (MI210/MI250/MI300)
#endif
  emu::config().order_mode = order_mode;
  emu::config().seed = seed;
  emu::config().guard_front = guard_front;
  emu::sched().smem_slot = &ssk::ss_smem_raw;
}

void emu_set_reverse(int reverse) { g_reverse = reverse != 0; }
void emu_set_accumulate(int accumulate) { g_accumulate = accumulate != 0; }
int emu_warp_size() { return emu::config().warp; }

long long emu_num_checkpoints(long long L, long long N, int dtype) {
  return vim_ds_scan::scan_num_checkpoints(L, N, ScanDType(dtype));
}
long long emu_chunk_length(long long N, int dtype) { return vim_ds_scan::scan_chunk_length(N, ScanDType(dtype)); }
long long emu_sync_points() { return emu::sched().sync_points; }
// The launcher's tuning caps (ScanTuning; 0: its own choice); returns nullptr or the launcher's message.
const char* emu_set_tuning(long long chunk, long long tiles, long long target_blocks, long long partials) {
  vim_ds_scan::ScanTuning t;
  t.chunk = chunk;
  t.tiles = tiles;
  t.target_blocks = target_blocks;
  t.partials = partials;
  return vim_ds_scan::scan_set_tuning(t);
}
// What the launcher picks (scan_layout): out[0..5] = chunk, tiles, channels per block, blocks per batch, segments,
// partials (1: per-block partial sums of dB, dC).
void emu_layout(long long batch, long long dim, long long L, long long N, int dtype, int backward, long long* out) {
  const vim_ds_scan::ScanLayout l =
      vim_ds_scan::scan_layout(vim_ds_scan::scan_args(batch, dim, L, N, ScanDType(dtype)), backward != 0);
  const long long v[] = {l.chunk, l.tiles, l.channels_per_block, l.blocks_per_batch, l.n_seg, l.partials};
  for (int i = 0; i < 6; ++i) out[i] = v[i];
}
// Segments along the sequence the launcher picks for these shapes (1: no sequence parallelism).
long long emu_num_segments(long long batch, long long dim, long long L, long long N, int dtype) {
  const ScanArgs a = vim_ds_scan::scan_args(batch, dim, L, N, ScanDType(dtype));
  const int64_t fwd_ws = vim_ds_scan::scan_workspace_bytes(a, false);
  // the forward's workspace is 2 * batch * dim * n_seg * N accumulation values when n_seg > 1, else empty
  return fwd_ws == 0 ? 1 : fwd_ws / (2 * batch * dim * N * (a.dtype == ScanDType::kFloat64 ? 8 : 4));
}

// Pointers are host arrays of exactly the documented sizes; null for absent optionals (and for last_state when
// the forward is not asked for it; h0, dlast: zero; dh0: not asked for). Outputs are pre-filled
// with 0xff bytes (NaN): the kernels must write every element (the gradients' sums included).
// backward: 0 the forward, 1 the backward, 2 scan_h0_grad (reads u, delta, A, B, C, z, bias, dout; writes dh0).
// Returns nullptr or the launcher's error.
const char* emu_run(int backward, int dtype_i, long long batch, long long dim, long long L, long long N,
                    int softplus, const void* u, const void* delta, const void* A, const void* B, const void* C,
                    const void* D, const void* z, const void* bias, void* out, void* saved, const void* dout,
                    void* du, void* ddelta, void* dz, void* dA, void* dB, void* dC, void* dD, void* dbias,
                    void* last_state, const void* h0, const void* dlast, void* dh0) {
  emu::sched().smem_slot = &ssk::ss_smem_raw;
  EMU_COUNT_HOOK(emu::count_clear_globals());
  const ScanDType dt = ScanDType(dtype_i);
  const size_t is = in_size(dt), as = acc_size(dt);
  const size_t x = size_t(batch * dim * L), bc = size_t(batch * N * L);
  const size_t nck = size_t(vim_ds_scan::scan_num_checkpoints(L, N, dt));
  const size_t sv = size_t(batch * dim) * nck * size_t(N);
  std::vector<Buf> bufs;
  bufs.reserve(32);
  ScanArgs a = vim_ds_scan::scan_args(batch, dim, L, N, dt, softplus != 0, g_reverse);
  a.accumulate = g_accumulate;  // (the backward does not add: its outputs start as NaN either way)
  const int added = g_accumulate ? -1 : 0xff;  // the forward's out, added into, starts as the caller's array
  a.u = put(bufs, u, x * is, false, -1);
  a.delta = put(bufs, delta, x * is, false, -1);
  a.A = put(bufs, A, size_t(dim * N) * as, false, -1);
  a.B = put(bufs, B, bc * is, false, -1);
  a.C = put(bufs, C, bc * is, false, -1);
  a.D = put(bufs, D, size_t(dim) * as, false, -1);
  a.z = put(bufs, z, x * is, false, -1);
  a.delta_bias = put(bufs, bias, size_t(dim) * as, false, -1);
  const size_t state_bytes = size_t(batch * dim * N) * as;
  a.h0 = put(bufs, h0, state_bytes, false, -1);
  if (backward == 2) {  // the initial state's gradient alone: dh0 (then the decay product) in the workspace
    a.dout = put(bufs, dout, x * is, false, -1);
    emu::Guarded result(2 * state_bytes);
    std::memset(result.ptr, 0xff, 2 * state_bytes);
    EMU_COUNT_HOOK(emu::count_global(result.ptr, 2 * state_bytes));
    a.workspace = size_t(vim_ds_scan::scan_h0_grad_workspace_bytes(a)) == 2 * state_bytes ? result.ptr : nullptr;
    const char* err = vim_ds_scan::scan_h0_grad(a, nullptr);
    std::memcpy(dh0, result.ptr, state_bytes);
    return err;
  }
  if (!backward) {
    a.out = put(bufs, out, x * is, true, added);
    a.saved = sv ? put(bufs, saved, sv * as, true, 0xff) : nullptr;
    a.last_state = put(bufs, last_state, state_bytes, true, 0xff);  // null: not asked for
  } else {
    a.saved = sv ? put(bufs, saved, sv * as, false, -1) : nullptr;
    a.dout = put(bufs, dout, x * is, false, -1);
    a.du = put(bufs, du, x * is, true, 0xff);
    a.ddelta = put(bufs, ddelta, x * is, true, 0xff);
    a.dz = put(bufs, dz, x * is, true, 0xff);
    a.dA = put(bufs, dA, size_t(dim * N) * as, true, 0xff);
    a.dB = put(bufs, dB, bc * as, true, 0xff);
    a.dC = put(bufs, dC, bc * as, true, 0xff);
    a.dD = put(bufs, dD, size_t(dim) * as, true, 0xff);
    a.ddelta_bias = put(bufs, dbias, size_t(dim) * as, true, 0xff);
    a.dlast = put(bufs, dlast, state_bytes, false, -1);
    a.dh0 = put(bufs, dh0, state_bytes, true, 0xff);
  }
  emu::Guarded ws;
  a.workspace = scratch(ws, size_t(vim_ds_scan::scan_workspace_bytes(a, backward != 0)));
  const char* err = backward ? vim_ds_scan::scan_bwd(a, nullptr) : vim_ds_scan::scan_fwd(a, nullptr);
  copy_back(bufs);
  return err;
}

// The depthwise causal conv1d (causal_conv1d_cuda.h): backward 0 the forward (writes out), 1 the backward (writes
// dx, dw, dbias); silu 1: the SiLU fused (ConvArgs::silu). x has x_batch_stride elements between batch rows;
// bias/dbias may be null. Outputs start as NaN bytes (dx as the caller's under emu_set_accumulate), the workspace
// too. Returns nullptr or the launcher's error.
const char* emu_conv(int backward, int dtype_i, long long batch, long long dim, long long L, long long K,
                     int reverse, int silu, long long x_batch_stride, const void* x, const void* w, const void* bias,
                     const void* dout, void* out, void* dx, void* dw, void* dbias) {
  EMU_COUNT_HOOK(emu::count_clear_globals());
  const ScanDType dt = ScanDType(dtype_i);
  const size_t is = in_size(dt), as = acc_size(dt);
  const size_t rows = size_t(batch * dim * L);
  const size_t x_elems = batch > 0 ? size_t((batch - 1) * x_batch_stride + dim * L) : 0;
  std::vector<Buf> bufs;
  bufs.reserve(8);
  vim_ds_scan::ConvArgs a = vim_ds_scan::conv_args(batch, dim, L, K, x_batch_stride, dt, reverse != 0);
  a.silu = silu != 0;
  a.accumulate = g_accumulate;
  a.x = put(bufs, x, x_elems * is, false, -1);
  a.w = put(bufs, w, size_t(dim * K) * as, false, -1);
  a.bias = put(bufs, bias, size_t(dim) * as, false, -1);
  if (!backward) {
    a.out = put(bufs, out, rows * is, true, 0xff);
  } else {
    a.dout = put(bufs, dout, rows * is, false, -1);
    a.dx = put(bufs, dx, rows * is, true, g_accumulate ? -1 : 0xff);
    a.dw = put(bufs, dw, size_t(dim * K) * as, true, 0xff);
    a.dbias = put(bufs, dbias, size_t(dim) * as, true, 0xff);
  }
  emu::Guarded ws;
  a.workspace = scratch(ws, backward ? size_t(vim_ds_scan::conv_workspace_bytes(a)) : 0);
  const char* err = backward ? vim_ds_scan::conv_bwd(a, nullptr) : vim_ds_scan::conv_fwd(a, nullptr);
  copy_back(bufs);
  return err;
}

}  // extern "C"
