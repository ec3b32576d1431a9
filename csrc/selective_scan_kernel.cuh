// Device code of the selective scan (Mamba's SSM scan), forward and backward.
//
// One source for NVIDIA (nvcc) and AMD (hipcc, after PyTorch's hipify). No torch, cub, hipcub or thrust headers:
// only the vendor runtime and its fp16/bf16 headers, behind the small compat layer below.
//
// The operation (see csrc/README.md), for batch b, channel d, state n, time t:
//   dl[b,d,t]  = softplus(delta[b,d,t] + delta_bias[d])          (bias and softplus optional)
//   h[b,d,n,t] = exp(dl*A[d,n]) * h[b,d,n,t-1] + dl * B[b,n,t] * u[b,d,t]      (h[-1] = h0, or 0)
//   y[b,d,t]   = sum_n h[b,d,n,t] * C[b,n,t] + D[d] * u[b,d,t]
//   out[b,d,t] = y * silu(z[b,d,t])                               (gate optional)
//
// ---------------------------------------------------------------------------------------------------------
// Work mapping (both kernels)
//   * A block (kThreads threads) owns one batch element b, `cpb` consecutive channels d0 .. d0+cpb-1 (in the
//     backward several such tiles, see "Channel tiles") and one segment of the sequence (see "Sequence
//     parallelism"; one segment = the whole sequence).
//   * Each channel is owned by a "group" of G consecutive lanes, G = next power of two >= d_state, at least
//     kMinGroup = 8 and at most kSeg = 32. Lane g of a group holds the states n = g, g+G, g+2G, ... (kNPL
//     "states per lane", a template parameter, 1/2/4/8 so that d_state up to 256 fits). cpb = kThreads / G.
//     With one state a lane G is a template parameter too (kG, one instance per group size: group_size).
//   * Every thread runs the recurrence of its states sequentially over time. Sums over n (y, and in the
//     backward the gradients of u and delta) are xor-shuffle reductions inside the group, several at once
//     (scatter_sum: the forward's y of 8 steps, the backward's three sums of 2 steps).
//   * All shuffles use xor offsets < 32, so they never leave an aligned 32-lane segment: the same code is
//     correct for 32-wide NVIDIA warps and for 64-wide AMD wavefronts (a wavefront is simply two segments),
//     and even for wave32 AMD GPUs. The block size is a multiple of 64 so every warp/wavefront is full.
//   * Time is processed in chunks of T steps (T = "chunk length", <= 64, chosen by the host so that the
//     backward's shared memory stays under kSmemBudget: 48 KiB on NVIDIA, 32 KiB on AMD). Per chunk the block
//     first stages the chunk's inputs in shared memory with coalesced loads (converted to the accumulation
//     type; each thread issues a round of items' loads before it uses them, see StageRound), then every thread
//     steps through the chunk reading only shared memory.
//
// Channel tiles (backward). A backward block owns `tiles` (KernelParams::tiles, bwd_tiles(): up to kMaxTiles = 4
//   when a lane holds one state of a float accumulation) tiles of cpb channels, d0 .. d0 + tiles*cpb - 1, and
//   walks them in turn within each chunk: B and C are staged once per chunk, each tile's channels are staged,
//   recomputed and stepped back through with the same threads, and the tiles' dB, dC add up in shared memory
//   before one store per chunk. Its dB/dC partial sums (see Determinism) and its reads of B and C are per block,
//   so tiles divide them by the number of tiles. Each tile's carry, running sums and A stay in registers
//   across chunks (BwdState: one set per tile, rotated so that the loops only touch set 0). The forward keeps one
//   tile (its traffic is near the minimum, tests/test_kernel_counts.py). The launcher takes fewer tiles when
//   that keeps the sequence in one segment (backward_tiles).
//
// Sequence parallelism (a two-level chunked scan). h_t = a_t h_{t-1} + b_t is associative on (a, b) pairs, so
//   the chunks are grouped into n_seg segments of seg_chunks chunks, each run by its own block:
//     pass 0   every segment but the last runs from a zero state, storing its end state and the product P of
//              its decays a_t = exp(dl_t A) in the workspace (no outputs, no shuffles);
//     combine  one thread per (b, d, n) walks the segments in order, H_{s+1} = P_s H_s + h_s, and stores H_{s+1}
//              as the checkpoint before segment s+1's first chunk (segments start on chunk boundaries);
//     pass 1   every segment runs from its true start state (that checkpoint) and writes out and the
//              checkpoints inside it.
//   The backward does the same back to front on the adjoint recurrence (dh_t = C_t dy_t + a_{t+1} dh_{t+1}):
//   pass 0 gives each segment's outgoing carry from a zero carry-in and its P, the combine turns them into the
//   carry into each segment, pass 1 is the full backward of the segment from that carry.
//   The host picks n_seg (selective_scan_cuda.cu) so that batch x channel blocks x segments reach ~1024 blocks,
//   with segments of at least 2 chunks: batch 1, D 384, N 16, L 4097 -> 48 x 22 blocks; B 64, D 384, L 197 ->
//   3072 blocks and one segment (then pass 0 and the combine are skipped: the single-pass mapping of before).
//
// Determinism: no float atomics. Every output element is written by one thread at a time, and every sum has a
//   fixed order: over n by the xor-shuffle trees of scatter_sum (and of group_sum: ddelta_bias over the lanes that
//   summed it), dB/dC over the channels of a 32-lane segment by shuffles, then over the block's channel tiles in
//   order and its 32-lane segments in index order (shared memory), then over blocks of channels in index order;
//   dA, dD, ddelta_bias per (b, d, segment) in registers, then scan_reduce_kernel sums batch and segments in order.
//   So the same inputs give the same bits run after run, on any block schedule.
//   dB/dC over blocks of channels (KernelParams::chain, in the instances that have it: bwd_chains): a chain. For
//   each chunk the blocks of a batch row's channels add their sums to dB, dC in turn, block 0 storing its own,
//   block k adding its own to what blocks 0 .. k-1 stored, after a flag per (batch row, chunk) says they have
//   (chain_wait, chain_release; integer atomics only). Its order is the reduction's, so its bits are too; its traffic is dB, dC's, where
//   per-block partial sums were written and read back (fp32, 2 x 2 x N x 4 bytes per channel block and step: at
//   Vim-small-stride-8's shape 310 MB a backward, more than half its minimum in bf16). The blocks of a row run
//   side by side, each a chunk's store behind the one before at most. A block takes its work by ticket
//   (block_ticket), so that it only waits for blocks that have started. Without a chain (the other instances, or
//   tuned so: ScanTuning::partials) the blocks write per-block partials and scan_reduce_kernel adds them in index
//   order (the same bits); when one block holds all channels it stores dB, dC directly.
//
// Reverse mode (KernelParams::reverse, Vim's backward direction): the kernels walk scan steps s = 0, 1, ... as
//   always, and every global-memory index of a time-indexed tensor goes through p.time(s) = L-1-s. Chunks, stored
//   states and the arithmetic are those of the forward direction on flipped inputs, so no flipped copies are made
//   and out, du, ddelta, dz equal the flipped computation bit for bit.
//
// Initial state (KernelParams::h0, optional; the split of one image's tokens over ranks needs it, see
//   vim_ds/models/sequence_parallel.py): segment 0 starts from h0 instead of zero in every pass, so its pass-0 end
//   state already holds h0's share and the combine is unchanged; the forward stores h0 as chunk 0's start state,
//   from which the backward recomputes chunk 0 as any other. Its adjoint: the last segment's carry-in is dlast
//   (the gradient of last_state) instead of zero, again in both passes, and segment 0's carry after its first
//   step, exp(dl_0 A) dh_0, is dh0.
//
// Forward: runs the recurrence; at the start of every chunk it stores the state h into `saved`,
//   (batch, dim, n_chunks, N), so saved[b,d,c,:] is the state at the *start* of chunk c: h0 (or zero) for chunk 0;
//   at segment starts the combine kernel stores it. (Chunk 0's slot costs N values per (b, d), and it spares the
//   backward a second source of start states: read from h0 itself inside the backward's loop, it made ptxas spill
//   in the d_state > 128 instances.) When asked (last_state not null), pass 1 of the last segment, which ends with
//   the last scan step, stores its final h as last_state[b,d,:]: the state after time L-1, or after time 0 in
//   reverse mode (mamba_ssm's last_state; the CPU kernel and selective_scan_ref give the same).
//
// Backward: walks the chunks of its segment from last to first, and in each chunk its channel tiles in turn.
//   For chunk c it stages B, C of the chunk in shared memory, and for each tile
//   1. stages dl2 = dl*log2(e) (see ss_exp2), dl*u, u, dy = dout*silu(z), softplus' and dout*silu'(z) of the
//      tile's channels in shared memory (the first four in one 16-byte row a step and channel, as B and C and the
//      dB, dC sums are pairs: one address and one load a step for each, see smem_load);
//   2. recomputes the chunk's states from the stored state at its start (saved[b,d,c,:]), keeping every
//      h_t of the chunk (and the start state) in a per-thread history in shared memory;
//   3. runs the reverse recurrence t = end .. start, with dh_t = C_t*dy_t + exp(dl_{t+1}A)*dh_{t+1} (the
//      second term is carried in registers, also across chunks):
//         du_t     = dl * sum_n dh*B + D*dy          ddl_t = sum_n A*g + u * sum_n dh*B
//         dA[n]   += dl*g                            dB_t[n] += dh*dl*u     dC_t[n] += h_t*dy
//      with g = exp(dl*A)*dh*h_{t-1} (the next step's carry times h_{t-1}): the factors the terms share taken out
//      of the sums over n (dA summed as dA / ln 2, sum dl2*g);
//         dz_t     = y_t * dout*silu'(z)             (y_t recomputed from the history)
//         ddelta_t = ddl_t * softplus'(delta+bias)   dD += dy*u      ddelta_bias += ddelta_t
//      The three sums over n of two steps go in one scatter sum (scatter_sum), whose lanes leave the totals in
//      shared memory; the lanes holding ddl's add ddelta_t to their part of ddelta_bias.
//   4. finishes the tile's du, ddelta, dz of the chunk from those totals (the D, softplus' and gate terms) and
//      writes them;
//   then the chunk's dB, dC, sums over channels (see Determinism). dA, dD, ddelta_bias are summed over the
//   segment's steps in registers and stored as per-segment partials.
//
// Performance model (what the hardware allows; vim_ds/bench/scan_model.py computes it, `vim-ds bench scan
//   --predict` prints it beside the measured times as measured / bound, tests/test_scan_model.py checks the counts).
//   Per kernel, with BDL = batch*dim*L elements of u, e = bytes per input element (4 fp32, 2 bf16), N = d_state:
//     bytes, at least: every input read once, every output written once, nothing else.
//       fwd  reads u, delta, z, writes out (4 BDL e); reads B, C (2 batch N L e); A, D, delta_bias in fp32.
//       bwd  reads u, delta, z, dout, writes du, ddelta, dz (7 BDL e); reads B, C and writes dB, dC
//            (4 batch N L e); A, D, delta_bias and their gradients in fp32. (It recomputes the states.)
//     exp (special-function ops): 1 exp(dl*A) per (b, d, t, n) in each kernel; per (b, d, t) 4 in fwd (softplus:
//       exp, log; silu: exp, rcp) and 5 in bwd (the same plus softplus' = e / (1 + e)).
//     FMA-pipe ops (mul, add or FMA, one each): per (b, d, t, n) 4 in fwd (dl*A, (dl*u)*B, h = a*h + b,
//       y += h*C) and 13 in bwd (those 4 again to recompute h and y; C*dy, dh = a*dh' + C*dy, dC += h*dy,
//       dB += dh*dl*u, s_B += dh*B, g = dh*a, g*h_prev, dA += g*h_prev*dl, s_A += g*h_prev*A);
//       per (b, d, t) 6 in fwd and 21 in bwd (bias, gate, D and their derivatives).
//   Lower bound = max(bytes / HBM bandwidth, FMA / FMA rate, exp / exp rate), the three units working in parallel.
//   Rates (peak, as published): H100 SXM 3.35 TB/s, FP32 67 TFLOPS (NVIDIA H100 datasheet), exp at 1/8 of the
//   FMA rate (16 vs 128 results / clock / SM, CUDA C++ Programming Guide, cc 9.0): 4.19 T/s; MI250X, one GCD:
//   1.64 TB/s, packed FP32 47.9 TFLOPS (half of the AMD MI250X datasheet's 3.28 TB/s and 95.7 TFLOPS), exp at a
//   quarter of the lane rate (110 CUs x 64 x 1.7 GHz / 4): 2.99 T/s; MI300X 5.3 TB/s, FP32 163.4 TFLOPS (AMD
//   MI300X datasheet), exp 304 CUs x 64 x 2.1 GHz / 4 = 10.2 T/s. Bounds, fwd / fwd+bwd in ms:
//     shape (N = 16)          dtype  H100 SXM         MI250X (1 GCD)   MI300X
//     B=64 D=768 L=197        fp32   0.047 / 0.129    0.096 / 0.263    0.030 / 0.081
//                             bf16   0.046 / 0.112    0.065 / 0.157    0.019 / 0.046
//     B=64 D=768 L=785        fp32   0.186 / 0.513    0.381 / 1.048    0.118 / 0.324
//                             bf16   0.184 / 0.448    0.258 / 0.627    0.076 / 0.184
//     B=1  D=384 L=4097       fp32   0.008 / 0.021    0.016 / 0.043    0.005 / 0.013
//                             bf16   0.008 / 0.018    0.011 / 0.026    0.003 / 0.007
//     B=8  D=384 L=6085       fp32   0.091 / 0.251    0.186 / 0.513    0.058 / 0.159
//                             bf16   0.089 / 0.217    0.125 / 0.304    0.037 / 0.089
//   What sets them: fp32 is memory-bound on all three (16 bytes per (b, d, t) forward); in bf16 the bytes halve and
//   the exps take over the forward (N + 4 = 20 special-function ops per (b, d, t) at 1/8 or 1/4 of the FMA rate)
//   and the FMAs the backward (13 N + 21 = 229 per (b, d, t)), so bf16 gains little over fp32 on paper (H100, B=64
//   L=197: 0.112 vs 0.129 ms). This kernel moves more than the minimum: the stored states (`saved`, N floats per
//   chunk of T steps, written forward, read backward; 22 MB at B=64 D=768 L=197), dB and dC in fp32, the
//   per-segment sums of dA, and with segments pass 0 reads its inputs once more. Its backward's per-block-of-channels
//   dB/dC partials (fp32, written and read back by scan_reduce_kernel; batch x ceil(dim / (tiles x 128 / G)) x N x
//   L x 4 bytes each) were 310 MB at that shape with one tile a block, more than the 275 MB (fp32) / 137 MB (bf16)
//   of its minimum, 78 MB with 4 tiles, and none since the chain (in the instances without one they remain). The
//   kernel emulator counts what each launch moves (tools/kernel_emu, scan_counts.py).
//
// Occupancy floor (tools/compile_check.sh fails below it): 12.5%, that is 8 of an SM's 64 warps (two per
//   scheduler: two 128-thread blocks) on NVIDIA, and 4 of a CDNA CU's 32 wavefronts (one per SIMD: two blocks) on
//   AMD. Below it hardware idles by construction: on AMD a SIMD holds no wavefront of the kernel at all, on NVIDIA
//   a scheduler has one warp, which stalls on every exp -> FMA dependency of the recurrence. More is not asked
//   for: the recurrence's latency is also hidden by the kNPL independent states of each lane, and the backward's
//   occupancy is bounded by its shared memory (the per-thread history of chunk+1 states), which only a shorter
//   chunk (more stored states, more barriers) would lower. tools/kernel_report.py computes occupancy from the
//   compilers' register counts and the launcher's shared memory (formulas and sources of the limits there).
//   Measured (nvcc 13.0; gfx90a: hipcc 5.2 / clang 15; gfx942: clang 19.1.7; docs/selective-scan.md has the
//   table): backward 18.75% on sm_80 (3 blocks per SM, shared memory), 25% on sm_90 and sm_100 (4 blocks),
//   12.5% on gfx90a and gfx942 (2 blocks per CU, LDS); forward 25-50% on NVIDIA, 25-100% on AMD.
//   Exempt from the floor: scan_bwd<fp64,npl8> on gfx90a gfx942. For d_state 256 its shared memory at the
//   shortest chunk (one step) is 37,120 bytes, over the 32 KiB that let two blocks share a CU's 64 KiB of LDS:
//   one block (6.25%). float64 is the gradient-checking dtype, not a training one.
//   Spills: none on any target to memory; none of SGPRs into VGPR lanes (AMD) but in the instances named here,
//   and the check fails on either. Exempt from the scalar-register check:
//   scan_bwd<fp64,npl2> scan_bwd<fp64,npl4> scan_bwd<fp64,npl8> scan_bwd<fp16,npl8> on gfx90a gfx942. The scatter
//   sums' slots and the epilogue that finishes du, ddelta and dz (issue 51) cost them 2-14 SGPRs parked in VGPR
//   lanes (v_writelane / v_readlane around the chunk loop, no memory traffic): the float64 backward used 105 of
//   gfx942's 106 before, and it is the gradient-checking dtype; fp16 with d_state > 128 parked 2 on gfx942. Now
//   (2026-11-30, the staging rounds) scan_bwd<fp64,npl8> parks 4 on gfx90a and 10 on gfx942, scan_bwd<fp64,npl4> 2
//   on gfx942 (that morning: 0, 4 and 0); the float64 instances with one state a lane, exempt until their group
//   became a template constant (three instances instead of one), park none.
//
// Registers on AMD. A value the same for the whole wavefront (pointers, sizes, offsets, loop bounds, and the
//   64-bit lane masks of per-lane conditions) lives in scalar registers, of which a wavefront addresses 102
//   (gfx90a, gfx942). The compiler hoists every loop-invariant one out of the chunk and time loops, and the
//   kernels used to hold more than that across them, so it parked 2-173 per instance in VGPR lanes
//   (v_writelane / v_readlane). What held them, largest first, and what replaced it:
//     * per state slot k, the lane masks of "slot k exists" (and of "this lane stores dB/dC for slot k"):
//       two SGPRs per slot and condition, 32 for kNPL = 8. Now each test is `k < v` against a per-lane count
//       passed through vary() (an empty asm statement) at the top of the loop body: one v_cmp there, no mask
//       kept (lane_slots, vary);
//     * 64-bit element offsets (batch * dim * L, ...) and their products, one set per tensor: now one 64-bit
//       base per tensor and block and 32-bit offsets inside it (block_ptr, blk_at; the launcher caps
//       seqlen at 8,388,607 so that they fit);
//     * with kNPL > 1, k * G for each slot: G is the constant kSeg there (group_size);
//     * the shared-memory arrays' 13 addresses and the addresses of the stores after the loop (workspace
//       offsets): now per-lane values in VGPRs, made so on purpose (in_vgpr, per_lane, kEarlyAddresses), and for
//       kNPL = 1, whose G is not a constant, also the u, delta, dout row pointers of the backward. That costs
//       VGPRs the backward has to spare (its occupancy is set by LDS, one wavefront per SIMD) and the forward
//       little (tools/compile_check.sh reports both; docs/selective-scan.md has the table).
//   These helpers do nothing on NVIDIA, where a predicate is one bit and kernel parameters are read from the
//   constant bank. The float64 instances stay closest to the limit (up to 105 of 106 SGPRs on gfx942): ocml's
//   double exp and log1p alone hold about 25 constants.
// ---------------------------------------------------------------------------------------------------------
#pragma once

