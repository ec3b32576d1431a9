// Launchers of the Mamba branch's GPU kernels: plain C++ entry points (declared in selective_scan_cuda.h for the
// selective scan, causal_conv1d_cuda.h for the depthwise causal conv1d) that pick the work layout, the template
// instance and the launch configuration. No torch headers here (see the headers). One translation unit, so that
// the compile check (tools/compile_check.sh) and the kernel emulator (tools/kernel_emu) see every kernel.
#include "causal_conv1d_cuda.h"
#include "causal_conv1d_kernel.cuh"
#include "selective_scan_cuda.h"
#include "selective_scan_kernel.cuh"

#include <stdint.h>

namespace vim_ds_scan {
namespace {

using ssk::KernelParams;

// Work layout for one d_state (see the comment at the top of selective_scan_kernel.cuh).
struct Layout {
  int group;  // lanes per channel: next power of two >= d_state, at least ssk::kMinGroup, at most ssk::kSeg
  int npl;    // states per lane, rounded up to a power of two (the template parameter kNPL)
  int chunk;  // time steps per chunk
};

int acc_size(ScanDType dtype) { return dtype == ScanDType::kFloat64 ? 8 : 4; }

// Blocks that keep a large GPU busy (an H100 has 132 SMs, an MI250X GCD 110 CUs; several blocks fit on each).
constexpr int64_t kTargetBlocks = 1024;

// The caps of scan_set_tuning (0: the launcher's choice).
ScanTuning g_tuning;

int64_t target_blocks() { return g_tuning.target_blocks > 0 ? g_tuning.target_blocks : kTargetBlocks; }

// Shortest segment along the sequence, in chunks.
constexpr int64_t kMinSegChunks = 2;

Layout make_layout(int64_t dstate, ScanDType dtype) {
  Layout lay;
  lay.group = ssk::kMinGroup;
  while (lay.group < dstate && lay.group < ssk::kSeg) lay.group *= 2;
  const int64_t need = (dstate + lay.group - 1) / lay.group;  // 1 .. 8 for dstate <= 256
  lay.npl = 1;
  while (lay.npl < need) lay.npl *= 2;
  // The backward needs the most shared memory (it grows with the chunk); take the longest power-of-two chunk
  // that fits the budget. Forward and backward must agree on it, since it fixes where states are stored.
  lay.chunk = g_tuning.chunk > 0 ? int(g_tuning.chunk) : ssk::kMaxChunk;
  while (lay.chunk > 1 &&
         ssk::bwd_smem_elems(lay.chunk, int(dstate), lay.group, lay.npl) * acc_size(dtype) > ssk::kSmemBudget) {
    lay.chunk /= 2;
  }
  return lay;
}

const char* check_args(const ScanArgs& a) {
  if (a.dstate < 1 || a.dstate > kScanMaxDState) return "selective_scan: d_state must be in [1, 256]";
  if (a.seqlen < 1) return "selective_scan: seqlen must be >= 1";
  if (a.batch < 0 || a.dim < 0) return "selective_scan: negative batch or dim";
  const int64_t kIntMax = 2147483647;
  if (a.batch > kIntMax || a.dim > kIntMax || a.seqlen > kIntMax) return "selective_scan: size too large";
  // The kernels address a block's rows with 32-bit offsets (row * seqlen + time, row < ssk::kMaxRows).
  if (a.seqlen > kIntMax / ssk::kMaxRows) return "selective_scan: seqlen too large (at most 8,388,607)";
  return nullptr;
}

// Channel tiles per backward block (see "Channel tiles" in the kernel header): the most the instance has
// (ssk::bwd_tiles) when the sequence is split into segments anyway, else the most that keep kTargetBlocks blocks
// with one segment. Splitting costs the backward its pass 0 over part of the inputs (their bytes and the
// exponentials again) and a combine launch; a tile fewer costs re-reads of B and C (L2 traffic) and one more block
// in each chain of dB/dC sums (with partial sums instead of a chain, their bytes: at B 64, D 384, L 197, N 16 in
// fp32 about those of the split), so no split.
int backward_tiles(const ScanArgs& a, const Layout& lay) {
  const int64_t cpb = ssk::kThreads / lay.group;
  int tiles = ssk::bwd_tiles(lay.npl, acc_size(a.dtype), lay.group);
  if (g_tuning.tiles > 0 && g_tuning.tiles < tiles) tiles = int(g_tuning.tiles);
  const auto blocks = [&](int t) { return a.batch * ((a.dim + cpb * t - 1) / (cpb * t)); };
  if (blocks(1) < target_blocks()) return tiles;
  while (tiles > 1 && blocks(tiles) < target_blocks()) tiles /= 2;
  return tiles;
}

// The parameters of the forward's or the backward's launches (the backward's blocks walk several channel tiles).
KernelParams make_params(const ScanArgs& a, const Layout& lay, bool backward) {
  KernelParams p;
  p.batch = int(a.batch);
  p.dim = int(a.dim);
  p.seqlen = int(a.seqlen);
  p.dstate = int(a.dstate);
  p.group = lay.group;
  p.chunk = lay.chunk;
  p.chunk_log2 = 0;
  while ((1 << p.chunk_log2) < p.chunk) ++p.chunk_log2;
  p.n_chunks = int((a.seqlen + lay.chunk - 1) / lay.chunk);
  const int cpb = ssk::kThreads / lay.group;
  p.tiles = backward ? backward_tiles(a, lay) : 1;
  p.blocks_per_batch = int((a.dim + cpb * p.tiles - 1) / (cpb * p.tiles));
  // Segments along the sequence: enough blocks to fill the GPU when batch x channels alone do not, each segment
  // at least kMinSegChunks chunks (a segment costs a second pass over its inputs). Batch 1, D 384, N 16, L 4097:
  // forward 48 blocks x 22 segments of 6 chunks (backward 12 x 65 of 2); B 64, D 384, L 197: 3072 blocks
  // forward, 1536 of 2 tiles backward, one segment.
  const int64_t base_blocks = a.batch * p.blocks_per_batch;
  int64_t seg_chunks = p.n_chunks;
  if (base_blocks < target_blocks()) {
    const int64_t want = (target_blocks() + base_blocks - 1) / base_blocks;
    seg_chunks = (p.n_chunks + want - 1) / want;
    if (seg_chunks < kMinSegChunks) seg_chunks = kMinSegChunks;
    if (seg_chunks > p.n_chunks) seg_chunks = p.n_chunks;
  }
  p.seg_chunks = int(seg_chunks);
  p.n_seg = int((p.n_chunks + seg_chunks - 1) / seg_chunks);
  p.pass = 1;
  // several blocks of channels a batch row sum dB, dC in place, in turn, unless tuned to write partial sums (or the
  // instance has no chain: ssk::bwd_chains)
  p.chain = backward && p.blocks_per_batch > 1 && g_tuning.partials == 0 &&
            ssk::bwd_chains(lay.npl, acc_size(a.dtype));
  p.softplus = a.delta_softplus;
  p.reverse = a.reverse;
  p.accumulate = a.accumulate;
  p.u = a.u;
  p.delta = a.delta;
  p.A = a.A;
  p.B = a.B;
  p.C = a.C;
  p.D = a.D;
  p.z = a.z;
  p.delta_bias = a.delta_bias;
  p.out = a.out;
  p.saved = a.saved;
  p.last_state = a.last_state;
  p.h0 = a.h0;
  p.dlast = a.dlast;
  p.dh0 = a.dh0;
  p.dout = a.dout;
  p.du = a.du;
  p.ddelta = a.ddelta;
  p.dz = a.dz;
  p.dA = a.dA;
  p.dB = a.dB;
  p.dC = a.dC;
  p.dD = a.dD;
  p.ddelta_bias = a.ddelta_bias;
  p.ws = a.workspace;
  // the chain's flags and ticket counter, where ws_layout puts them
  p.flags = p.chain && a.workspace != nullptr
                ? reinterpret_cast<unsigned*>(static_cast<char*>(a.workspace) +
                                              ssk::ws_layout(p).flags * acc_size(a.dtype))
                : nullptr;
  return p;
}

const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// One launch of the scan kernel (pass 0 or 1 of the forward or backward), over every (batch, channel block,
// segment).
template <typename input_t, int kNPL, int kG>
const char* launch_scan(const KernelParams& p, bool backward, int acc_bytes, cudaStream_t stream) {
  const int64_t blocks = int64_t(p.batch) * p.blocks_per_batch * p.n_seg;
  if (blocks > 2147483647) return "selective_scan: too many blocks";
  const dim3 grid(static_cast<unsigned int>(blocks));
  const dim3 block(ssk::kThreads);
  if (backward) {
    const size_t smem = size_t(ssk::bwd_smem_elems(p.chunk, p.dstate, p.group, kNPL)) * acc_bytes;
    ssk::scan_bwd_kernel<input_t, kNPL, kG><<<grid, block, smem, stream>>>(p);
  } else {
    const size_t smem = size_t(ssk::fwd_smem_elems(p.chunk, p.dstate, p.group)) * acc_bytes;
    ssk::scan_fwd_kernel<input_t, kNPL, kG><<<grid, block, smem, stream>>>(p);
  }
  return last_error();
}

// The combine (reduce = false) or the ordered reduction of the backward's partials (reduce = true).
template <typename acc_t>
const char* launch_aux(const KernelParams& p, bool reduce, cudaStream_t stream) {
  const int64_t elems = reduce ? ssk::reduce_elems(p) : int64_t(p.batch) * p.dim * p.dstate;
  const int64_t blocks = (elems + ssk::kThreads - 1) / ssk::kThreads;
  if (blocks > 2147483647) return "selective_scan: too many blocks";
  if (blocks == 0) return nullptr;
  const dim3 grid(static_cast<unsigned int>(blocks));
  const dim3 block(ssk::kThreads);
  if (reduce) {
    ssk::scan_reduce_kernel<acc_t><<<grid, block, 0, stream>>>(p);
  } else {
    ssk::scan_combine_kernel<acc_t><<<grid, block, 0, stream>>>(p);
  }
  return last_error();
}

enum class Kind { kForward, kBackward, kH0Grad };

// Forward: [pass 0, combine,] pass 1. Backward: [pass 0, combine,] pass 1, reduce. (Bracketed: n_seg > 1 only.)
// The initial state's gradient alone: the backward's pass 0 over one segment (p1 says so, see run).
template <typename input_t, int kNPL, int kG>
const char* launch(const KernelParams& p1, Kind kind, int acc_bytes, cudaStream_t stream) {
  using acc_t = typename ssk::AccType<input_t>::type;
  if (kind == Kind::kH0Grad) return launch_scan<input_t, kNPL, kG>(p1, true, acc_bytes, stream);
  const bool backward = kind == Kind::kBackward;
  const char* err = nullptr;
  if (p1.n_seg > 1) {
    KernelParams p0 = p1;
    p0.pass = 0;
    if ((err = launch_scan<input_t, kNPL, kG>(p0, backward, acc_bytes, stream))) return err;
    p0.pass = backward ? 1 : 0;
    if ((err = launch_aux<acc_t>(p0, false, stream))) return err;
  }
  if (p1.chain) {  // the chain's flags and ticket counter start at zero
    const size_t bytes = size_t(ssk::chain_flag_count(p1)) * acc_bytes;
    if (cudaMemsetAsync(p1.flags, 0, bytes, stream) != cudaSuccess) return last_error();
  }
  if ((err = launch_scan<input_t, kNPL, kG>(p1, backward, acc_bytes, stream))) return err;
  if (backward) err = launch_aux<acc_t>(p1, true, stream);
  return err;
}

// The instance for the layout: with one state a lane, one per group size (the group a template constant, see
// group_size in the kernel header); with more, the group is kSeg lanes and the instance is per states a lane.
template <typename input_t>
const char* dispatch_npl(const KernelParams& p, int npl, Kind kind, int acc_bytes, cudaStream_t stream) {
  static_assert(ssk::kMinGroup == 8 && ssk::kSeg == 32, "one instance per group size 8, 16, 32");
  switch (npl) {
    case 1:
      switch (p.group) {
        case 8: return launch<input_t, 1, 8>(p, kind, acc_bytes, stream);
        case 16: return launch<input_t, 1, 16>(p, kind, acc_bytes, stream);
        case 32: return launch<input_t, 1, 32>(p, kind, acc_bytes, stream);
        default: return "selective_scan: unsupported d_state";
      }
    case 2: return launch<input_t, 2, 0>(p, kind, acc_bytes, stream);
    case 4: return launch<input_t, 4, 0>(p, kind, acc_bytes, stream);
    case 8: return launch<input_t, 8, 0>(p, kind, acc_bytes, stream);
    default: return "selective_scan: unsupported d_state";
  }
}

// The parameters of scan_h0_grad's launch: the backward's pass 0 over the whole sequence as one segment, so that
// the carry it stores for segment 0 (seg_v, [BD][1][N] at the workspace's start) is dh0, and seg_P after it the
// sequence's decay product. One segment leaves (batch x channel blocks) blocks, each walking the whole sequence:
// the pass reads delta, C, z and dout once and does per step what the forward does, no state recomputation.
KernelParams h0_grad_params(const ScanArgs& a, const Layout& lay) {
  KernelParams p = make_params(a, lay, true);
  p.seg_chunks = p.n_chunks;
  p.n_seg = 1;
  p.pass = 0;
  p.chain = false;
  p.dlast = nullptr;
  return p;
}

const char* run(const ScanArgs& a, void* stream_ptr, Kind kind) {
  if (const char* err = check_args(a)) return err;
  if (a.batch == 0 || a.dim == 0) return nullptr;  // nothing to do (a grid of 0 blocks is invalid)
  const Layout lay = make_layout(a.dstate, a.dtype);
  const KernelParams p =
      kind == Kind::kH0Grad ? h0_grad_params(a, lay) : make_params(a, lay, kind == Kind::kBackward);
  const int acc_bytes = acc_size(a.dtype);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (a.dtype) {
    case ScanDType::kFloat32: return dispatch_npl<float>(p, lay.npl, kind, acc_bytes, stream);
    case ScanDType::kFloat64: return dispatch_npl<double>(p, lay.npl, kind, acc_bytes, stream);
    case ScanDType::kFloat16: return dispatch_npl<ssk::half_t>(p, lay.npl, kind, acc_bytes, stream);
    case ScanDType::kBFloat16: return dispatch_npl<ssk::bf16_t>(p, lay.npl, kind, acc_bytes, stream);
  }
  return "selective_scan: unsupported dtype";
}

}  // namespace

int64_t scan_chunk_length(int64_t dstate, ScanDType dtype) {
  if (dstate < 1 || dstate > kScanMaxDState) return 0;
  return make_layout(dstate, dtype).chunk;
}

int64_t scan_workspace_bytes(const ScanArgs& a, bool backward) {
  if (check_args(a) != nullptr || a.batch == 0 || a.dim == 0) return 0;
  const KernelParams p = make_params(a, make_layout(a.dstate, a.dtype), backward);
  const ssk::WsLayout w = ssk::ws_layout(p);
  return (backward ? w.bwd_total : w.fwd_total) * acc_size(a.dtype);
}

int64_t scan_num_checkpoints(int64_t seqlen, int64_t dstate, ScanDType dtype) {
  const int64_t chunk = scan_chunk_length(dstate, dtype);
  if (chunk <= 0 || seqlen < 1) return 0;
  return (seqlen + chunk - 1) / chunk;
}

int64_t scan_h0_grad_workspace_bytes(const ScanArgs& a) {
  if (check_args(a) != nullptr || a.batch == 0 || a.dim == 0) return 0;
  return 2 * a.batch * a.dim * a.dstate * acc_size(a.dtype);
}

const char* scan_set_tuning(const ScanTuning& t) {
  if (t.chunk < 0 || t.chunk > ssk::kMaxChunk || (t.chunk & (t.chunk - 1)) != 0)
    return "selective_scan: the chunk cap must be 0 (the launcher's) or a power of two up to 64";
  if (t.tiles < 0 || t.tiles > ssk::kMaxTiles) return "selective_scan: the tile cap must be 0 (the launcher's) to 4";
  if (t.target_blocks < 0 || t.target_blocks > 2147483647)
    return "selective_scan: the target block count must be 0 (the launcher's) or positive";
  if (t.partials != 0 && t.partials != 1) return "selective_scan: partials must be 0 (the launcher's chain) or 1";
  g_tuning = t;
  return nullptr;
}

ScanTuning scan_tuning() { return g_tuning; }

ScanLayout scan_layout(const ScanArgs& a, bool backward) {
  ScanLayout r;
  if (check_args(a) != nullptr || a.batch == 0 || a.dim == 0) return r;
  const Layout lay = make_layout(a.dstate, a.dtype);
  const KernelParams p = make_params(a, lay, backward);
  r.chunk = p.chunk;
  r.tiles = p.tiles;
  r.channels_per_block = int64_t(ssk::kThreads / lay.group) * p.tiles;
  r.blocks_per_batch = p.blocks_per_batch;
  r.n_seg = p.n_seg;
  r.partials = ssk::writes_partials(p);
  return r;
}

const char* scan_fwd(const ScanArgs& args, void* stream) { return run(args, stream, Kind::kForward); }

const char* scan_bwd(const ScanArgs& args, void* stream) { return run(args, stream, Kind::kBackward); }

const char* scan_h0_grad(const ScanArgs& args, void* stream) { return run(args, stream, Kind::kH0Grad); }

// ------------------------------------------------------------------ depthwise causal conv1d ----------------

namespace {

const char* check_conv(const ConvArgs& a) {
  if (a.width < 1 || a.width > kConvMaxWidth) return "causal_conv1d: width must be in [1, 8]";
  if (a.batch < 0 || a.dim < 0 || a.seqlen < 0) return "causal_conv1d: negative size";
  const int64_t kIntMax = 2147483647;
  if (a.batch > kIntMax || a.dim > kIntMax || a.seqlen > kIntMax) return "causal_conv1d: size too large";
  return nullptr;
}

// Tiles of about equal length (a multiple of 32 steps, at most kMaxConvTile): 785 steps -> 2 tiles of 416.
ssk::ConvParams conv_params(const ConvArgs& a) {
  ssk::ConvParams p;
  p.batch = int(a.batch);
  p.dim = int(a.dim);
  p.seqlen = int(a.seqlen);
  p.width = int(a.width);
  p.n_tiles = int((a.seqlen + ssk::kMaxConvTile - 1) / ssk::kMaxConvTile);
  const int64_t per_tile = (a.seqlen + p.n_tiles - 1) / p.n_tiles;
  p.tile = int((per_tile + 31) / 32 * 32);
  p.reverse = a.reverse;
  p.silu = a.silu;
  p.accumulate = a.accumulate;
  p.x_batch_stride = a.x_batch_stride;
  p.x = a.x;
  p.w = a.w;
  p.bias = a.bias;
  p.dout = a.dout;
  p.out = a.out;
  p.dx = a.dx;
  p.dw = a.dw;
  p.dbias = a.dbias;
  p.ws = a.workspace;
  return p;
}

template <typename input_t>
const char* launch_conv(const ssk::ConvParams& p, bool backward, cudaStream_t stream) {
  using acc_t = typename ssk::AccType<input_t>::type;
  const int64_t blocks = int64_t(p.batch) * p.dim * p.n_tiles;
  if (blocks > 2147483647) return "causal_conv1d: too many blocks";
  const dim3 grid(static_cast<unsigned int>(blocks)), block(ssk::kThreads);
  const size_t smem = size_t(ssk::conv_smem_elems(p, backward)) * sizeof(acc_t);
  if (!backward) {
    ssk::conv_fwd_kernel<input_t><<<grid, block, smem, stream>>>(p);
    return last_error();
  }
  ssk::conv_bwd_kernel<input_t><<<grid, block, smem, stream>>>(p);
  if (const char* err = last_error()) return err;
  const int64_t terms = int64_t(p.dim) * (p.width + 1);
  const dim3 reduce_grid(static_cast<unsigned int>((terms + ssk::kThreads - 1) / ssk::kThreads));
  ssk::conv_reduce_kernel<acc_t><<<reduce_grid, block, 0, stream>>>(p);
  return last_error();
}

const char* run_conv(const ConvArgs& a, void* stream_ptr, bool backward) {
  if (const char* err = check_conv(a)) return err;
  // Nothing to run; the backward's dw and dbias, sums over nothing, are left as they are (the binding allocates
  // them zeroed).
  if (a.dim == 0 || a.batch == 0 || a.seqlen == 0) return nullptr;
  const ssk::ConvParams p = conv_params(a);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (a.dtype) {
    case ScanDType::kFloat32: return launch_conv<float>(p, backward, stream);
    case ScanDType::kFloat64: return launch_conv<double>(p, backward, stream);
    case ScanDType::kFloat16: return launch_conv<ssk::half_t>(p, backward, stream);
    case ScanDType::kBFloat16: return launch_conv<ssk::bf16_t>(p, backward, stream);
  }
  return "causal_conv1d: unsupported dtype";
}

}  // namespace

int64_t conv_workspace_bytes(const ConvArgs& a) {
  if (check_conv(a) != nullptr || a.batch == 0 || a.dim == 0 || a.seqlen == 0) return 0;
  const ssk::ConvParams p = conv_params(a);
  return int64_t(p.dim) * p.batch * p.n_tiles * (p.width + 1) * acc_size(a.dtype);
}

const char* conv_fwd(const ConvArgs& args, void* stream) { return run_conv(args, stream, false); }

const char* conv_bwd(const ConvArgs& args, void* stream) { return run_conv(args, stream, true); }

}  // namespace vim_ds_scan
