// Device code of the depthwise causal conv1d, forward and backward: the first op of every Mamba branch.
//
//   c[b,d,t] = bias[d] + sum_k w[d,k] * x[b,d,t-(K-1)+k]          (x = 0 before t = 0), K = width <= kMaxWidth
//
// Reverse mode (Vim's backward direction) is the conv of the time-reversed sequence in the original order,
// c[t] = bias + sum_k w[k] * x[t+(K-1)-k]: as in the scan, the kernels walk steps s = 0, 1, ... and read and write
// time p.time(s) = L-1-s, so no flipped copies are made and the arithmetic is that of the flipped computation.
//
// Why a kernel of its own rather than PyTorch's conv (cuDNN / MIOpen): a grouped conv with one channel per group
// has no tensor-core path, PyTorch pads the sequence and writes L+K-1 outputs a row that the branch then slices
// and copies, and the backward pads dout again and takes the weight gradient through the generic grouped
// algorithms (issue 51, item 5). Here each element of x and of dout is read once and each output written once.
//
// Work mapping: a block of kThreads threads owns one tile of p.tile consecutive steps of one row (b, d), p.n_tiles
// tiles a row (the launcher sizes them so that a row's tiles are about equal). It stages the tile's x (with the
// K-1 steps before it) and, backward, dout (with the K-1 steps after it) in shared memory with coalesced loads,
// converted to the accumulation type; then each thread computes the steps i = threadIdx.x + j * kThreads.
//
// With p.silu the kernels fuse the branch's SiLU: the forward writes u = silu(c) instead of c, and the backward
// takes du (the gradient of u) and recomputes c from x to turn it into dc = du * silu'(c), the dout below. c is
// never written or read back: per branch 2 passes over (batch, d, L) fewer forward and 5 in the backward (its
// recompute and the SiLU's gradient pass). Its x tile then reaches K-1 steps further, to the last c it needs.
//
// Backward: dx[s] = sum_k w[k] * dout[s+(K-1)-k] (dout = 0 past the end); dw[k] = sum over rows of the batch and
// steps of dout[s] * x[s-(K-1)+k]; dbias = sum of dout. Each block sums its tile's K + 1 weight terms in a fixed
// tree over its threads (shared memory, no shuffles: the same order on 32- and 64-lane hardware) and stores them
// as one partial; conv_reduce_kernel then sums each channel's partials over batch and tiles in index order. No
// atomics, so the same inputs give the same bits run after run (as the scan's backward).
//
// Accumulation in float (double for double input); the weights and bias come in the accumulation type, as for
// the CPU kernel (csrc/causal_conv1d_cpu.cpp), whose arithmetic per output is the same: bias, then the taps in
// order k = 0 .. K-1.
#pragma once

#include "selective_scan_kernel.cuh"  // the compat layer: load_acc, store_from_acc, AccType, kThreads, launch bounds

namespace ssk {

// Widest conv the kernels take (Mamba and Vim use 4).
constexpr int kMaxWidth = 8;
// Longest tile: kConvItems steps a thread.
constexpr int kConvItems = 4;
constexpr int kMaxConvTile = kConvItems * kThreads;

struct ConvParams {
  int batch, dim, seqlen, width;
  int tile;     // steps a block owns (<= kMaxConvTile)
  int n_tiles;  // tiles a row: ceil(seqlen / tile)
  bool reverse;
  bool silu;               // fused SiLU: forward out = silu(c); backward dout is d silu(c) (see above)
  bool accumulate;         // backward: dx += the input gradient (each element read and written once)
  int64_t x_batch_stride;  // elements between batch rows of x (x may be a channel slice of a wider tensor)
  const void* x;           // (batch, dim, seqlen) rows contiguous, input type
  const void* w;           // (dim, width), accumulation type
  const void* bias;        // (dim,), accumulation type, or null
  const void* dout;        // backward: (batch, dim, seqlen) contiguous, input type (with silu: du)
  void* out;               // forward: (batch, dim, seqlen) contiguous, input type (with silu: u)
  void* dx;                // backward: as out
  void* dw;                // backward: (dim, width), accumulation type
  void* dbias;             // backward: (dim,), accumulation type, or null
  void* ws;                // backward: dim * batch * n_tiles * (width + 1) accumulation values (conv_partial_index)