#if defined(__HIP_PLATFORM_AMD__) || defined(USE_ROCM)
#define SS_HIP 1
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
// hipify maps the CUDA bf16 header to hip/hip_bf16.h, which older ROCm releases (e.g. Debian's 5.2) lack;
// hip_bfloat16 from hip/hip_bfloat16.h exists across ROCm versions and has the same 16-bit layout as
// torch.bfloat16.
#include <hip/hip_bfloat16.h>
#else
#define SS_HIP 0
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

#include <stdint.h>

namespace ssk {

// ------------------------------------------------------------------ compat layer -------------------------

#if SS_HIP
using bf16_t = hip_bfloat16;
#else
using bf16_t = __nv_bfloat16;
#endif
using half_t = __half;

// Hardware warp size, for documentation and sanity checks only: the kernels never rely on it beyond
// "a multiple of 32" (see kSeg).
#if SS_HIP
#if defined(__AMDGCN_WAVEFRONT_SIZE)
constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE;
#else
constexpr int kWarpSize = 64;  // host pass / AMD Instinct (CDNA) default
#endif
#else
constexpr int kWarpSize = 32;
#endif

// Reductions stay inside aligned segments of kSeg lanes (xor offsets < kSeg).
constexpr int kSeg = 32;
static_assert(kWarpSize % kSeg == 0, "the kernels assume a warp/wavefront is a whole number of 32-lane segments");

// Threads per block: a multiple of 64 so that blocks are made of whole warps (32) and whole wavefronts (64).
constexpr int kThreads = 128;
static_assert(kThreads % 64 == 0, "block must be whole warps and whole wavefronts");

// Sums over a channel's lanes taken together (scatter_sum): the forward's y for kFwdSums steps at once, the
// backward's y, ddelta and du (kBwdSlots a step, one slot left empty) for kBwdSums / kBwdSlots steps. Each value
// a lane holds costs a register while its steps run, so the backward, with more registers live, takes fewer.
constexpr int kFwdSums = 8;
constexpr int kBwdSlots = 4;
constexpr int kBwdSums = 8;
// The fewest lanes a channel gets (G >= kMinGroup, make_layout), so that every group can take these sums in one
// scatter: d_state <= 4 leaves lanes of its group without a state (as d_state 17 does in a group of 32).
constexpr int kMinGroup = 8;
static_assert(kMinGroup >= kFwdSums && kMinGroup >= kBwdSums, "a group holds one value of each scatter sum");

// Launch bounds of every kernel. CUDA: kThreads per block and at least kMinBlocksPerSM resident blocks per SM,
// which caps ptxas at 65536 / (4 * 128) = 128 registers per thread, enough for every instance: with the block
// size alone, ptxas (CUDA 13.0) held some instances to 64-128 registers and spilled 8-16 bytes to local memory
// (sm_80: scan_fwd<fp32,npl8>, scan_bwd<fp64,npl4> and 5 more; sm_90: scan_combine<fp32> and 2 more; sm_100:
// three fp64 instances); with it none spills. 4 blocks (16 warps) is also the most the backward's shared memory
// lets an SM hold, so registers never become the tighter limit. HIP's second argument means something else
// (minimum wavefronts per SIMD) and is not given: there the kernels do not spill vector registers as they are.
constexpr int kMinBlocksPerSM = 4;
// The float64 backward (the gradient-checking dtype, not a training one) asks for 3 blocks, so up to 170 registers:
// at 128, scan_bwd<fp64,npl8> (d_state > 128) spilled 8-24 bytes on sm_80/90/100 once the initial state and its
// gradient were added (issue 38). On sm_80 the backward's shared memory holds an SM to 3 blocks anyway; on sm_90 and
// sm_100 a float64 instance that takes more than 128 registers runs 3 blocks instead of 4.
template <typename input_t> struct BwdMinBlocks { static constexpr int value = kMinBlocksPerSM; };
template <> struct BwdMinBlocks<double> { static constexpr int value = 3; };
// The forward's recurrence runs its full batches of steps without a guard (see there) in the instances training
// uses, one state a lane and float accumulation; the second copy of the steps that takes (for a chunk's last,
// partial batch) cost the others 10-56 registers and up to a third of their occupancy, so they keep one guarded
// copy. Those instances ask for 8 blocks, so 64 registers: the 32 warps an SM they had before. Uncapped, ptxas
// (13.0) took 77-80 registers for 8-12 % fewer instructions a step on sm_80 / sm_90 (none fewer on sm_100), at 6
// blocks an SM instead of 8.
template <typename input_t, int kNPL> struct FwdBatches {
  static constexpr bool unguarded = kNPL == 1 && sizeof(input_t) < 8;
  static constexpr int min_blocks = unguarded ? 8 : kMinBlocksPerSM;
};
#if SS_HIP
#define SS_LAUNCH_BOUNDS __launch_bounds__(kThreads)
#define SS_LAUNCH_BOUNDS_FWD(input_t, npl) __launch_bounds__(kThreads)
#define SS_LAUNCH_BOUNDS_BWD(input_t) __launch_bounds__(kThreads)
#else
#define SS_LAUNCH_BOUNDS __launch_bounds__(kThreads, kMinBlocksPerSM)
#define SS_LAUNCH_BOUNDS_FWD(input_t, npl) __launch_bounds__(kThreads, (FwdBatches<input_t, npl>::min_blocks))
#define SS_LAUNCH_BOUNDS_BWD(input_t) __launch_bounds__(kThreads, BwdMinBlocks<input_t>::value)
#endif

// `#pragma unroll n` for nvcc alone: clang does not unroll the time loops it is put on, and says so in a "loop not
// unrolled" warning for every instance of every HIP build.
#define SS_PRAGMA(x) _Pragma(#x)
#if SS_HIP
#define SS_NV_UNROLL(n)
#else
#define SS_NV_UNROLL(n) SS_PRAGMA(unroll n)
#endif

// Longest chunk between two stored states.
constexpr int kMaxChunk = 64;

// Shared-memory budget per block (bytes), which fixes the chunk length (the launcher's make_layout). NVIDIA:
// 48 KiB needs no opt-in, and 3 (sm_80) or 4 (sm_90, sm_100) such blocks fit an SM. AMD: 32 KiB, so that two
// blocks, four wavefronts, fit the 64 KiB of LDS of a CDNA2/CDNA3 CU: at 48 KiB one block (two wavefronts) held
// a CU and two of its four SIMDs had no wavefront of the backward at all (see "Occupancy floor" above).
constexpr int kSmemBudget = SS_HIP ? 32 * 1024 : 48 * 1024;

// Exchange with the lane whose index differs by `mask` (all lanes of the warp must call this together).
// HIP: __shfl_xor(v, mask, width = warpSize) takes no lane mask; it exists from ROCm 5 through ROCm 7. The
// *_sync variants that ROCm 6.2+ offers (default in ROCm 7) take a 64-bit lane mask: CUDA's 0xffffffff would name
// only lanes 0-31 of a wave64, so they are not used here. Lane ids are never taken as `threadIdx.x & 0x1f` (wrong
// on wave64, mamba_ssm's ROCm dA bug for L > 128): every cross-lane step has an xor offset < kSeg = 32, so partners
// lie in the same aligned 32-lane segment on 32- and 64-wide hardware alike. tools/kernel_emu runs this code both
// ways (CUDA branch with 32-lane warps, HIP branch with 64-lane wavefronts).
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int mask) {
#if SS_HIP
  return __shfl_xor(v, mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}

// Accumulation type: double for double input, float otherwise. The kernel emulator's counting build
// (tools/kernel_emu) defines SS_ACC_FLOAT / SS_ACC_DOUBLE as types that compute the same and count what is done
// with them; nothing else defines them.
#ifndef SS_ACC_FLOAT
#define SS_ACC_FLOAT float
#define SS_ACC_DOUBLE double
#endif
template <typename T> struct AccType { using type = SS_ACC_FLOAT; };
template <> struct AccType<double> { using type = SS_ACC_DOUBLE; };

// An input element as the accumulation type (to_acc; load_acc from memory), and an accumulation value stored as
// the input type. Explicit intrinsics only: torch builds with __CUDA_NO_HALF_CONVERSIONS__ etc.
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(half_t v) { return __half2float(v); }
#if SS_HIP
__device__ __forceinline__ float to_acc(bf16_t v) { return static_cast<float>(v); }
#else
__device__ __forceinline__ float to_acc(bf16_t v) { return __bfloat162float(v); }
#endif
template <typename T>
__device__ __forceinline__ auto load_acc(const T* p) { return to_acc(*p); }

__device__ __forceinline__ void store_from_acc(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_from_acc(double* p, double v) { *p = v; }
__device__ __forceinline__ void store_from_acc(half_t* p, float v) { *p = __float2half_rn(v); }
#if SS_HIP
__device__ __forceinline__ void store_from_acc(bf16_t* p, float v) { *p = bf16_t(v); }  // round to nearest even
#else
__device__ __forceinline__ void store_from_acc(bf16_t* p, float v) { *p = __float2bfloat16_rn(v); }
#endif

// A row of n accumulation values in shared memory, read or written in one access (ld/st.shared.v2 or .v4: LDS.64,
// LDS.128; ds_read_b64, ds_read_b128) where the row fits 16 bytes, else in 16-byte parts. The backward keeps each
// (time, channel)'s dl, u, dy and dout * silu'(z) in one row, and each (time, state)'s B and C, and dB and dC, in
// pairs, so that a step reaches them through one address and one instruction each (tools/sass_loops.py counts what
// a step issues). p must be aligned to the row (n * sizeof(T), at most 16 bytes). The kernel emulator's counting
// build has its own overloads (tools/kernel_emu/shim/emu_count.h) so that a row counts as one access, as on a GPU.
template <int n, typename T>
struct alignas(n * sizeof(T) < 16 ? n * sizeof(T) : 16) SmemRow {
  T v[n];
};
template <int n, typename T>
__device__ __forceinline__ void smem_load(const T* p, T (&out)[n]) {
  const SmemRow<n, T> r = *reinterpret_cast<const SmemRow<n, T>*>(p);
#pragma unroll
  for (int i = 0; i < n; ++i) out[i] = r.v[i];
}
template <int n, typename T>
__device__ __forceinline__ void smem_store(T* p, const T (&in)[n]) {
  SmemRow<n, T> r;
#pragma unroll
  for (int i = 0; i < n; ++i) r.v[i] = in[i];
  *reinterpret_cast<SmemRow<n, T>*>(p) = r;
}

// Math in the accumulation type (overloads, so no std:: that hipify would rewrite).
__device__ __forceinline__ float ss_exp(float x) { return expf(x); }
__device__ __forceinline__ double ss_exp(double x) { return exp(x); }
__device__ __forceinline__ float ss_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double ss_log1p(double x) { return log1p(x); }
// The recurrences' decay exp(dl * A) is exp2(dl2 * A) with dl2 = dl * log2(e), made once per (channel, step) where
// the chunk is staged: exp is exp2 of a scaled argument on both vendors (NVIDIA's MUFU.EX2, AMD's v_exp_f32), so
// exp(dl * A) cost each (state, step) the multiply by log2(e) as well (sm_90: one instruction of the forward's 16.2
// a step, of the recompute's 9.6 and of the reverse step's).
__device__ __forceinline__ float ss_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ double ss_exp2(double x) { return exp2(x); }
template <typename T>
__host__ __device__ constexpr T log2e() { return T(1.44269504088896340736); }
template <typename T>
__host__ __device__ constexpr T ln2() { return T(0.693147180559945309417); }
// The decay of an argument staged for it: exp2 of dl2 * A (kExp2), or exp of dl * A.
template <bool kExp2, typename T>
__device__ __forceinline__ T decay(T x) {
  if constexpr (kExp2) return ss_exp2(x);
  else return ss_exp(x);
}

// torch.nn.functional.softplus with its defaults (beta 1, threshold 20): x above 20 passes through unchanged,
// and the derivative there is exactly 1.
template <typename T>
__device__ __forceinline__ T softplus(T x) {
  return x > T(20) ? x : ss_log1p(ss_exp(x));
}
// Written so that exp never overflows (matters under -ffast-math / --use_fast_math, which assume finite math).
template <typename T>
__device__ __forceinline__ T sigmoid(T x) {
  if (x >= T(0)) return T(1) / (T(1) + ss_exp(-x));
  const T e = ss_exp(x);
  return e / (T(1) + e);
}
template <typename T>
__device__ __forceinline__ T softplus_grad(T x) {
  return x > T(20) ? T(1) : sigmoid(x);
}

// Sum over the G lanes of a group (G a power of two <= kSeg, groups aligned): every lane gets the total.
template <typename T>
__device__ __forceinline__ T group_sum(T v, int G) {
  for (int off = G >> 1; off > 0; off >>= 1) v += shfl_xor(v, off);
  return v;
}

// Dynamic shared memory, declared once as double so that it is 8-byte aligned for float and double use.
extern __shared__ double ss_smem_raw[];

// Blocks that add to one sum in turn (the backward's chain, see "Determinism"). A block's turn comes when a flag in
// global memory reaches its place: one lane waits for it (chain_wait) and the block then reads what the blocks before
// it stored; a block passes the turn on after its stores (chain_release). The pattern of a serial split-K
// reduction: every thread's stores are made visible device-wide (__threadfence) before the flag says so, and the
// sums are read with volatile loads, which go past the SM's L1 cache (other SMs' stores do not update it).
__device__ __forceinline__ float load_fresh(const float* p) { return *static_cast<const volatile float*>(p); }
__device__ __forceinline__ double load_fresh(const double* p) { return *static_cast<const volatile double*>(p); }
// A pause between two reads of a flag, so that the waiting lane leaves the memory system to the others. (The kernel
// emulator runs blocks one after another: there any wait that is not over at once is a block waiting for one that
// has not run, which on a GPU could hang, and the emulator's stand-ins stop with a message.)
__device__ __forceinline__ void spin_pause() {
#if SS_HIP
  __builtin_amdgcn_s_sleep(1);
#elif !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
  __nanosleep(64);
#endif
}
__device__ __forceinline__ void chain_wait(const unsigned* flag, unsigned turn) {
  if (threadIdx.x == 0) {
    while (*static_cast<const volatile unsigned*>(flag) < turn) spin_pause();
    __threadfence();
  }
  __syncthreads();
}
__device__ __forceinline__ void chain_release(unsigned* flag, unsigned next) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicExch(flag, next);
}
// The block's index for the work mapping when it waits for others: a ticket, taken in the order blocks start (an
// atomic counter), so that the blocks it waits for have started: a GPU may start a grid's blocks in any order, and
// a block that waits for one that has not started, holding the place that one needs, would wait forever. (The
// shared memory's next use is after the chunk loop's first barrier.)
__device__ __forceinline__ unsigned block_ticket(unsigned* counter) {
  unsigned* const slot = reinterpret_cast<unsigned*>(ss_smem_raw);
  if (threadIdx.x == 0) *slot = atomicAdd(counter, 1u);
  __syncthreads();
  return *slot;
}

// ------------------------------------------------------------------ parameters -----------------------------

// What the kernels need, with 32-bit sizes (the launcher checks they fit). Pointers are untyped; each kernel
// casts them to its input / accumulation type.
struct KernelParams {
  int batch, dim, seqlen, dstate;
  int group;           // G: lanes per channel
  int chunk;           // T: time steps per chunk, a power of two
  int chunk_log2;      // log2(T): the staging loops split an index into (row, step) with a shift and a mask
  int n_chunks;        // ceil(seqlen / chunk)
  int blocks_per_batch;
  int n_seg;           // S: segments along the sequence (see "Sequence parallelism")
  int seg_chunks;      // chunks per segment (the last segment may have fewer)
  int pass;            // which pass of a multi-pass launch (set by the launcher, see each kernel)
  bool softplus;
  bool reverse;        // scan t = L-1 .. 0: step s of the scan is time L-1-s (see time())
  bool accumulate;     // forward: out += this scan's output, each element read and written once
  bool chain;          // backward, several blocks of channels a batch row: pass 1 sums dB, dC in place, block after
                       // block (see "Determinism"); else per-block partials that scan_reduce_kernel adds

  // Position in memory of scan step s: the kernels walk steps 0, 1, ...; in reverse mode they map to times L-1,
  // L-2, ..., so the reversed direction needs no flipped copies and runs exactly the forward's arithmetic.
  __host__ __device__ int time(int s) const { return reverse ? seqlen - 1 - s : s; }

  const void* u;
  const void* delta;
  const void* A;
  const void* B;
  const void* C;
  const void* D;           // may be null
  const void* z;           // may be null
  const void* delta_bias;  // may be null
  void* out;
  void* saved;             // (batch, dim, n_chunks, dstate), accumulation type: each chunk's start state
  void* last_state;        // forward, may be null: (batch, dim, dstate), accumulation type, the state after the
                           // last scan step (after time 0 in reverse mode)
  const void* h0;          // forward, may be null (zero): (batch, dim, dstate), accumulation type, the state
                           // before the first scan step (before time L-1 in reverse mode); the backward finds it
                           // in `saved`, where the forward stored it as chunk 0's start
  const void* dlast;       // backward, may be null (zero): the gradient of last_state, same shape and type
  void* dh0;               // backward, may be null: the gradient of h0, same shape and type
  const void* dout;
  void* du;
  void* ddelta;
  void* dz;                // null iff z is null
  void* dA;                // accumulation type; dA .. ddelta_bias written by scan_reduce_kernel (dB, dC by the
                           // backward itself when blocks_per_batch == 1 or chain)
  void* dB;
  void* dC;
  void* dD;                // null iff D is null
  void* ddelta_bias;       // null iff delta_bias is null
  void* ws;                // workspace (see ws_layout), accumulation type, no initialisation needed
  unsigned* flags;         // backward with chain: the chain's flags and ticket counter in ws (ws_layout), zeroed
  int tiles;               // channel tiles of cpb channels a block walks in turn: 1 forward, bwd_tiles() backward
};

// Workspace layout, offsets in elements of the accumulation type; BD = batch*dim, S = n_seg, NC = blocks per batch.
//   seg_v [BD][S][N]  forward: segment's end state from a zero start; backward: its outgoing adjoint carry from a
//                     zero carry-in, replaced by the combine with the carry INTO segment s-1
//   seg_P [BD][S][N]  product of exp(dl*A) over the segment
//   dA_p  [BD][S][N]  backward: per-segment partial sums of dA
//   dD_p, dbias_p [BD][S]
//   dB_p, dC_p [batch][NC][N][L]  per-block-of-channels partial sums (only when NC > 1 and not chain; else the
//                     backward writes dB, dC)
//   flags          chain only, as unsigned: [batch][n_chunks] how many blocks of channels have added their sums
//                     of a chunk into dB, dC, then the ticket counter (block_ticket); one element each, zeroed by
//                     the launcher before pass 1 (KernelParams::flags points here)
struct WsLayout {
  int64_t seg_v, seg_P, dA_p, dD_p, dbias_p, dB_p, dC_p, flags, fwd_total, bwd_total;
};
// Whether the backward's blocks of channels write per-block partial sums of dB, dC (several blocks a batch row and
// no chain; scan_reduce_kernel adds them).
__host__ __device__ inline bool writes_partials(const KernelParams& p) { return p.blocks_per_batch > 1 && !p.chain; }
__host__ __device__ inline int64_t chain_flag_count(const KernelParams& p) {
  return p.chain ? int64_t(p.batch) * p.n_chunks + 1 : 0;
}
__host__ __device__ inline WsLayout ws_layout(const KernelParams& p) {
  WsLayout w;
  const int64_t bd = int64_t(p.batch) * p.dim, s = bd * p.n_seg * p.dstate;
  const int64_t part = writes_partials(p) ? int64_t(p.batch) * p.blocks_per_batch * p.dstate * p.seqlen : 0;
  w.seg_v = 0;
  w.seg_P = s;
  w.dA_p = 2 * s;
  w.dD_p = 3 * s;
  w.dbias_p = w.dD_p + bd * p.n_seg;
  w.dB_p = w.dbias_p + bd * p.n_seg;
  w.dC_p = w.dB_p + part;
  w.flags = w.dC_p + part;
  w.fwd_total = p.n_seg > 1 ? 2 * s : 0;
  w.bwd_total = w.flags + chain_flag_count(p);
  return w;
}

// Row stride, in words, of the shared-memory arrays indexed [t][channel] and [t][state]: the row's length made odd.
// The loops that stage a chunk and the epilogues give consecutive lanes consecutive time steps (so that their
// global accesses coalesce); with rows of 8 or 16 words those lanes met on 4 or 2 of the 32 banks, 8- and 16-way
// conflicts (tools/kernel_emu counts them: smem_wavefronts). An odd stride puts 32 consecutive steps on 32
// banks. The time loops read within one row (consecutive words, or one word for a channel's lanes), as before.
__host__ __device__ constexpr int smem_row(int words) { return words | 1; }

// Columns of the B, C rows ([t][state]): every state, and with one state a lane (d_state <= 32) every lane of a
// channel's group, G >= N. The lanes n >= N of a group read zero B and C there (the staging writes them), so their
// state stays zero and they add zero to every sum over n, which lets the recurrences run every lane through the
// step without the per-lane test `k < ok` (see computes: a divergent branch, with which a step issued 4.5 more
// instructions in the reverse recurrence, 6 in the recompute and in the backward's pass 0, 5 in the forward's,
// 3.5 in the forward's recurrence, on sm_90). With G = N (d_state 8, 16, 32; Vim's 16) the rows are as before.
// With one state a lane that is G columns whatever d_state, and the kernels take it so (bc_row_cols; G is their
// template constant there): a step's B, C address is then an immediate offset from the previous step's, where a
// runtime row cost ptxas a multiply and two address instructions a step (sm_90: the forward's step 19.2 -> 17.5 in
// bf16, the reverse step 67.0 -> 65.5, with dbc_cols below 64.0).
__host__ __device__ constexpr int bc_cols(int dstate, int group) { return dstate > group ? dstate : group; }
template <int kNPL>
__host__ __device__ constexpr int bc_row_cols(int dstate, int group) {
  return kNPL == 1 ? group : bc_cols(dstate, group);
}

// Columns of the backward's dB, dC sums ([seg][t][state]): only the lanes with a state store them (the `k < lead`
// test), so N columns would do; with one state a lane and G <= 16 they are G, a constant for the same reason as
// bc_cols (d_state 9-16 share the rows of 16; the chunk the shared memory allows does not change). Not for
// G = 32: rows of 33 instead of 17-31 would halve the chunk at d_state 17 on NVIDIA and 17-31 in float64 on AMD.
__host__ __device__ constexpr int dbc_cols(int npl, int dstate, int group) {
  return npl == 1 && group <= 16 ? group : dstate;
}

// The backward's three arrays of sums over n (du, ddl, y of a step, written by the lanes that finish a scatter sum)
// lie sums_stride words apart: [T][RC] and cpb / 4 words more, so that one scatter sum's writes (three sums of two
// steps, for each of a warp's 32 / G = cpb / 4 channels) land on different banks; T * RC alone is a multiple of 32
// for T = 32, and the three sums of a step then shared a bank (3-way conflicts).
__host__ __device__ constexpr int sums_stride(int chunk, int cpb) { return chunk * smem_row(cpb) + cpb / 4; }

// Shared-memory sizes (in elements of the accumulation type); the host uses the same formulas.
__host__ __device__ inline int64_t fwd_smem_elems(int chunk, int dstate, int group) {
  const int cpb = kThreads / group;
  // u, dl, y per channel and step; B, C per state and step
  return int64_t(3) * chunk * smem_row(cpb) + int64_t(2) * chunk * smem_row(bc_cols(dstate, group));
}
__host__ __device__ inline int64_t bwd_smem_elems(int chunk, int dstate, int group, int npl) {
  const int cpb = kThreads / group;
  // history of chunk+1 states per thread and state slot; 6 staged values per channel and step and the 3 arrays of
  // sums over n; B, C per state and step; dB, dC per 32-lane segment, state and step
  return int64_t(chunk + 1) * kThreads * npl + int64_t(6) * chunk * smem_row(cpb) +
         int64_t(3) * sums_stride(chunk, cpb) + int64_t(2) * chunk * smem_row(bc_cols(dstate, group)) +
         int64_t(2 * (kThreads / kSeg)) * chunk * smem_row(dbc_cols(npl, dstate, group));
}

// G, the lanes per channel: kG, the instance's template constant, where it has one. With one state a lane (d_state
// <= kSeg) the launcher picks an instance per group, kG = 8, 16 or 32: the group's loops and shuffle offsets
// (the dB/dC sums over a segment's channels, the scatter sums) then unroll into constants, which took the backward's
// reverse step from 92 to 74.5-76 instructions a step on sm_90. More than one state per lane only when d_state >
// kSeg, and then the group is kSeg lanes (make_layout), kG = 0: on AMD the constant kSeg, so that every k * G is an
// immediate instead of one more uniform value in a scalar register; NVIDIA keeps the runtime value there: with the
// constant, ptxas (13.0) unrolled more and spilled 24 bytes in scan_bwd<fp64,npl8> on sm_100.
template <int kNPL, int kG>
__host__ __device__ __forceinline__ int group_size(const KernelParams& p) {
  return kG > 0 ? kG : (SS_HIP && kNPL > 1) ? kSeg : p.group;
}

// Which (batch, channel, lane) a thread works on (in a block's first channel tile; see bwd_tiles).
// Block index = (b * blocks_per_batch + chb) * n_seg + seg: blockIdx.x, or the block's ticket (block_ticket).
struct ThreadMap {
  int b, chb, seg, c_begin, c_end, d0, c_local, lane_g, d;
  int64_t bd;  // b * dim + d
  bool ch_ok;
  // tiles: the channel tiles of a block, p.tiles in the backward (the forward's constant 1 spares it registers)
  __device__ ThreadMap(const KernelParams& p, int tiles, unsigned block) {
    const int cpb = kThreads / p.group;
    seg = block % p.n_seg;
    const int bc = block / p.n_seg;
    b = bc / p.blocks_per_batch;
    chb = bc % p.blocks_per_batch;
    d0 = chb * cpb * tiles;
    c_begin = seg * p.seg_chunks;
    c_end = min(p.n_chunks, c_begin + p.seg_chunks);
    c_local = threadIdx.x / p.group;
    lane_g = threadIdx.x % p.group;
    d = d0 + c_local;
    bd = int64_t(b) * p.dim + d;
    ch_ok = d < p.dim;
  }
};

// A pointer the compiler keeps in vector registers from here on (AMD; elsewhere the pointer unchanged). For the
// addresses of the stores after the time loop: computed before the loop, they cost two VGPRs per lane there,
// where the uniform values they are made of (workspace offsets, sizes) would hold scalar registers across it.
// per_lane<false> leaves the pointer alone (for instances where vector registers are the scarcer kind).
template <bool kMove = true, typename T>
__device__ __forceinline__ T* per_lane(T* ptr) {
#if defined(__HIP_DEVICE_COMPILE__)
  if (kMove) asm volatile("" : "+v"(ptr));
#endif
  return ptr;
}

// Global-memory addressing of a block's rows: its cpb <= kThreads channel rows of u, delta, z, out, dout, du,
// ddelta, dz (starting at element row_base) and the N <= 256 state rows of B, C (bc_base of its batch element) or
// of its dB, dC partials. An element is (start of the block's rows) + (row, time index) (blk_at), the latter below
// kMaxRows * L, which the launcher keeps within int32 (check_args). AMD (kBlockBases): one 64-bit base per
// tensor and block, computed once (block_ptr), plus the unsigned 32-bit offset, so that the compiler uses the
// 32-bit offset form of global loads and stores (base in SGPRs, offset in one VGPR) and keeps no 64-bit offsets.
// NVIDIA, forward: the kernel-parameter pointer (read from the constant bank, no register) plus a 64-bit offset,
// which costs ptxas (13.0) fewer registers: scan_fwd<fp32,npl1> 64 / 60 / 72 on sm_80 / sm_90 / sm_100 instead
// of 64 / 72 / 86 (the backward uses block bases on both vendors, see there).
constexpr int kMaxRows = kThreads > 256 ? kThreads : 256;
constexpr bool kBlockBases = SS_HIP;
__device__ __forceinline__ int64_t row_base(const KernelParams& p, const ThreadMap& m) {
  return (int64_t(m.b) * p.dim + m.d0) * p.seqlen;
}
__device__ __forceinline__ int64_t bc_base(const KernelParams& p, int64_t row) {
  return row * p.dstate * p.seqlen;
}
// The pointer to index with blk_at(start, ...): with kBases (AMD's default) ptr + start, where per_lane<kMove>
// decides where it lives, else ptr itself.
template <bool kMove = false, bool kBases = kBlockBases, typename T>
__device__ __forceinline__ T* block_ptr(T* ptr, int64_t start) {
  return kBases ? per_lane<kMove>(ptr + start) : ptr;
}
// The offset of (row, time index ts) from the pointer block_ptr gives: with kBases inside the block's rows, as 32
// bits; else from the tensor's start (ts = p.time(s) for scan step s).
template <bool kBases = kBlockBases>
__device__ __forceinline__ int64_t blk_at(const KernelParams& p, int64_t start, int row, int ts) {
  return kBases ? int64_t(uint32_t(row) * uint32_t(p.seqlen) + uint32_t(ts)) : start + int64_t(row) * p.seqlen + ts;
}

// The loops that stage a chunk's inputs in shared memory (and the backward's finish, which reads D) go in rounds of
// a few items a thread (StageRound): first every item's global loads, then every item's use (conversion,
// arithmetic, the stores). An item at a time, as before, each item's use waited for its own loads and the next
// item's loads came after that use: a memory round trip per item, while the block's other warps waited at the
// barrier after the loop. With d_state 16 (chunks of 32 steps) that was 8 round trips a chunk in the forward (2
// items of u, delta; 4 of B, C; 2 of z in the epilogue) and 28 in the backward (4 items of B, C; then for each of 4
// tiles 2 of its channels, z apart from the rest, and 2 of its finish); now 2 + 2 and 2 + 4 x (1 + 1)
// (tools/sass_loops.py counts the loads each wait finds in flight and holds them: LOADS_IN_FLIGHT). Item i of a
// loop over rows x steps is (row i / T, step i % T): consecutive threads take consecutive steps (coalesced), and as
// kThreads is a multiple of T the items of a round share their step (StageAt), rows R = kThreads / T apart.
// Items a round, of a (channel, step) (3-5 values) and of a (state, step) (B and C): as many as ptxas (13.0) gives
// registers for without spilling or lengthening a step. The forward has 64 (see FwdBatches): with 2 (channel, step)
// items or 4 (state, step)s a round, or z's in rounds too, it spilled 8-40 bytes on sm_80/90, and sm_100's groups of
// 8 spilled with 2 (state, step)s. The backward with 4 (state, step)s took 69.0 instructions a reverse step instead
// of 67.0. With several states a lane (d_state > 32) the registers go to the states, and float64 (the
// gradient-checking dtype) has the fewest: one item at a time there (with rounds the instances with 8 states a lane
// spilled on sm_80/90 and parked SGPRs on gfx90a/gfx942, and sm_90's float64 backward took 160 registers, 18.75 %
// occupancy instead of 25 %).
template <typename input_t, int kNPL, int kG> struct StageItems {
  static constexpr bool rounds = kNPL == 1 && sizeof(input_t) < 8;
  static constexpr int fwd_channel = 1, fwd_state = rounds && kG >= 16 ? 2 : 1;
  static constexpr int bwd_channel = rounds ? 2 : 1, bwd_state = rounds ? 2 : 1;
};
static_assert(kThreads % kMaxChunk == 0, "a thread stages one step of a chunk");
// A round's items, from its first item i (made from the loop's counter in each round, not once before the loops:
// so nothing of it stays live across the recurrences, where registers are scarcest).
struct StageAt {
  int t, row, R;  // the items' step in the chunk, the first item's row, the rows between items
  int ts;         // the time index of that step in the chunk starting at step t0
  bool in_seq;    // whether that step lies in the sequence (the chunk holds len steps)
  __device__ StageAt(const KernelParams& p, int i, int t0, int len)
      : t(i & (p.chunk - 1)), row(i >> p.chunk_log2), R(kThreads >> p.chunk_log2), ts(p.time(t0 + t)),
        in_seq(t < len) {}
};
// A round of a staging loop over rows r, r + R, .. (kItems of them): load() issues every item's global loads, use()
// then converts, computes and stores each. The loop gives three functions of a row: inside(row), whether the item
// lies in the sequence and the block's rows (false past the loop's end; outside, zeros are staged); fetch(row, raw),
// its global loads (only inside); use(row, get, inside), the rest, which calls get() for the item's inputs (only
// inside). With one item a round, load() does nothing and get() fetches: the loads sit inside the use, as in a
// plain loop, which takes the fewest registers (loads first spilled 8-32 bytes in scan_*<fp64,npl8> on sm_80/90).
template <typename Raw, int kItems>
struct StageRound {
  Raw raw[kItems];  // the items' inputs as loaded (the input type: converted when used)
  bool in[kItems];
  template <typename Inside, typename Fetch>
  __device__ __forceinline__ void load(int r, int R, Inside&& inside, Fetch&& fetch) {
    if constexpr (kItems > 1) {
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        in[j] = inside(r + j * R);
        if (in[j]) fetch(r + j * R, raw[j]);
      }
    }
  }
  template <typename Inside, typename Fetch, typename Use>
  __device__ __forceinline__ void use(int r, int R, int rows, Inside&& inside, Fetch&& fetch, Use&& f) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int row = r + j * R;
      if (row >= rows) continue;
      if constexpr (kItems == 1) {
        // (v{}: fetch leaves an absent input's field, z or the bias, unset, and copying it out unset is what
        // g++ warned about in every emulator build; the zeros cost sm_90's forward staging one instruction a
        // round, and ptxas's allocation moved elsewhere: 1-8 registers fewer in most other instances)
        f(row, [&] { Raw v{}; fetch(row, v); return v; }, inside(row));
      } else {
        f(row, [&] { return raw[j]; }, in[j]);
      }
    }
  }
};
template <typename input_t> struct BCInputs { input_t B, C; };  // of a (state, step)
// A (state, step)'s B and C into their pair of shared memory at dst (zeros outside), for StageRound's use(); B
// times ln 2 for the forward (kLn2B: see its recurrence).
template <typename acc_t, typename input_t, bool kLn2B = false, typename Get>
__device__ __forceinline__ void stage_bc(acc_t* dst, Get&& get, bool inside) {
  acc_t bc[2] = {acc_t(0), acc_t(0)};
  if (inside) {
    const BCInputs<input_t> v = get();
    bc[0] = kLn2B ? to_acc(v.B) * ln2<acc_t>() : to_acc(v.B);
    bc[1] = to_acc(v.C);
  }
  smem_store(dst, bc);
}
template <typename input_t, typename acc_t> struct FwdInputs { input_t u, delta; acc_t bias; };  // (channel, step)
template <typename input_t, typename acc_t> struct BwdInputs { input_t u, delta, dout, z; acc_t bias; };

// Channel tiles a backward block walks in turn (see "Channel tiles" at the top): kMaxTiles when a lane holds one
// state (d_state <= 32) of a float accumulation, where each tile's A, carry and running sums cost the thread five
// more registers; one when it holds several, and for float64 input (the gradient-checking dtype, whose registers
// are the scarcest: with tiles its backward parked scalar registers in vector lanes on gfx90a). Fewer when the
// block's rows would pass kMaxRows (d_state 1: 128 channels a tile, two tiles).
constexpr int kMaxTiles = 4;
__host__ __device__ constexpr int bwd_max_tiles(int npl, int acc_bytes) {
  return npl == 1 && acc_bytes == 4 ? kMaxTiles : 1;
}
// Whether the instance's blocks of channels can sum dB, dC in a chain (see "Determinism"): those that walk several
// tiles, Vim's. The others (several states a lane, float64) write per-block partial sums for scan_reduce_kernel: the
// chain's code in their backward cost ptxas and the AMD compilers registers they lack (sm_80 / sm_90 spilled 4-5
// bytes in scan_bwd<fp64,npl8>, gfx942 parked 2-4 scalar registers in scan_bwd<fp32,npl8> and <bf16,npl8>).
__host__ __device__ constexpr bool bwd_chains(int npl, int acc_bytes) { return bwd_max_tiles(npl, acc_bytes) > 1; }
__host__ __device__ inline int bwd_tiles(int npl, int acc_bytes, int group) {
  const int cpb = kThreads / group, most = bwd_max_tiles(npl, acc_bytes);
  return most * cpb <= kMaxRows ? most : kMaxRows / cpb;
}