  __host__ __device__ int time(int s) const { return reverse ? seqlen - 1 - s : s; }
};

// Steps of x a block stages: its tile and the K-1 steps before it; the backward with silu also the K-1 after it.
__host__ __device__ inline int conv_x_steps(const ConvParams& p, bool backward) {
  return p.tile + (p.width - 1) * (backward && p.silu ? 2 : 1);
}

// Shared memory a block uses, in accumulation-type elements: x (conv_x_steps); backward also dout of the tile and
// the K-1 steps after it, and K+1 sums a thread. Dynamic shared memory (ss_smem_raw), as the scan's, so the kernel
// emulator sees it as block-wide memory that starts as NaN.
__host__ __device__ inline int conv_smem_elems(const ConvParams& p, bool backward) {
  const int xs = conv_x_steps(p, backward);
  return backward ? xs + p.tile + p.width - 1 + (p.width + 1) * kThreads : xs;
}

// c of step s0 + i from the staged x (xs[j]: step s0 - (K-1) + j): bias, then the taps in order.
template <typename acc_t>
__device__ __forceinline__ acc_t conv_at(const acc_t (&w)[kMaxWidth], int K, acc_t bias, const acc_t* xs, int i) {
  acc_t c = bias;
#pragma unroll
  for (int k = 0; k < kMaxWidth; ++k)
    if (k < K) c += w[k] * xs[i + k];
  return c;
}

// Where the backward block of row (b, d) and tile `tile` stores its partial of weight term k (k == width: dbias):
// a channel's partials are consecutive, batch then tile, so the reduction walks them in that order.
__host__ __device__ inline int64_t conv_partial_index(const ConvParams& p, int b, int d, int tile, int k) {
  return ((int64_t(d) * p.batch + b) * p.n_tiles + tile) * (p.width + 1) + k;
}

// The block's row, first step and the row's offsets (x's, and the contiguous outputs').
struct ConvTile {
  int b, d, s0;
  int64_t x_row, row;
};
__device__ __forceinline__ ConvTile conv_tile(const ConvParams& p) {
  ConvTile t;
  const int row = int(blockIdx.x / unsigned(p.n_tiles));
  t.s0 = int(blockIdx.x % unsigned(p.n_tiles)) * p.tile;
  t.b = row / p.dim;
  t.d = row % p.dim;
  t.x_row = t.b * p.x_batch_stride + int64_t(t.d) * p.seqlen;
  t.row = int64_t(row) * p.seqlen;
  return t;
}

// Stage steps first .. first + count - 1 of a row into shared memory, zero outside 0 .. seqlen - 1.
template <typename input_t, typename acc_t>
__device__ __forceinline__ void conv_stage(const ConvParams& p, const input_t* row, int first, int count,
                                           acc_t* dst) {
  for (int i = threadIdx.x; i < count; i += kThreads) {
    const int s = first + i;
    dst[i] = (s >= 0 && s < p.seqlen) ? acc_t(load_acc(row + p.time(s))) : acc_t(0);
  }
}

template <typename input_t>
__global__ void SS_LAUNCH_BOUNDS conv_fwd_kernel(const ConvParams p) {
  using acc_t = typename AccType<input_t>::type;
  acc_t* xs = reinterpret_cast<acc_t*>(ss_smem_raw);  // x at steps s0-(K-1) .. s0+tile-1
  const ConvTile t = conv_tile(p);
  const int K = p.width;
  conv_stage(p, static_cast<const input_t*>(p.x) + t.x_row, t.s0 - (K - 1), p.tile + K - 1, xs);
  acc_t w[kMaxWidth];
  const acc_t* wrow = static_cast<const acc_t*>(p.w) + int64_t(t.d) * K;
#pragma unroll
  for (int k = 0; k < kMaxWidth; ++k) w[k] = k < K ? wrow[k] : acc_t(0);
  const acc_t bias = p.bias ? static_cast<const acc_t*>(p.bias)[t.d] : acc_t(0);
  __syncthreads();
  input_t* out = static_cast<input_t*>(p.out) + t.row;
  for (int i = threadIdx.x; i < p.tile && t.s0 + i < p.seqlen; i += kThreads) {
    const acc_t c = conv_at(w, K, bias, xs, i);
    store_from_acc(out + p.time(t.s0 + i), p.silu ? c * sigmoid(c) : c);
  }
}

template <typename input_t>
__global__ void SS_LAUNCH_BOUNDS conv_bwd_kernel(const ConvParams p) {
  using acc_t = typename AccType<input_t>::type;
  const ConvTile t = conv_tile(p);
  const int K = p.width;
  acc_t* xs = reinterpret_cast<acc_t*>(ss_smem_raw);  // x from step s0-(K-1) (conv_x_steps)
  acc_t* gs = xs + conv_x_steps(p, true);              // dout at steps s0 .. s0+tile+K-2
  acc_t* sums = gs + p.tile + K - 1;                   // each thread's K+1 weight terms, then the tree's
  conv_stage(p, static_cast<const input_t*>(p.x) + t.x_row, t.s0 - (K - 1), conv_x_steps(p, true), xs);
  conv_stage(p, static_cast<const input_t*>(p.dout) + t.row, t.s0, p.tile + K - 1, gs);
  acc_t w[kMaxWidth], part[kMaxWidth], gsum = acc_t(0);  // part: the tile's dw terms, gsum: its dbias term
  const acc_t* wrow = static_cast<const acc_t*>(p.w) + int64_t(t.d) * K;
#pragma unroll
  for (int k = 0; k < kMaxWidth; ++k) {
    w[k] = k < K ? wrow[k] : acc_t(0);
    part[k] = acc_t(0);
  }
  __syncthreads();
  if (p.silu) {  // dout = du -> dc = du * silu'(c), c recomputed (0 past the end stays 0)
    const acc_t bias = p.bias ? static_cast<const acc_t*>(p.bias)[t.d] : acc_t(0);
    for (int i = threadIdx.x; i < p.tile + K - 1; i += kThreads) {
      const acc_t c = conv_at(w, K, bias, xs, i), sg = sigmoid(c);
      gs[i] *= sg * (acc_t(1) + c * (acc_t(1) - sg));
    }
    __syncthreads();
  }
  input_t* dx = static_cast<input_t*>(p.dx) + t.row;
  for (int i = threadIdx.x; i < p.tile && t.s0 + i < p.seqlen; i += kThreads) {
    acc_t g = acc_t(0);
#pragma unroll
    for (int k = 0; k < kMaxWidth; ++k)
      if (k < K) g += w[k] * gs[i + K - 1 - k];
    if (p.accumulate) g += acc_t(load_acc(dx + p.time(t.s0 + i)));
    store_from_acc(dx + p.time(t.s0 + i), g);
    const acc_t go = gs[i];
#pragma unroll
    for (int k = 0; k < kMaxWidth; ++k)
      if (k < K) part[k] += go * xs[i + k];
    gsum += go;
  }
  // The block's sum of each term: a halving tree over the threads, the same order on any hardware.
#pragma unroll
  for (int k = 0; k < kMaxWidth; ++k)
    if (k < K) sums[k * kThreads + threadIdx.x] = part[k];
  sums[K * kThreads + threadIdx.x] = gsum;
  for (int half = kThreads / 2; half > 0; half /= 2) {
    __syncthreads();
    if (int(threadIdx.x) < half)
      for (int k = 0; k <= K; ++k) sums[k * kThreads + threadIdx.x] += sums[k * kThreads + threadIdx.x + half];
  }
  __syncthreads();
  if (int(threadIdx.x) <= K) {
    acc_t* ws = static_cast<acc_t*>(p.ws);
    ws[conv_partial_index(p, t.b, t.d, t.s0 / p.tile, threadIdx.x)] = sums[threadIdx.x * kThreads];
  }
}

// One thread per weight term (d, k), k == width for dbias: the block partials summed over batch, then tiles, in
// index order.
template <typename acc_t>
__global__ void SS_LAUNCH_BOUNDS conv_reduce_kernel(const ConvParams p) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int terms = p.width + 1;
  if (i >= int64_t(p.dim) * terms) return;
  const int d = int(i / terms), k = int(i % terms);
  if (k == p.width && p.dbias == nullptr) return;
  const acc_t* ws = static_cast<const acc_t*>(p.ws);
  acc_t sum = acc_t(0);
  for (int b = 0; b < p.batch; ++b)
    for (int tile = 0; tile < p.n_tiles; ++tile) sum += ws[conv_partial_index(p, b, d, tile, k)];
  if (k < p.width)
    static_cast<acc_t*>(p.dw)[int64_t(d) * p.width + k] = sum;
  else
    static_cast<acc_t*>(p.dbias)[d] = sum;
}

}  // namespace ssk