// State slots of this lane: slot k holds state n = k*G + lane_g, which exists for k < slots (0 .. kNPL).
__device__ __forceinline__ int lane_slots(const KernelParams& p, const ThreadMap& m) {
  return (p.dstate - m.lane_g + p.group - 1) / p.group;  // lane_g < G and N >= 1: never negative
}

// Per-lane conditions inside the time loops ("slot k exists": k < slots) are tested as `k < v` on a value v
// passed through vary() at the top of the loop body. AMD: vary() is an empty asm statement (no instruction)
// that tells the compiler v may change there, so each test stays one v_cmp inside the loop instead of being
// hoisted out of it as a 64-bit lane mask held in two scalar registers for the whole loop (two per slot and
// condition: for kNPL = 8 that alone was 32 SGPRs; see "Registers on AMD" at the top). NVIDIA: nothing.
__device__ __forceinline__ void vary(int& v) {
#if defined(__HIP_DEVICE_COMPILE__)
  asm volatile("" : "+v"(v));
#else
  (void)v;
#endif
}

// The same for a value (an offset): in_vgpr(v) is v, kept in a vector register from here on (AMD).
__device__ __forceinline__ int in_vgpr(int v) {
  vary(v);
  return v;
}

// Whether a time loop's step computes slot k of this lane (ok: the lane's slots, 0 for a channel past dim). With
// one state a lane, every lane computes, each step the same instructions for the whole warp: where the lane has no
// state (n >= N, or its channel past dim) its inputs are zeros (bc_cols; the staging), so its state stays zero and
// it adds zero to each sum (for finite inputs; a non-finite input makes the channel's sums non-finite either way).
// With more, the slots k < ok.
template <int kNPL>
__device__ __forceinline__ bool computes(int k, int ok) { return kNPL == 1 || k < ok; }

// c ? a : b. NVIDIA, float: as one selp (FSEL) each. scatter_sum<kPick> swaps its values so (Vim's instances, one
// state a lane): written as C++ selects, its level swaps came out of ptxas (13.0) as three moves a pair, two of them
// predicated (sm_90: the backward's reverse step 1 instruction, the forward's recurrence 1.2 a step more); the
// others keep the selects of the array's elements, which pick(), even as that same select, made take 3 registers
// more in scan_fwd<npl2> (occupancy 56.25% -> 50% on sm_80 and sm_90) and 10 in scan_bwd<fp64,npl4> on sm_90.
template <typename T>
__device__ __forceinline__ T pick(bool c, T a, T b) { return c ? a : b; }
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float pick(bool c, float a, float b) {
  float r;
  asm("{ .reg .pred q; setp.ne.b32 q, %3, 0; selp.f32 %0, %1, %2, q; }" : "=f"(r) : "f"(a), "f"(b), "r"(int(c)));
  return r;
}
#endif

// Sums over the G lanes of a group of kV values at once (kV a power of two <= G): a reduce-scatter butterfly.
// Each level halves the values a lane holds: the lanes with the level's offset bit set keep the upper half and
// send the lower, the others the reverse, so the pair ends with one half each, summed. After log2(kV) levels a
// lane holds one value, which the remaining levels sum over the rest of the group. The result on a lane is the
// group's total of value `slot`; of the G / kV lanes that get the same total, one has slot >= 0 (the one whose
// lane bits below G / kV are zero), the others -1, so that each total has one writer. It costs
// kV - 1 + log2(G / kV) shuffles and as many adds for the kV sums, where group_sum takes log2(G) for each one
// (16 x 4 = 64 against 15 at G = kV = 16). A fixed order: the same bits on every run. The slot is a per-lane value
// made from the lane bits (no division by the runtime G). kPick: the swaps through pick() (see there).
template <bool kPick, int kV, typename T>
__device__ __forceinline__ T scatter_sum(T (&v)[kV], int G, int lane_g, int& slot) {
  int off = G >> 1, j = 0;
  // AMD: the offsets in vector registers, and the lane tests (`upper`) made here, not hoisted out of the time
  // loops as lane masks in scalar registers (see vary)
  vary(off);
  vary(lane_g);
#pragma unroll
  for (int half = kV / 2; half >= 1; half /= 2) {
    const bool upper = (lane_g & off) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      T keep, send;
      if constexpr (kPick) {
        keep = pick(upper, v[i + half], v[i]);
        send = pick(upper, v[i], v[i + half]);
      } else {
        keep = upper ? v[i + half] : v[i];
        send = upper ? v[i] : v[i + half];
      }
      v[i] = keep + shfl_xor(send, off);
    }
    j += upper ? half : 0;
    off >>= 1;
  }
  int rest = 0;
  for (; off > 0; off >>= 1) {
    v[0] += shfl_xor(v[0], off);
    rest |= lane_g & off;
  }
  slot = rest == 0 ? j : -1;
  vary(slot);
  return v[0];
}

// The slot scatter_sum<kV> gives lane lane_g of a group of G, made alone (for a lane constant): the upper halves
// its levels kept, or -1 where a lane bit below them is set. (scatter_sum makes it beside its sums: computed there
// through this function, scan_bwd<fp64,npl8> spilled 16 bytes on sm_90.)
template <int kV>
__device__ __forceinline__ int scatter_slot(int G, int lane_g) {
  int off = G >> 1, j = 0, rest = 0;
#pragma unroll
  for (int half = kV / 2; half >= 1; half /= 2, off >>= 1) j += (lane_g & off) != 0 ? half : 0;
  for (; off > 0; off >>= 1) rest |= lane_g & off;
  return rest == 0 ? j : -1;
}

// Where this thread's slot 0 of segment summary row (b, d, seg) of the workspace lies, for the arrays at offset
// `which` (seg_v, seg_P, dA_p: [BD][S][N]); slot k at [k * G].
template <typename acc_t>
__device__ __forceinline__ acc_t* seg_slot(const KernelParams& p, const ThreadMap& m, int64_t which) {
  return per_lane(static_cast<acc_t*>(p.ws) + which + (m.bd * p.n_seg + m.seg) * p.dstate + m.lane_g);
}

// The addresses of the stores that follow a kernel's time loop (segment summaries, last state, parameter
// gradients). AMD: computed before the loop (kEarlyAddresses) through per_lane, so that what they are made of
// does not stay in scalar registers across the loop. NVIDIA: computed after it, where they need no registers
// during the loop (before it they cost ptxas two registers each there, and one instance a spill).
constexpr bool kEarlyAddresses = SS_HIP;
template <typename acc_t>
struct OutAddrs {
  acc_t* a;
  acc_t* b;
  acc_t* c;
  acc_t* d;
};

// This thread's slot 0 of a (batch, dim, dstate) state tensor (h0, dlast, dh0, last_state); slot k at [k * G].
template <typename T>
__device__ __forceinline__ T* state_slot(T* base, const KernelParams& p, const ThreadMap& m) {
  return base + m.bd * p.dstate + m.lane_g;
}

// Where this thread's initial state lies (slot 0), or null: no h0, a later segment, or a channel past dim.
template <typename acc_t>
__device__ __forceinline__ const acc_t* h0_slot(const KernelParams& p, const ThreadMap& m) {
  return (m.seg == 0 && p.h0 != nullptr && m.ch_ok) ? state_slot(static_cast<const acc_t*>(p.h0), p, m) : nullptr;
}

// A segment's summary for the combine step: its end value v (forward: state from a zero start; backward: adjoint
// carry) and its decay product P, per state slot this thread owns, at v_out / P_out (seg_slot).
template <typename acc_t, int kNPL>
__device__ inline void store_segment_summary(int G, int ok_slots, acc_t* v_out, acc_t* P_out, const acc_t (&v)[kNPL],
                                             const acc_t (&P)[kNPL]) {
#pragma unroll
  for (int k = 0; k < kNPL; ++k) {
    if (k < ok_slots) {
      v_out[k * G] = v[k];
      P_out[k * G] = P[k];
    }
  }
}

// ------------------------------------------------------------------ forward --------------------------------

template <typename input_t, int kNPL, int kG>
__global__ void SS_LAUNCH_BOUNDS_FWD(input_t, kNPL) scan_fwd_kernel(const KernelParams p) {
  using acc_t = typename AccType<input_t>::type;
  const int N = p.dstate, L = p.seqlen, T = p.chunk, G = group_size<kNPL, kG>(p);
  // (the row strides per lane on AMD, see in_vgpr: as uniform values they held scalar registers the kernels lack)
  const int cpb = kThreads / G, NB = bc_row_cols<kNPL>(N, G);
  const int RC = in_vgpr(smem_row(cpb)), RB = in_vgpr(smem_row(NB));
  const int tid = threadIdx.x;
  const ThreadMap m(p, 1, blockIdx.x);

  // The block's rows of each tensor (see block_ptr).
  const int64_t rows0 = row_base(p, m), bc0 = bc_base(p, m.b);
  const input_t* __restrict__ u = block_ptr(static_cast<const input_t*>(p.u), rows0);
  const input_t* __restrict__ delta = block_ptr(static_cast<const input_t*>(p.delta), rows0);
  const input_t* __restrict__ Bg = block_ptr(static_cast<const input_t*>(p.B), bc0);
  const input_t* __restrict__ Cg = block_ptr(static_cast<const input_t*>(p.C), bc0);
  const input_t* __restrict__ z = p.z != nullptr ? block_ptr(static_cast<const input_t*>(p.z), rows0) : nullptr;
  const acc_t* __restrict__ Ag = static_cast<const acc_t*>(p.A);
  const acc_t* __restrict__ Dg = static_cast<const acc_t*>(p.D);
  const acc_t* __restrict__ bias = static_cast<const acc_t*>(p.delta_bias);
  input_t* __restrict__ out = block_ptr(static_cast<input_t*>(p.out), rows0);
  // This thread's checkpoints: saved[b, d, c, k*G + lane_g] at saved_t[c*N + k*G].
  acc_t* __restrict__ saved_t = static_cast<acc_t*>(p.saved) + (m.bd * p.n_chunks) * N + m.lane_g;

  // Shared memory: per-channel arrays are [t][channel] and per-state arrays [t][n], so that in the time loop
  // the lanes of a warp read consecutive addresses (no bank conflicts) or the same one (broadcast); rows of RC
  // and RB words (smem_row: odd, so that the staging loops and the epilogue have no conflicts either; RB: see
  // bc_cols). A step's dl2 and u are a pair, as its B and C are (smem_load: one address and one load a step for
  // each). The arrays' offsets go through in_vgpr, as in the backward. The recurrences take dl2 = dl * log2(e)
  // for their decay exp2(dl2 * A) (see ss_exp2) and B ln 2 for their input (dl2 u) (B ln 2) = dl u B: no multiply
  // by log2(e) in a (state, step), and the states are the true ones. With one state a lane only (kExp2): with
  // several, ptxas took 8-23 more registers for the same loops on sm_80 and sm_100 (occupancy 56.25 -> 50 % at two
  // states a lane, 37.5 -> 25 % at eight), so those stage dl and B and take exp(dl * A).
  constexpr bool kExp2 = kNPL == 1;
  acc_t* smem = reinterpret_cast<acc_t*>(ss_smem_raw);
  acc_t* du_s = smem;                                  // [T][RC][2]: dl2 (dl: delta after bias and softplus), u
  acc_t* BC_s = smem + in_vgpr(2 * T * RC);            // [T][RB][2]: B ln 2, C (kExp2; else dl and B)
  acc_t* y_s = smem + in_vgpr(2 * T * RC + 2 * T * RB);  // [T][RC]  y before gating

  // Pass 0 (only when n_seg > 1): the segment's end state from a zero start and the product of its decays, into
  // the workspace (the last segment's are never needed). Pass 1: the segment from its true start state (zero for
  // segment 0, else the checkpoint the combine kernel stored), writing out and the checkpoints inside the segment.
  const bool local = p.pass == 0;
  if (local && m.seg == p.n_seg - 1) return;  // the whole block leaves: no barrier is skipped by some threads only

  // This lane's states: n = k*G + lane_g.
  acc_t A[kNPL], h[kNPL], P[kNPL];
  int ok = m.ch_ok ? lane_slots(p, m) : 0;  // slot k holds a real state iff k < ok (see vary)
  // Where segment 0 starts, in both passes: h0 or zero. Later segments: zero in pass 0, the combine's checkpoint
  // in pass 1.
  const acc_t* h0 = h0_slot<acc_t>(p, m);
#pragma unroll
  for (int k = 0; k < kNPL; ++k) {
    const int n = k * G + m.lane_g;
    A[k] = k < ok ? Ag[int64_t(m.d) * N + n] : acc_t(0);
    h[k] = k >= ok                      ? acc_t(0)
           : (!local && m.seg > 0)      ? saved_t[m.c_begin * N + k * G]
           : h0 != nullptr              ? h0[k * G]
                                        : acc_t(0);
    P[k] = acc_t(1);
    if (!local && m.seg == 0 && k < ok) saved_t[k * G] = h[k];  // chunk 0's start state, for the backward
  }
  const acc_t D_d = (Dg != nullptr && m.ch_ok) ? Dg[m.d] : acc_t(0);

  // Addresses of the stores after the loop (see kEarlyAddresses): pass 0 the segment summary (a, b), pass 1 the
  // last state (a; null when not asked for or not the last segment).
  const auto out_addrs = [&]() {
    OutAddrs<acc_t> r{nullptr, nullptr, nullptr, nullptr};
    if (local) {
      const WsLayout w = ws_layout(p);
      r.a = seg_slot<acc_t>(p, m, w.seg_v);
      r.b = seg_slot<acc_t>(p, m, w.seg_P);
    } else if (p.last_state != nullptr && m.seg == p.n_seg - 1) {
      r.a = per_lane(state_slot(static_cast<acc_t*>(p.last_state), p, m));
    }
    return r;
  };
  OutAddrs<acc_t> tail{nullptr, nullptr, nullptr, nullptr};
  if (kEarlyAddresses) tail = out_addrs();

  for (int c = m.c_begin; c < m.c_end; ++c) {
    const int t0 = c * T;
    const int len = min(T, L - t0);
    vary(ok);

    __syncthreads();  // everybody is done with the previous chunk (cheap: once per chunk)

    // ---- 1. stage the chunk, in rounds (StageRound): each (channel, step)'s dl2, u, each (state, step)'s B ln 2,
    // C.
    // Consecutive threads take consecutive time steps: coalesced global loads.
    constexpr int kDU = StageItems<input_t, kNPL, kG>::fwd_channel, kBC = StageItems<input_t, kNPL, kG>::fwd_state;
    for (int i = tid, j = tid; i < cpb * T || j < NB * T; i += kDU * kThreads, j += kBC * kThreads) {
      const StageAt at(p, i, t0, len), bt(p, j, t0, len);
      const auto du_in = [&](int cl) { return cl < cpb && m.d0 + cl < p.dim && at.in_seq; };
      const auto du_fetch = [&](int cl, FwdInputs<input_t, acc_t>& v) {
        const int64_t off = blk_at(p, rows0, cl, at.ts);
        v.u = u[off];
        v.delta = delta[off];
        if (bias != nullptr) v.bias = bias[m.d0 + cl];
      };
      const auto bc_in = [&](int n) { return n < N && bt.in_seq; };  // (zeros for the lanes n >= N: see bc_cols)
      const auto bc_fetch = [&](int n, BCInputs<input_t>& v) {
        const int64_t off = blk_at(p, bc0, n, bt.ts);
        v.B = Bg[off];
        v.C = Cg[off];
      };
      StageRound<FwdInputs<input_t, acc_t>, kDU> du_r;
      StageRound<BCInputs<input_t>, kBC> bc_r;
      du_r.load(at.row, at.R, du_in, du_fetch);
      bc_r.load(bt.row, bt.R, bc_in, bc_fetch);
      du_r.use(at.row, at.R, cpb, du_in, du_fetch, [&](int cl, auto get, bool inside) {
        acc_t uv = acc_t(0), dv = acc_t(0);
        if (inside) {
          const FwdInputs<input_t, acc_t> v = get();
          uv = to_acc(v.u);
          dv = to_acc(v.delta);
          if (bias != nullptr) dv += v.bias;
          if (p.softplus) dv = softplus(dv);
        }
        const acc_t pair[2] = {kExp2 ? dv * log2e<acc_t>() : dv, uv};
        smem_store(du_s + 2 * (at.t * RC + cl), pair);
      });
      bc_r.use(bt.row, bt.R, NB, bc_in, bc_fetch, [&](int n, auto get, bool inside) {
        stage_bc<acc_t, input_t, kExp2>(BC_s + 2 * (bt.t * RB + n), get, inside);
      });
    }
    __syncthreads();

    // ---- 2. pass 0: the recurrence alone, no sums over n, no shuffles: every lane runs its own states
    if (local) {
      // (two steps a pass: unrolled by four, as nvcc does unasked, the forward took 72-79 registers on sm_90 instead
      // of 63-64, and 6 blocks an SM instead of 8)
      SS_NV_UNROLL(2)
      for (int t = 0; t < len; ++t) {
        vary(ok);
        acc_t r[2];  // dl2, u
        smem_load(du_s + 2 * (t * RC + m.c_local), r);
        const acc_t dl2 = r[0];
        const acc_t dlu = dl2 * r[1];
#pragma unroll
        for (int k = 0; k < kNPL; ++k) {
          if (computes<kNPL>(k, ok)) {
            const acc_t a = decay<kExp2>(dl2 * A[k]);
            acc_t bc[2];  // (the pair, not B alone: with G = 32 a warp's B alone hit each bank twice)
            smem_load(BC_s + 2 * (t * RB + k * G + m.lane_g), bc);
            h[k] = a * h[k] + dlu * bc[0];
            P[k] *= a;
          }
        }
      }
      continue;  // uniform over the block; the next chunk starts with a barrier
    }

    // ---- 3. the recurrence. Every lane runs every step (the shuffles need all lanes); lanes without a valid
    // state contribute 0. This lane's part of y at step t (its states' h * C):
    const auto step = [&](int t) {
      vary(ok);
      t = in_vgpr(t);  // AMD: the step's offsets per lane, not one set of scalar registers per unrolled step
      acc_t r[2];  // dl2, u
      smem_load(du_s + 2 * (t * RC + m.c_local), r);
      const acc_t dl2 = r[0];
      const acc_t dlu = dl2 * r[1];  // (times B ln 2: dl u B)
      acc_t y = acc_t(0);
#pragma unroll
      for (int k = 0; k < kNPL; ++k) {
        if (computes<kNPL>(k, ok)) {
          acc_t bc[2];
          smem_load(BC_s + 2 * (t * RB + k * G + m.lane_g), bc);
          h[k] = decay<kExp2>(dl2 * A[k]) * h[k] + dlu * bc[0];
          y += h[k] * bc[1];
        }
      }
      return y;
    };
    // y of kFwdSums steps at once, in one scatter sum: step tb + j ends on the lane of slot j; a batch of fewer
    // steps (`steps`) leaves the others' slots zero.
    const auto batch = [&](int tb, int steps) {
      acc_t ys[kFwdSums];
#pragma unroll
      for (int j = 0; j < kFwdSums; ++j) ys[j] = j < steps ? step(tb + j) : acc_t(0);
      int j;
      const acc_t y = scatter_sum<kNPL == 1>(ys, G, m.lane_g, j);
      if (j >= 0 && j < steps) {
        y_s[(tb + j) * RC + m.c_local] = y + D_d * du_s[2 * ((tb + j) * RC + m.c_local) + 1];
      }
    };
    // Full batches without a guard around their steps, then the chunk's last steps that do not fill one; or, in
    // the instances that keep one copy of the steps (FwdBatches), every batch guarded. (With two copies float64
    // also parked 6 scalar registers in vector lanes on gfx90a.)
    if constexpr (FwdBatches<input_t, kNPL>::unguarded) {
      int tb = 0;
      for (; tb + kFwdSums <= len; tb += kFwdSums) batch(tb, kFwdSums);
      if (tb < len) batch(tb, len - tb);
    } else {
      for (int tb = 0; tb < len; tb += kFwdSums) batch(tb, min(kFwdSums, len - tb));
    }

    // Checkpoint: the state at the start of the next chunk, inside the segment only (the combine kernel has
    // stored the one at the segment's end, which the next segment's block reads: writing it here would race).
    if (c + 1 < m.c_end) {
#pragma unroll
      for (int k = 0; k < kNPL; ++k) {
        if (k < ok) saved_t[(c + 1) * N + k * G] = h[k];
      }
    }
    __syncthreads();  // y_s complete

    // ---- 4. epilogue: gate and store, coalesced
    for (int i = tid; i < cpb * T; i += kThreads) {
      const StageAt at(p, i, t0, len);
      const int cl = at.row;
      if (m.d0 + cl < p.dim && at.in_seq) {
        const int s = at.t * RC + cl;
        acc_t y = y_s[s];
        if (z != nullptr) {
          const acc_t zv = load_acc(z + blk_at(p, rows0, cl, at.ts));
          y *= zv * sigmoid(zv);
        }
        if (p.accumulate) y += acc_t(load_acc(out + blk_at(p, rows0, cl, at.ts)));
        store_from_acc(out + blk_at(p, rows0, cl, at.ts), y);
      }
    }
  }

  // ---- 5. after the chunks: the segment's last state and stores.
  if (!kEarlyAddresses) tail = out_addrs();
  if (local) {
    store_segment_summary<acc_t, kNPL>(G, ok, tail.a, tail.b, h, P);
  } else if (tail.a != nullptr) {  // h is now the state after the last scan step
#pragma unroll
    for (int k = 0; k < kNPL; ++k) {
      if (k < ok) tail.a[k * G] = h[k];
    }
  }
}

// ------------------------------------------------------------------ backward -------------------------------

// The state of a backward thread's channel that lives from chunk to chunk, for each of the kTiles channel tiles
// of its block (see "Channel tiles" at the top). The tile being worked on is always set 0 and rotate() brings the
// next one there, so that the time loops index the arrays with constants only (an array indexed by a run-time
// tile number would sit in local memory); kTiles rotations restore the order.
template <typename acc_t, int kNPL, int kTiles>
struct BwdState {
  acc_t A[kTiles][kNPL];      // the channel's A[d, n] (kept: loading it per chunk held its pointer in SGPRs)
  acc_t carry[kTiles][kNPL];  // exp(dl_{t+1} A) * dh_{t+1}: the gradient reaching h_t through h_{t+1}
  acc_t sum[kTiles][kNPL];    // pass 1: dA / ln 2 summed over the segment's steps; pass 0: the decays' product
  acc_t dD[kTiles], dbias[kTiles];  // pass 1; dD on lane_g == 0, dbias on the lanes that finish ddl (finish)
  __device__ __forceinline__ void rotate() {
#pragma unroll
    for (int g = 0; g + 1 < kTiles; ++g) {
#pragma unroll
      for (int k = 0; k < kNPL; ++k) {
        swap(A[g][k], A[g + 1][k]);
        swap(carry[g][k], carry[g + 1][k]);
        swap(sum[g][k], sum[g + 1][k]);
      }
      swap(dD[g], dD[g + 1]);
      swap(dbias[g], dbias[g + 1]);
    }
  }
  static __device__ __forceinline__ void swap(acc_t& a, acc_t& b) {
    const acc_t t = a;
    a = b;
    b = t;
  }
};

template <typename input_t, int kNPL, int kG>
__global__ void SS_LAUNCH_BOUNDS_BWD(input_t) scan_bwd_kernel(const KernelParams p) {
  using acc_t = typename AccType<input_t>::type;
  constexpr int kTiles = bwd_max_tiles(kNPL, sizeof(input_t) == 8 ? 8 : 4);
  // The sums over n of kSteps steps in one scatter sum; one step for float64 on AMD, the gradient-checking dtype,
  // whose backward used 105 of gfx942's 106 scalar registers before: two steps parked 8-21 in vector lanes.
  constexpr int kSums = SS_HIP && sizeof(acc_t) == 8 ? kBwdSlots : kBwdSums;
  const int N = p.dstate, L = p.seqlen, T = p.chunk, G = group_size<kNPL, kG>(p);
  const int cpb = kThreads / G;
  const int tid = threadIdx.x;
  // Pass 1 of a chain (several blocks of channels a batch row sum dB, dC in place, in turn) maps its work by ticket.
  constexpr bool kChain = bwd_chains(kNPL, sizeof(acc_t));
  const bool chained = kChain && p.chain && p.pass == 1;
  // this thread's channel in tile 0; in tile g it is g * cpb further
  const ThreadMap m(p, p.tiles,
                    chained ? block_ticket(p.flags + int64_t(p.batch) * p.n_chunks) : blockIdx.x);

  // The block's rows of each tensor (see block_ptr).
  const int64_t rows0 = row_base(p, m), bc0 = bc_base(p, m.b);
  // Block bases on NVIDIA too: with 64-bit offsets there (the forward's way) ptxas 13.0 spilled 8 bytes in
  // scan_bwd<fp64,npl8> on sm_90.
  constexpr bool kBases = true;
  // kNPL = 1 (a runtime G) leaves fewer scalar registers free and more vector ones: u, delta, dout in VGPRs.
  constexpr bool kMoreVgprs = kNPL == 1;
  const input_t* __restrict__ u = block_ptr<kMoreVgprs, kBases>(static_cast<const input_t*>(p.u), rows0);
  const input_t* __restrict__ delta = block_ptr<kMoreVgprs, kBases>(static_cast<const input_t*>(p.delta), rows0);
  const input_t* __restrict__ Bg = block_ptr<false, kBases>(static_cast<const input_t*>(p.B), bc0);
  const input_t* __restrict__ Cg = block_ptr<false, kBases>(static_cast<const input_t*>(p.C), bc0);
  const input_t* __restrict__ z =
      p.z != nullptr ? block_ptr<false, kBases>(static_cast<const input_t*>(p.z), rows0) : nullptr;
  const input_t* __restrict__ dout = block_ptr<kMoreVgprs, kBases>(static_cast<const input_t*>(p.dout), rows0);
  const acc_t* __restrict__ Ag = static_cast<const acc_t*>(p.A);
  const acc_t* __restrict__ Dg = static_cast<const acc_t*>(p.D);
  const acc_t* __restrict__ bias = static_cast<const acc_t*>(p.delta_bias);
  // This thread's checkpoints in tile 0: saved[b, d, c, k*G + lane_g] at saved_t[c*N + k*G].
  const acc_t* __restrict__ saved_t = static_cast<const acc_t*>(p.saved) + (m.bd * p.n_chunks) * N + m.lane_g;
  input_t* __restrict__ du = block_ptr<true, kBases>(static_cast<input_t*>(p.du), rows0);
  input_t* __restrict__ ddelta = block_ptr<true, kBases>(static_cast<input_t*>(p.ddelta), rows0);
  input_t* __restrict__ dz = p.dz != nullptr ? block_ptr<true, kBases>(static_cast<input_t*>(p.dz), rows0) : nullptr;
  acc_t* __restrict__ ws = static_cast<acc_t*>(p.ws);
  const WsLayout w = ws_layout(p);
  // The block's sums of dB, dC over its channels: into dB, dC when one block holds all channels or the blocks of
  // channels add them there in turn (chain), else into per-block partials that scan_reduce_kernel adds in order;
  // this block's rows of them start at row (b * blocks_per_batch + chb) * N.
  const bool partials = writes_partials(p);
  const int64_t part0 = bc_base(p, partials ? int64_t(m.b) * p.blocks_per_batch + m.chb : int64_t(m.b));
  acc_t* __restrict__ dB = block_ptr<false, kBases>(partials ? ws + w.dB_p : static_cast<acc_t*>(p.dB), part0);
  acc_t* __restrict__ dC = block_ptr<false, kBases>(partials ? ws + w.dC_p : static_cast<acc_t*>(p.dC), part0);

  // Shared memory layout (see bwd_smem_elems): one tile's channels at a time. The arrays' offsets go through
  // in_vgpr: 12 uniform LDS addresses held in scalar registers for the whole kernel were the largest use of them
  // left (see "Registers on AMD" at the top).
  constexpr int kSlots = kThreads * kNPL;  // state slots per block; slot of (thread, k) = k*kThreads + tid
  constexpr int kSegs = kThreads / kSeg;   // 32-lane segments per block
  constexpr int kRec = 4;                  // values of a (time, channel) row: dl2, dlu, u, dy
  // Row strides (smem_row; per lane on AMD, see in_vgpr: as uniform values they held scalar registers the kernel
  // lacks) and the stride of sums_o's three arrays (sums_stride).
  const int NB = bc_row_cols<kNPL>(N, G), RC = in_vgpr(smem_row(cpb)), RB = in_vgpr(smem_row(NB));
  const int RN = in_vgpr(smem_row(dbc_cols(kNPL, N, G)));
  const int TC = T * RC, TB = T * RB, TN = T * RN;
  const int TS = in_vgpr(sums_stride(T, cpb)), o = (T + 1) * kSlots;
  acc_t* smem = reinterpret_cast<acc_t*>(ss_smem_raw);
  // Rows (smem_load / smem_store) start on their own size: o is a multiple of kThreads, 4 * TC of 4, 2 * TB and
  // 2 * TN of 2.
  acc_t* hist = smem;                                        // [T+1][kSlots]: hist[j] = state after step t0+j-1
  acc_t* rec_s = smem + in_vgpr(o);                          // [T][RC][kRec]: dl2 = dl * log2(e) (dl: delta after
                                                             // bias and softplus; see ss_exp2), dlu = dl * u, u,
                                                             // dy = dL/dy = dout * silu(z)
  acc_t* BC_s = smem + in_vgpr(o + kRec * TC);               // [T][RB][2]: B, C
  acc_t* dBC_s = smem + in_vgpr(o + kRec * TC + 2 * TB);     // [kSegs][T][RN][2]: each 32-lane segment's sums of dB,
                                                             // dC over its channels of every tile
  const int o2 = o + kRec * TC + 2 * TB + 2 * kSegs * TN;
  // (softplus' apart: the lanes that finish ddl read it, rows of two steps and two channels whose 16-byte rows
  // would share a bank: 4 * (RC - 1) words apart, a multiple of 32 for RC = 9 or 17)
  acc_t* dsp_s = smem + in_vgpr(o2);                         // [T][RC]  d dl / d(delta+bias)
  acc_t* gz_s = smem + in_vgpr(o2 + TC);                     // [T][RC]  dout * silu'(z) (so dz = (y + D u) * gz)
  acc_t* sums_o = smem + in_vgpr(o2 + 2 * TC);               // [3][TS]  the sums over n of dh*B (du / dl), ddl,
                                                             // y, whose outputs the tile's epilogue finishes
  const int wseg = tid / kSeg;
  acc_t* const dBC_lane = dBC_s + 2 * (wseg * T * RN + m.lane_g);  // this lane's column of its segment's dB, dC sums
  // Where the time loops read a step's row of rec_s (this thread's channel) and B, C of the lane's slot k: from
  // pointers to the thread's columns, made once, so that a step's address is one multiply-add (sm_90: the reverse
  // step 64.0 -> 62.5 instructions, the recompute 9.8 -> 9.6). B, C that way only with one state a lane: with 8,
  // sm_80's float64 backward spilled (its 8 slots' addresses).
  const acc_t* const rec_c = rec_s + kRec * m.c_local;
  const acc_t* const BC_lane = BC_s + 2 * m.lane_g;
  // Which total of the reverse recurrence's scatter sums this lane finishes (scatter_slot; a lane constant): sum
  // `what` (0: du / dl, 1: ddl, 2: y; 3: none) of the batch's step tb - i, which goes to sum[tb * RC] (and ddl's lanes
  // read softplus' at dsp[tb * RC]).
  struct Fin {
    acc_t* sum;
    const acc_t* dsp;
    int what, i;
  };
  const auto lane_fin = [&](int slot) {
    const int i = slot < 0 ? 0 : slot / kBwdSlots, what = slot < 0 ? kBwdSlots - 1 : slot % kBwdSlots;
    const int at = m.c_local - i * RC;
    return Fin{sums_o + what * TS + at, dsp_s + at, what, i};
  };
  const auto bc_at = [&](int t, int k) {
    return kNPL == 1 ? BC_lane + 2 * t * RB : BC_s + 2 * (t * RB + k * G + m.lane_g);
  };
  const acc_t* D_l = per_lane(Dg);  // AMD: in vector registers across the chunk loop (see "Registers on AMD")

  // Pass 0: the adjoint carry leaving the segment at its first step, from a zero carry-in (the last segment: from
  // dlast), and the product of its decays, into the workspace. With n_seg > 1 segment 0's are never needed; with
  // one segment (scan_h0_grad's launch, nothing else) its carry is the initial state's gradient alone, dh0.
  // Pass 1: the full backward of the segment, starting from the carry the combine kernel computed.
  const bool carries_only = p.pass == 0;
  if (carries_only && m.seg == 0 && p.n_seg > 1) return;  // whole block

  // Slot k holds a state iff k < slots; a real one (its channel exists) iff k < the tile's ok (see vary).
  const int slots = lane_slots(p, m);
  const bool last_seg = m.seg == p.n_seg - 1;
  // The gradient reaching the segment's last step (slot 0 of this thread in tile 0 at carry_in, or zero): in
  // pass 1 what the combine kernel stored for the next segment; into the last segment, in both passes, the last
  // state's gradient. Tile g's channel is g * cpb rows further on: carry_in + g * carry_step.
  const acc_t* carry_in = (!carries_only && !last_seg) ? ws + w.seg_v + (m.bd * p.n_seg + m.seg + 1) * N + m.lane_g
                          : (last_seg && p.dlast != nullptr) ? state_slot(static_cast<const acc_t*>(p.dlast), p, m)
                                                             : nullptr;
  const int carry_step = (!carries_only && !last_seg) ? cpb * p.n_seg * N : cpb * N;
  BwdState<acc_t, kNPL, kTiles> st;
#pragma unroll
  for (int g = 0; g < kTiles; ++g) {
    const int d = m.d + g * cpb;
    const int ok = (g < p.tiles && d < p.dim) ? slots : 0;
#pragma unroll
    for (int k = 0; k < kNPL; ++k) {
      st.A[g][k] = k < ok ? Ag[int64_t(d) * N + k * G + m.lane_g] : acc_t(0);
      st.carry[g][k] = (k < ok && carry_in != nullptr) ? carry_in[g * carry_step + k * G] : acc_t(0);
      st.sum[g][k] = carries_only ? acc_t(1) : acc_t(0);
    }
    st.dD[g] = acc_t(0);
    st.dbias[g] = acc_t(0);
  }
  // This thread's tile stride of `saved` (a per-lane value, see in_vgpr), the tiles of the block with channels.
  const int saved_tile = kTiles == 1 ? 0 : in_vgpr(cpb * p.n_chunks * N);
  // The chain (step 5): this block's place among its batch row's blocks of channels (-1: no chain) and the row's
  // flags, made here and per lane on AMD (in_vgpr, per_lane): as uniform values they parked scalar registers in
  // vector lanes there, and made in step 5 from the ticket's map they cost ptxas (13.0) half an instruction a
  // reverse step on sm_90 and half of the B, C staging's loads in flight.
  const int turn = kChain ? in_vgpr(chained ? m.chb : -1) : -1;
  unsigned* const flag_row = kChain ? per_lane(chained ? p.flags + m.b * p.n_chunks : p.flags) : nullptr;
  const int tiles = kTiles == 1 ? 1 : min(p.tiles, (p.dim - m.d0 + cpb - 1) / cpb);
  // The first group of each 32-lane segment stores the segment's dB, dC sums: slots k < lead of this lane.
  int lead = (tid % kSeg) < G ? slots : 0;
  // With one state a lane and G <= 16 every lane reads what the lanes of the first group add to (the same columns,
  // G of them: dbc_cols), so that only the store is conditional: one predicated instruction, not a branch around
  // the read, the adds and the store (sm_90: 3 instructions a reverse step). Only the first group stores: a lane
  // of another storing the same value would race with the first group's reads.
  constexpr bool kEveryLaneReads = kNPL == 1 && kG <= 16;
  int lane_g = m.lane_g;  // a copy that vary() may touch

  // Addresses of the stores after the loop (see kEarlyAddresses), per tile: pass 0 the segment summary (a, b),
  // pass 1 the segment's sums of dA ([BD][S][N]), dD and ddelta_bias ([BD][S]), and in segment 0 dh0 (d; null
  // when not asked for); null for a tile without this thread's channel.
  const auto out_addrs = [&](int g) {
    const WsLayout wl = ws_layout(p);
    acc_t* wsp = static_cast<acc_t*>(p.ws);
    const int64_t bd = m.bd + g * cpb;
    OutAddrs<acc_t> r{nullptr, nullptr, nullptr, nullptr};
    if (g >= p.tiles || m.d + g * cpb >= p.dim) return r;
    const int64_t row = (bd * p.n_seg + m.seg) * N + m.lane_g;  // of [BD][S][N]
    r.a = per_lane(wsp + (carries_only ? wl.seg_v : wl.dA_p) + row);
    r.b = per_lane(carries_only ? wsp + wl.seg_P + row : wsp + wl.dD_p + bd * p.n_seg + m.seg);
    r.c = per_lane(wsp + wl.dbias_p + bd * p.n_seg + m.seg);
    // (segment 0 is the one that starts at chunk 0)
    r.d = (!carries_only && m.c_begin == 0 && p.dh0 != nullptr)
              ? per_lane(static_cast<acc_t*>(p.dh0) + bd * N + m.lane_g) : nullptr;
    return r;
  };
  OutAddrs<acc_t> tail[kTiles];
  if (kEarlyAddresses) {
#pragma unroll
    for (int g = 0; g < kTiles; ++g) tail[g] = out_addrs(g);
  }

  for (int c = m.c_end - 1; c >= m.c_begin; --c) {
    const int t0 = c * T;
    const int len = min(T, L - t0);

    // The previous (later) chunk's epilogue must be done with the shared arrays before they are restaged.
    __syncthreads();

    // ---- 1. stage the chunk's B and C, which every tile uses (zeros outside the sequence), in rounds (StageRound)
    constexpr int kBC = StageItems<input_t, kNPL, kG>::bwd_state;
    for (int i = tid; i < NB * T; i += kBC * kThreads) {
      const StageAt at(p, i, t0, len);
      const auto bc_in = [&](int n) { return n < N && at.in_seq; };  // (zeros for the lanes n >= N: see bc_cols)
      const auto bc_fetch = [&](int n, BCInputs<input_t>& v) {
        const int64_t off = blk_at<kBases>(p, bc0, n, at.ts);
        v.B = Bg[off];
        v.C = Cg[off];
      };
      StageRound<BCInputs<input_t>, kBC> bc_r;
      bc_r.load(at.row, at.R, bc_in, bc_fetch);
      bc_r.use(at.row, at.R, NB, bc_in, bc_fetch, [&](int n, auto get, bool inside) {
        stage_bc<acc_t, input_t>(BC_s + 2 * (at.t * RB + n), get, inside);
      });
    }

#pragma unroll 1  // one body for every tile (rotate() brings each one's state to set 0)
    for (int g = 0; g < kTiles; ++g) {
      const int row0 = g * cpb;  // the tile's first row among the block's channel rows
      if (kTiles == 1 || g < tiles) {  // uniform over the block
        int ok = m.d + row0 < p.dim ? slots : 0;
        vary(ok);
        // The previous tile's epilogue must be done with the channel arrays (tiles with channels come first).
        if (g > 0) __syncthreads();

        // ---- 1. stage the tile's channels for the chunk (zeros outside the sequence and for channels past dim),
        // in rounds (StageRound)
        constexpr int kRows = StageItems<input_t, kNPL, kG>::bwd_channel;
        for (int i = tid; i < cpb * T; i += kRows * kThreads) {
          const StageAt at(p, i, t0, len);
          const auto row_in = [&](int cl) { return cl < cpb && m.d0 + row0 + cl < p.dim && at.in_seq; };
          const auto row_fetch = [&](int cl, BwdInputs<input_t, acc_t>& v) {
            const int64_t off = blk_at<kBases>(p, rows0, row0 + cl, at.ts);
            v.u = u[off];
            v.delta = delta[off];
            v.dout = dout[off];
            if (z != nullptr) v.z = z[off];
            if (bias != nullptr) v.bias = bias[m.d0 + row0 + cl];
          };
          StageRound<BwdInputs<input_t, acc_t>, kRows> r_in;
          r_in.load(at.row, at.R, row_in, row_fetch);
          r_in.use(at.row, at.R, cpb, row_in, row_fetch, [&](int cl, auto get, bool inside) {
            acc_t uv = acc_t(0), dl = acc_t(0), dsp = acc_t(0), dy = acc_t(0), gz = acc_t(0);
            if (inside) {
              const BwdInputs<input_t, acc_t> v = get();
              uv = to_acc(v.u);
              acc_t raw = to_acc(v.delta);
              if (bias != nullptr) raw += v.bias;
              dl = p.softplus ? softplus(raw) : raw;
              dsp = p.softplus ? softplus_grad(raw) : acc_t(1);
              const acc_t gv = to_acc(v.dout);
              if (z != nullptr) {
                const acc_t zv = to_acc(v.z);
                const acc_t sg = sigmoid(zv);
                dy = gv * zv * sg;                                 // dout * silu(z)
                gz = gv * sg * (acc_t(1) + zv * (acc_t(1) - sg));  // dout * silu'(z)
              } else {
                dy = gv;
              }
            }
            const int s = at.t * RC + cl;
            const acc_t row[kRec] = {dl * log2e<acc_t>(), dl * uv, uv, dy};
            smem_store(rec_s + kRec * s, row);
            dsp_s[s] = dsp;
            gz_s[s] = gz;
          });
        }
        __syncthreads();

        // ---- 2. pass 0: the adjoint recurrence alone, no states, no sums over n
        if (carries_only) {
          for (int t = len - 1; t >= 0; --t) {
            vary(ok);
            acc_t r[kRec];
            smem_load(rec_c + kRec * RC * t, r);
            const acc_t dl2 = r[0], dy = r[3];
#pragma unroll
            for (int k = 0; k < kNPL; ++k) {
              if (computes<kNPL>(k, ok)) {
                const acc_t a = ss_exp2(dl2 * st.A[0][k]);
                acc_t bc[2];  // (the pair, not C alone: with G = 32 a warp's C alone hit each bank twice)
                smem_load(bc_at(t, k), bc);
                st.carry[0][k] = a * (st.carry[0][k] + bc[1] * dy);
                st.sum[0][k] *= a;
              }
            }
          }
        } else {
          // ---- 2. recompute the tile's states over the chunk from the stored start state, with the same
          // operations as the forward. Each thread only touches its own history slots, so no barrier is needed
          // before step 3. h_hi: the state after the step that step 3 takes next, kept in registers (each step's
          // h_t is the previous step's h_{t-1}: one history read a step instead of two).
          acc_t h_hi[kNPL];
          {
            const acc_t* saved_g = kTiles == 1 ? saved_t : saved_t + int64_t(g) * saved_tile;
            acc_t h[kNPL];
#pragma unroll
            for (int k = 0; k < kNPL; ++k) {
              h[k] = k < ok ? saved_g[c * N + k * G] : acc_t(0);
              hist[k * kThreads + tid] = h[k];
            }
            // (with one state a lane 16 steps a pass: nvcc's own choice there, 4, issued 12.0 instructions a step
            // on sm_90 against 9.8, once the B, C rows were a constant)
            SS_NV_UNROLL((kNPL == 1 ? 16 : 4))
            for (int t = 0; t < len; ++t) {
              vary(ok);
              acc_t r[2];  // dl2, dlu
              smem_load(rec_c + kRec * RC * t, r);
              const acc_t dl2 = r[0], dlu = r[1];
#pragma unroll
              for (int k = 0; k < kNPL; ++k) {
                if (computes<kNPL>(k, ok)) {
                  acc_t bc[2];  // (the pair, not B alone: with G = 32 a warp's B alone hit each bank twice)
                  smem_load(bc_at(t, k), bc);
                  h[k] = ss_exp2(dl2 * st.A[0][k]) * h[k] + dlu * bc[0];
                }
                hist[(t + 1) * kSlots + k * kThreads + tid] = h[k];
              }
            }
#pragma unroll
            for (int k = 0; k < kNPL; ++k) h_hi[k] = h[k];  // the state after the chunk's last step
          }

          // ---- 3. reverse recurrence over the chunk. One step at scan step t, giving this lane's parts of the
          // sums over n of y, ddl and dh*B (du / dl).
          struct Parts {
            acc_t y, ddl, du;
          };
          // With one state a lane, the rows of a batch's first step (t = tb) of rec_s and of B and C, walked back a
          // batch at a time; a batch's steps lie at constant offsets from them (sm_90: the reverse step 51.5 ->
          // 50.0 instructions; computed from tb, each address was a multiply-add and a shift-add a batch. The rows
          // of the history and of the dB, dC sums walked as well: 49.5, but with G = 32 ptxas spilled a register;
          // rec_s's walked with 8 states a lane, sm_80's float64 backward spilled two).
          const acc_t* rec_b = rec_c + kRec * RC * (len - 1);
          const acc_t* bc_b = bc_at(len - 1, 0);
          // Step t, the batch's step i (t = tb - i).
          const auto step = [&](int t, int i) {
            vary(ok);
            vary(lead);
            vary(lane_g);
            acc_t r[kRec];
            smem_load(kNPL == 1 ? rec_b - i * kRec * RC : rec_c + kRec * RC * t, r);
            const acc_t dl2 = r[0], dlu = r[1], uv = r[2], dy = r[3];
            // This lane's part of the sums over n. The terms the step's gradients share are factored out of the
            // sums (the multiplies of a (state, step) are the FMA pipe's work; sm_90: the reverse step 55.5 -> 51.5
            // instructions with ss_exp2): du = dl * sum dh*B (dl applied in the finish), ddl = sum A*g + u * sum
            // dh*B, dA = ln 2 * sum dl2*g (ln 2 applied in the store), with g = exp(dl A) * dh * h_{t-1}, of which
            // the carry exp(dl A) * dh is made anyway.
            acc_t y_p = acc_t(0), ddl_p = acc_t(0), sb_p = acc_t(0);
#pragma unroll
            for (int k = 0; k < kNPL; ++k) {
              acc_t dB_v = acc_t(0), dC_v = acc_t(0);
              if (computes<kNPL>(k, ok)) {
                acc_t bc[2];
                smem_load(kNPL == 1 ? bc_b - 2 * i * RB : bc_at(t, k), bc);
                const acc_t Bv = bc[0], Cv = bc[1];
                const acc_t h_prev = hist[t * kSlots + k * kThreads + tid];
                const acc_t h_cur = h_hi[k];  // the history's entry t + 1 (steps run t = len-1 .. 0)
                h_hi[k] = h_prev;
                const acc_t a = ss_exp2(dl2 * st.A[0][k]);
                const acc_t dh = st.carry[0][k] + Cv * dy;  // total gradient of h_t
                y_p += h_cur * Cv;
                dB_v = dh * dlu;
                dC_v = h_cur * dy;
                st.carry[0][k] = a * dh;
                const acc_t g_h = st.carry[0][k] * h_prev;
                st.sum[0][k] += dl2 * g_h;
                ddl_p += st.A[0][k] * g_h;
                sb_p += dh * Bv;
              }
              // Sum dB, dC over the channels sharing this 32-lane segment (lanes with the same lane_g); the
              // segment's first group keeps them, adding tile after tile (one writer per entry, tiles in order;
              // the epilogue adds the segments in order).
              for (int off = G; off < kSeg; off <<= 1) {
                dB_v += shfl_xor(dB_v, off);
                dC_v += shfl_xor(dC_v, off);
              }
              if (kEveryLaneReads || k < lead) {
                acc_t* e = dBC_lane + 2 * (t * RN + k * G);
                acc_t dbc[2] = {dB_v, dC_v};
                if (kTiles > 1 && g > 0) {
                  // With every lane reading, the other groups' lanes read e while the first group's store it: they
                  // discard what they read (only k < lead stores), so the race is harmless and saves a branch.
                  acc_t before[2];
                  smem_load(e, before);  // benign race within a warp (above)
                  dbc[0] = before[0] + dB_v;
                  dbc[1] = before[1] + dC_v;
                }
                if (k < lead) smem_store(e, dbc);
              }
            }
            if (lane_g == 0) st.dD[0] += dy * uv;
            return Parts{y_p, ddl_p + uv * sb_p, sb_p};
          };
          // The sums of kSteps steps at once, in one scatter sum: its lane of slot j finishes sum j % kBwdSlots of
          // step j / kBwdSlots of the batch, steps tb, tb - 1, ..; a batch of fewer steps (`steps`) leaves the
          // others' slots zero.
          constexpr int kSteps = kSums / kBwdSlots;
          // Where this lane's totals go: made once a chunk with one state a lane (in the loop, their addresses cost
          // ptxas 2.5 instructions a step on sm_90), in each batch with more (kept across the loop, they took
          // sm_90's scan_bwd<fp64,npl4> from 128 to 136 registers, a block an SM fewer).
          const Fin fin_chunk = kNPL == 1 ? lane_fin(scatter_slot<kSums>(G, m.lane_g)) : Fin{};
          const auto batch = [&](int tb, int steps) {
            acc_t sums[kSums];
#pragma unroll
            for (int i = 0; i < kSteps; ++i) {
              const Parts r = i < steps ? step(tb - i, i) : Parts{acc_t(0), acc_t(0), acc_t(0)};
              sums[i * kBwdSlots] = r.du;
              sums[i * kBwdSlots + 1] = r.ddl;
              sums[i * kBwdSlots + 2] = r.y;
              sums[i * kBwdSlots + 3] = acc_t(0);
            }
            int j;
            const acc_t v = scatter_sum<kNPL == 1>(sums, G, lane_g, j);
            // This lane's total into sums_o for the epilogue; the lanes of ddl's also add the step's ddelta to
            // ddelta_bias.
            Fin f = kNPL == 1 ? fin_chunk : lane_fin(j);
            vary(f.what);
            if (f.what < 3 && f.i < steps) {
              f.sum[tb * RC] = v;
              if (f.what == 1) st.dbias[0] += v * f.dsp[tb * RC];
            }
            rec_b -= kSteps * kRec * RC;
            bc_b -= kSteps * 2 * RB;
          };
          // Full batches without a guard around their steps (kSteps, a constant), then the chunk's first steps
          // that do not fill one (an odd chunk length: the last chunk of an odd sequence).
          int tb = len - 1;
          for (; tb >= kSteps - 1; tb -= kSteps) batch(tb, kSteps);
          if (tb >= 0) batch(tb, tb + 1);
          __syncthreads();  // the tile's outputs complete (and dBC_s after the last tile)

          // ---- 4. finish the tile's gradients for the chunk from the sums over n, and write them, coalesced:
          // du = dl * sum + D dy, ddelta = sum * softplus', dz = (y + D u) * dout * silu'(z); in rounds
          // (StageRound: D)
          for (int i = tid; i < cpb * T; i += kRows * kThreads) {
            const StageAt at(p, i, t0, len);
            const auto row_in = [&](int cl) { return cl < cpb && m.d0 + row0 + cl < p.dim && at.in_seq; };
            const auto D_fetch = [&](int cl, acc_t& D) { D = D_l != nullptr ? D_l[m.d0 + row0 + cl] : acc_t(0); };
            StageRound<acc_t, kRows> D_r;
            D_r.load(at.row, at.R, row_in, D_fetch);
            D_r.use(at.row, at.R, cpb, row_in, D_fetch, [&](int cl, auto get, bool inside) {
              if (!inside) return;
              const int64_t off = blk_at<kBases>(p, rows0, row0 + cl, at.ts);
              const int s = at.t * RC + cl;
              acc_t r[kRec];  // dl2, dlu, u, dy
              smem_load(rec_s + kRec * s, r);
              const acc_t D_d = get();
              store_from_acc(du + off, sums_o[s] * (r[0] * ln2<acc_t>()) + D_d * r[3]);
              store_from_acc(ddelta + off, sums_o[TS + s] * dsp_s[s]);
              if (z != nullptr) store_from_acc(dz + off, (sums_o[2 * TS + s] + D_d * r[2]) * gz_s[s]);  // null iff z
            });
          }
        }
      }
      st.rotate();
    }
    if (carries_only) continue;  // uniform over the block; the next chunk starts with a barrier

    // ---- 5. the chunk's dB, dC: each (b, n, time) belongs to one segment, so to exactly one block of this row,
    // or in a chain to the row's blocks of channels in turn, each adding its sums to what the ones before stored
    const bool adds = turn > 0;  // (uniform over the block)
    if (adds) chain_wait(flag_row + c, unsigned(turn));  // (turn > 0 here: the conversion keeps its value)
    for (int i = tid; i < N * T; i += kThreads) {
      const int n = i >> p.chunk_log2, t = i & (T - 1);
      if (t < len) {
        const int64_t off = blk_at<kBases>(p, part0, n, p.time(t0 + t));
        // what the blocks before stored (chain; else nothing): the order of scan_reduce_kernel's sums, and the same
        // bits for a block that adds nothing (0 + the block's sum, which is never -0, is that sum)
        const acc_t before_b = adds ? load_fresh(dB + off) : acc_t(0);
        const acc_t before_c = adds ? load_fresh(dC + off) : acc_t(0);
        acc_t sb = acc_t(0), sc = acc_t(0);
        for (int j = 0; j < kSegs; ++j) {
          acc_t v[2];
          smem_load(dBC_s + 2 * ((j * T + t) * RN + n), v);
          sb += v[0];
          sc += v[1];
        }
        dB[off] = before_b + sb;
        dC[off] = before_c + sc;
      }
    }
    if (turn >= 0 && turn + 1 < p.blocks_per_batch) chain_release(flag_row + c, turn + 1);
  }

  // ---- 6. after the chunks: the segment's sums and stores.
  // ddelta_bias was summed on the lanes that finished ddl (see finish): add them up, every lane taking part.
  if (!carries_only) {  // uniform over the block
#pragma unroll
    for (int g = 0; g < kTiles; ++g) st.dbias[g] = group_sum(st.dbias[g], G);
  }
#pragma unroll
  for (int g = 0; g < kTiles; ++g) {
    if (!kEarlyAddresses) tail[g] = out_addrs(g);
    if (tail[g].a == nullptr) continue;  // no channel of this thread in the tile
    if (carries_only) {
      store_segment_summary<acc_t, kNPL>(G, slots, tail[g].a, tail[g].b, st.carry[g], st.sum[g]);
      continue;
    }
    // Parameters' gradients: this segment's sums over time; scan_reduce_kernel adds segments and batch in order.
    // In segment 0 the carry is now exp(dl_0 A) dh_0, the gradient of the state before the first step: dh0.
#pragma unroll
    for (int k = 0; k < kNPL; ++k) {
      if (k < slots) {
        tail[g].a[k * G] = st.sum[g][k] * ln2<acc_t>();  // (summed as dA / ln 2: see the reverse step)
        if (tail[g].d != nullptr) tail[g].d[k * G] = st.carry[g][k];
      }
    }
    if (m.lane_g == 0) {
      *tail[g].b = st.dD[g];
      *tail[g].c = st.dbias[g];
    }
  }
}

// ------------------------------------------------------------------ combine and reduce --------------------

// The sequential middle pass of the chunked scan: one thread per (b, d, n) walks the segments in order, so the
// result is the same bits on every run. pass 0 (forward): H_0 = 0, H_{s+1} = P_s H_s + h_s (h_s the segment's
// end state from a zero start); stores H_{s+1}, the state at the start of segment s+1, as the checkpoint
// before that segment's first chunk. pass 1 (backward): X_{S-1} = 0 is the carry into the last segment;
// X_{s-1} = P_s X_s + x_s (x_s the carry leaving segment s from a zero carry-in); stores X_{s-1} over x_s, where
// segment s-1 reads it.
template <typename acc_t>
__global__ void SS_LAUNCH_BOUNDS scan_combine_kernel(const KernelParams p) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int N = p.dstate;
  if (i >= int64_t(p.batch) * p.dim * N) return;  // no barriers or shuffles in this kernel
  const int n = int(i % N);
  const int64_t bd = i / N;
  acc_t* ws = static_cast<acc_t*>(p.ws);
  const WsLayout w = ws_layout(p);
  acc_t* v = ws + w.seg_v + bd * p.n_seg * N + n;  // segment s at v[s * N]
  const acc_t* P = ws + w.seg_P + bd * p.n_seg * N + n;
  if (p.pass == 0) {
    acc_t* saved = static_cast<acc_t*>(p.saved);
    acc_t H = acc_t(0);
    for (int s = 0; s + 1 < p.n_seg; ++s) {
      H = P[int64_t(s) * N] * H + v[int64_t(s) * N];
      saved[(bd * p.n_chunks + int64_t(s + 1) * p.seg_chunks) * N + n] = H;
    }
  } else {
    acc_t X = acc_t(0);
    for (int s = p.n_seg - 1; s >= 1; --s) {
      X = P[int64_t(s) * N] * X + v[int64_t(s) * N];
      v[int64_t(s) * N] = X;
    }
  }
}

// Ordered sums of the backward's partials (no float atomics, so the same bits on every run): one thread per output
// element of dA (dim, N), dD (dim), ddelta_bias (dim), and when several blocks share a batch row without a chain,
// dB and dC (batch, N, L). Each sums over batch then segments, or over blocks of channels, in index order.
template <typename acc_t>
__global__ void SS_LAUNCH_BOUNDS scan_reduce_kernel(const KernelParams p) {
  const int64_t i0 = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int N = p.dstate, S = p.n_seg, NC = p.blocks_per_batch;
  const acc_t* ws = static_cast<const acc_t*>(p.ws);
  const WsLayout w = ws_layout(p);
  const int64_t nA = int64_t(p.dim) * N, nBC = writes_partials(p) ? int64_t(p.batch) * N * p.seqlen : 0;
  int64_t i = i0;
  if (i < nA) {
    const int64_t d = i / N, n = i % N;
    acc_t sum = acc_t(0);
    for (int b = 0; b < p.batch; ++b)
      for (int s = 0; s < S; ++s) sum += ws[w.dA_p + ((int64_t(b) * p.dim + d) * S + s) * N + n];
    static_cast<acc_t*>(p.dA)[i] = sum;
    return;
  }
  i -= nA;
  if (i < 2 * int64_t(p.dim)) {
    const bool is_D = i < p.dim;
    const int64_t d = is_D ? i : i - p.dim;
    acc_t* dst = static_cast<acc_t*>(is_D ? p.dD : p.ddelta_bias);
    if (dst == nullptr) return;
    const int64_t base = is_D ? w.dD_p : w.dbias_p;
    acc_t sum = acc_t(0);
    for (int b = 0; b < p.batch; ++b)
      for (int s = 0; s < S; ++s) sum += ws[base + (int64_t(b) * p.dim + d) * S + s];
    dst[d] = sum;
    return;
  }
  i -= 2 * int64_t(p.dim);
  if (i < 2 * nBC) {
    const bool is_B = i < nBC;
    const int64_t j = is_B ? i : i - nBC;  // (b, n, l)
    const int64_t L = p.seqlen, b = j / (int64_t(N) * L), nl = j % (int64_t(N) * L);
    const acc_t* src = ws + (is_B ? w.dB_p : w.dC_p);
    acc_t sum = acc_t(0);
    for (int c = 0; c < NC; ++c) sum += src[((b * NC + c) * N) * L + nl];
    static_cast<acc_t*>(is_B ? p.dB : p.dC)[j] = sum;
  }
}

// Threads the reduce kernel needs.
__host__ __device__ inline int64_t reduce_elems(const KernelParams& p) {
  const int64_t nBC = writes_partials(p) ? int64_t(p.batch) * p.dstate * p.seqlen : 0;
  return int64_t(p.dim) * p.dstate + 2 * int64_t(p.dim) + 2 * nBC;
}

}  // namespace ssk
