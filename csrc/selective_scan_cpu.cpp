// CPU selective scan: forward and backward of the recurrence in csrc/README.md.
//
// How the work is laid out
//   * One (batch b, channel d) pair is one independent scan over time with a state vector of d_state (N)
//     values. All of the math is in the per-channel routines: `ssm_forward` / `ssm_backward` for the recurrence,
//     `scan_channel_fwd` / `scan_channel_bwd` around them for softplus, the D skip term and the silu gate.
//     Everything else is plumbing (dtype conversion, threading, sums over channels and batch).
//   * The loops over the state index n are written with GCC/Clang vector extensions rather than left to the
//     auto-vectoriser (which, without fast-math flags, gives up on the selects in exp and softplus). The state
//     dimension is zero-padded to NP, a multiple of 16 floats / 8 doubles: padded lanes have A = B = C = 0, so
//     their state stays 0 and they add nothing. B and C are transposed once to (batch, L, NP) in the
//     accumulation type so that these loops read contiguous memory. Each pass over time handles 16 floats /
//     8 doubles of state, held in registers (N = 16 in Vision Mamba: one pass).
//   * The backward recomputes the forward states of its channel into a thread-local L x NP buffer (cheap next
//     to the reverse pass) instead of saving anything from the forward, so `saved` is an empty tensor.
//   * Threads split the (batch, channel) pairs with at::parallel_for, so torch.set_num_threads applies.
//     Quantities summed over channels (dB, dC) or over the batch (dA, dD, ddelta_bias) go into partial buffers
//     that belong to a fixed work item, never to a thread, and are added up in a fixed order at the end: results
//     are bitwise reproducible and do not depend on the number of threads.
//   * Reverse mode (`reverse`, Vim's backward direction): the scan runs from t = L-1 down to 0. Rows are loaded
//     into the per-thread workspace back to front and stored front to back (load_row / store_row), and B, C are
//     transposed in reversed time order by `prepare`; the math between is untouched, so the result is bitwise the
//     one of flipping every time-indexed input and output, without those copies.
//   * Vector width follows the instruction set: on x86-64 the code is compiled three times, with 64-byte vectors
//     for AVX-512, 32-byte vectors for AVX2+FMA and 16-byte vectors for baseline SSE2, and the widest variant the
//     CPU has is picked at run time (the binary must not require AVX2). Elsewhere (aarch64: NEON) it is compiled
//     once with 16-byte vectors. `set_isa` forces a narrower variant (tests check each one against the
//     reference; benchmarks compare them).
//
// Precision: state and accumulation in float32 (float64 for float64 input). The float32 / bfloat16 paths use a
// polynomial exp and log1p (within 1-2 ulp, branch-free so they vectorise); float64 uses std::exp / std::log1p,
// so that it can be checked against the reference to ~1e-14.
//
// Needs GCC or Clang (vector extensions, target attributes).

#include "selective_scan_cpu.h"

#include "cpu_isa.h"
#include "cpu_rows.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#if !defined(__GNUC__) && !defined(__clang__)
#error "selective_scan_cpu.cpp needs GCC or Clang (vector extensions)"
#endif

// Functions taking 32-byte vectors make GCC / Clang note an ABI difference without AVX. Every function taking
// vectors here is force-inlined into a caller compiled for the matching instruction set, so no such call exists.
#pragma GCC diagnostic ignored "-Wpsabi"

// Lane shuffle of two vectors (indices into their concatenation); GCC and Clang spell the builtin differently.
#if defined(__clang__)
#define SCAN_SHUFFLE(V, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SCAN_SHUFFLE(V, a, b, ...) __builtin_shuffle(a, b, typename SimdOf<V>::M{__VA_ARGS__})
#endif

namespace vim_ds {
namespace scan_cpu {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Vector types and helpers.
// ---------------------------------------------------------------------------------------------------------------

// kBytes of element type E; M is what comparing two V gives (lanes all ones / all zeros), U its unsigned form.
template <typename E, int kBytes>
struct Simd {
  typedef E V __attribute__((vector_size(kBytes)));
  typedef std::conditional_t<sizeof(E) == 4, int32_t, int64_t> I;
  typedef I M __attribute__((vector_size(kBytes)));
  typedef std::make_unsigned_t<I> UI;
  typedef UI U __attribute__((vector_size(kBytes)));
  static constexpr int64_t W = kBytes / sizeof(E);
};
template <typename V>
using elem_t = std::remove_cv_t<std::remove_reference_t<decltype(std::declval<V>()[0])>>;
template <typename V>
using SimdOf = Simd<elem_t<V>, sizeof(V)>;

// Lanes of state per pass over time (and the unit the state dimension is padded to): 64 bytes.
template <typename acc_t>
constexpr int64_t kStateBlock = 64 / sizeof(acc_t);
// Rows over time are padded to the widest vector (64 bytes) so that elementwise loops run in whole vectors.
template <typename acc_t>
constexpr int64_t kMaxLanes = 64 / sizeof(acc_t);

// Unaligned load / store (memcpy compiles to one vector move; scratch buffers are only 16-byte aligned).
template <typename V>
SCAN_INLINE V vload(const elem_t<V>* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
SCAN_INLINE void vstore(elem_t<V>* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
template <typename V>
SCAN_INLINE V splat(double x) {  // every lane = x; only used outside the hot loops
  return V{} + static_cast<elem_t<V>>(x);
}
template <typename V>
SCAN_INLINE elem_t<V> hsum(V v) {  // pairwise tree: shorter dependency chain than a running sum
  for (int64_t w = SimdOf<V>::W / 2; w >= 1; w /= 2)
    for (int64_t i = 0; i < w; ++i) v[i] += v[i + w];
  return v[0];
}
// Lane-wise m ? a : b, where each lane of m is all ones or all zeros (a comparison result).
template <typename V>
SCAN_INLINE V select(typename SimdOf<V>::M m, V a, V b) {
  using M = typename SimdOf<V>::M;
  return (V)((m & (M)a) | (~m & (M)b));
}

// The lane sums of W consecutive vectors at p, as one vector: result[i] = hsum(vector i). A transposing add tree:
// ~3 instructions per vector instead of ~6 for an hsum each.
template <typename V>
SCAN_INLINE V lane_sums_block(const elem_t<V>* p) {
  constexpr int64_t W = SimdOf<V>::W;
  V s[W];
  for (int64_t i = 0; i < W; ++i) s[i] = vload<V>(p + i * W);
  if constexpr (W == 8) {
    V q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = SCAN_SHUFFLE(V, s[2 * i], s[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
             SCAN_SHUFFLE(V, s[2 * i], s[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    const V r0 = SCAN_SHUFFLE(V, q[0], q[1], 0, 1, 8, 9, 4, 5, 12, 13) +
                 SCAN_SHUFFLE(V, q[0], q[1], 2, 3, 10, 11, 6, 7, 14, 15);
    const V r1 = SCAN_SHUFFLE(V, q[2], q[3], 0, 1, 8, 9, 4, 5, 12, 13) +
                 SCAN_SHUFFLE(V, q[2], q[3], 2, 3, 10, 11, 6, 7, 14, 15);
    return SCAN_SHUFFLE(V, r0, r1, 0, 1, 2, 3, 8, 9, 10, 11) + SCAN_SHUFFLE(V, r0, r1, 4, 5, 6, 7, 12, 13, 14, 15);
  } else if constexpr (W == 4) {
    const V q0 = SCAN_SHUFFLE(V, s[0], s[1], 0, 4, 1, 5) + SCAN_SHUFFLE(V, s[0], s[1], 2, 6, 3, 7);
    const V q1 = SCAN_SHUFFLE(V, s[2], s[3], 0, 4, 1, 5) + SCAN_SHUFFLE(V, s[2], s[3], 2, 6, 3, 7);
    return SCAN_SHUFFLE(V, q0, q1, 0, 1, 4, 5) + SCAN_SHUFFLE(V, q0, q1, 2, 3, 6, 7);
  } else {
    static_assert(W == 2, "unsupported vector width");
    return SCAN_SHUFFLE(V, s[0], s[1], 0, 2) + SCAN_SHUFFLE(V, s[0], s[1], 1, 3);
  }
}

// Per-step partial sums are kept at most 8 lanes wide (what lane_sums_block handles): a 16-lane float vector
// (AVX-512) is folded to 8 lanes, its two halves added, before it is stored.
template <typename V>
using PartialOf = typename Simd<elem_t<V>, (SimdOf<V>::W > 8 ? sizeof(V) / 2 : sizeof(V))>::V;
template <typename V>
SCAN_INLINE PartialOf<V> fold(V v) {
  if constexpr (SimdOf<V>::W > 8) {
    PartialOf<V> lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    return lo + hi;
  } else {
    return v;
  }
}

// out[t] = sum of the lanes of the vector stored at S + t * W, for t < L.
template <typename V>
SCAN_INLINE void lane_sums(const elem_t<V>* __restrict S, int64_t L, elem_t<V>* __restrict out) {
  constexpr int64_t W = SimdOf<V>::W;
  int64_t t = 0;
  for (; t + W <= L; t += W) vstore(out + t, lane_sums_block<V>(S + t * W));
  for (; t < L; ++t) out[t] = hsum(vload<V>(S + t * W));
}

// sum_t a[t] (b == nullptr) or sum_t a[t] b[t] over the first L entries, in a fixed order.
template <typename V>
SCAN_INLINE elem_t<V> row_sum(const elem_t<V>* __restrict a, const elem_t<V>* __restrict b, int64_t L) {
  constexpr int64_t W = SimdOf<V>::W;
  V acc{};
  int64_t t = 0;
  for (; t + W <= L; t += W) acc += b ? vload<V>(a + t) * vload<V>(b + t) : vload<V>(a + t);
  elem_t<V> s = hsum(acc);
  for (; t < L; ++t) s += b ? a[t] * b[t] : a[t];
  return s;
}

// ---------------------------------------------------------------------------------------------------------------
// Elementary functions on vectors: float lanes get branch-free polynomials, double lanes libm per lane.
// ---------------------------------------------------------------------------------------------------------------

// exp(x) = 2^k exp(r), k = round(x / ln2), |r| <= ln2 / 2, exp(r) by a degree-5 polynomial with constant term 1
// (near-minimax for relative error, 1.0e-7, fitted by Lawson's algorithm): within ~2 ulp on [kExpLo, kExpHi], exact
// at x = 0. This exp is most of the scan's arithmetic (16 per step and channel), and the degree-6 polynomial used
// before (2e-9, ~1 ulp) cost one more FMA each for accuracy that float rounding of the recurrence does not keep.
// Outside, the argument is clamped:
// exp(x < -87.3) gives a value below 1.2e-38 instead of a subnormal or 0 (harmless for a decay factor or a
// sigmoid), exp(x > 88.3) saturates at ~2e38. NaN propagates.
//
// lo / hi must be splat(kExpLo) / splat(kExpHi). The state loops pass them in as values only known at run time
// (ScanArgs::exp_lo / exp_hi): with compile-time constants GCC turns each clamp into compare + blend, with
// run-time values into one max / min; and this function is most of the work of the scan.
constexpr float kExpLo = -87.3f, kExpHi = 88.3f;

template <typename V>
SCAN_INLINE V vexp(V x, V lo, V hi) {
  if constexpr (std::is_same<elem_t<V>, float>::value) {
    using U = typename SimdOf<V>::U;
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    // Round x / ln2 to an integer k with the 1.5 * 2^23 trick: after the addition k sits in the low mantissa
    // bits of `shifted` (no SSE4.1 rounding or float -> int conversion needed).
    const V magic = splat<V>(12582912.0);
    const V shifted = x * 1.44269504088896341f + magic;
    const V k = shifted - magic;
    // Cody-Waite: ln2 split into a part exact in float and a small correction, so r keeps full precision.
    V r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    V p = splat<V>(8.317875676e-3);
    p = p * r + 4.189794511e-2f;
    p = p * r + 1.666718125e-1f;
    p = p * r + 4.999915063e-1f;
    p = p * r + 9.999998808e-1f;
    p = p * r + 1.0f;
    // Times 2^k: add k to the exponent field of p (p in [0.7, 1.42], k in [-126, 127] after the clamp). The shift
    // by 23 keeps exactly k's two's-complement bits from `shifted` and drops the magic's.
    return (V)((U)p + ((U)shifted << 23));
  } else {
    (void)lo;
    (void)hi;
    for (int64_t i = 0; i < SimdOf<V>::W; ++i) x[i] = std::exp(x[i]);
    return x;
  }
}
template <typename V>
SCAN_INLINE V vexp(V x) {
  return vexp(x, splat<V>(kExpLo), splat<V>(kExpHi));
}

// log(1 + e) for float lanes, e in [0, 1], given w = 1 + e (rounded) and 1 / w. log(w) by the Cephes logf
// polynomial, plus the classic correction (e - (w - 1)) / w for the rounding of 1 + e, which keeps tiny e exact.
// Within ~1 ulp.
template <typename V>
SCAN_INLINE V log1p_unit(V e, V w, V inv_w) {
  const V one = splat<V>(1.0);
  // Bring the argument to [sqrt(1/2), sqrt(2)): log(w) = k ln2 + log(m), with m = w or w / 2.
  const auto hi = w > splat<V>(1.41421356);
  const V m = select(hi, w * 0.5f, w);
  const V k = select(hi, one, V{});
  const V f = m - one;  // exact
  const V f2 = f * f;
  V p = splat<V>(7.0376836292e-2);
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  V y = f * f2 * p + k * -2.12194440e-4f;
  y = y - 0.5f * f2;
  const V logw = f + y + k * 0.693359375f;
  return logw + (e - (w - one)) * inv_w;
}

// softplus(x) = log(1 + e^x) and its derivative sigmoid(x), as torch's F.softplus (beta 1, threshold 20: above
// 20 the input passes through and the derivative is 1). Float: with e = exp(-|x|), which cannot overflow,
// softplus = max(x, 0) + log1p(e) and sigmoid = (x > 0 ? 1 : e) / (1 + e): one exp and one division for both
// (the forward only uses sp; the compiler drops the rest). Double: torch's own formulas.
template <typename V>
SCAN_INLINE void softplus(V x, V& sp, V& grad) {
  if constexpr (std::is_same<elem_t<V>, float>::value) {
    const V zero{}, one = splat<V>(1.0), thresh = splat<V>(20.0);
    const auto pos = x > zero;
    const V e = vexp(select(pos, -x, x));
    const V w = one + e;
    const V inv_w = one / w;
    sp = select(x > thresh, x, select(pos, x, zero) + log1p_unit(e, w, inv_w));
    grad = select(x > thresh, one, select(pos, one, e) * inv_w);
  } else {
    for (int64_t i = 0; i < SimdOf<V>::W; ++i) {
      const double e = std::exp(x[i]);
      sp[i] = x[i] > 20.0 ? x[i] : std::log1p(e);
      grad[i] = x[i] > 20.0 ? 1.0 : e / (e + 1.0);
    }
  }
}

template <typename V>
SCAN_INLINE V sigmoid(V x) {
  const V one = splat<V>(1.0);
  return one / (one + vexp(-x));
}

// ---------------------------------------------------------------------------------------------------------------
// Arguments and per-thread scratch.
// ---------------------------------------------------------------------------------------------------------------

template <typename in_t, typename acc_t>
struct ScanArgs {
  int64_t batch = 0, dim = 0, L = 0, N = 0;
  int64_t NP = 0;  // N padded to a multiple of kStateBlock
  bool softplus = false;
  bool reverse = false;  // scan t = L-1 .. 0 (see "Reverse mode" at the top)
  acc_t exp_lo = 0, exp_hi = 0;  // kExpLo, kExpHi, set at run time (see vexp)
  const in_t* u = nullptr;       // (batch, dim, L)
  const in_t* delta = nullptr;   // (batch, dim, L)
  const in_t* z = nullptr;       // (batch, dim, L) or null
  const acc_t* A = nullptr;      // (dim, NP), zero-padded
  const acc_t* D = nullptr;      // (dim) or null
  const acc_t* bias = nullptr;   // (dim) or null
  const acc_t* Bt = nullptr;     // (batch, L, NP): B transposed, zero-padded, in acc_t
  const acc_t* Ct = nullptr;     // (batch, L, NP)
  // forward output
  in_t* out = nullptr;          // (batch, dim, L)
  acc_t* last_state = nullptr;  // (batch, dim, NP): the state after the last scan step, or null (not asked for)
  // The state before the first scan step, (batch, dim, NP) zero-padded, or null (start from zero). Forward and
  // backward alike: the backward recomputes the states from it.
  const acc_t* h0 = nullptr;
  // backward
  const in_t* dout = nullptr;  // (batch, dim, L)
  in_t* du = nullptr;          // (batch, dim, L)
  in_t* ddelta = nullptr;      // (batch, dim, L)
  in_t* dz = nullptr;          // (batch, dim, L) or null
  const acc_t* dlast = nullptr;  // (batch, dim, NP): the gradient of the state after the last scan step, or null
  acc_t* dh0 = nullptr;          // (batch, dim, NP): the gradient of h0, written when h0 is given
  acc_t* delta_sum = nullptr;    // (batch, dim): sum over time of delta' (delta_sum only)
  // Backward work items: item i = (b = i / chunks, channel block i % chunks of `chunk_dim` channels).
  int64_t chunks = 1, chunk_dim = 0;
  acc_t* dB_part = nullptr;     // (items, L, NP): sums over the item's channels, zero-initialised
  acc_t* dC_part = nullptr;     // (items, L, NP)
  acc_t* dA_part = nullptr;     // (batch, dim, NP): sums over time
  acc_t* dD_part = nullptr;     // (batch, dim) or null
  acc_t* dbias_part = nullptr;  // (batch, dim) or null
};

// Per-thread scratch. Rows over time are LP = L rounded up to kMaxLanes long, so that elementwise loops run in
// whole vectors; the padding starts at zero, and whatever is computed there is never written out or summed.
template <typename acc_t>
struct Workspace {
  int64_t LP;
  std::vector<acc_t> u, x, dt, dsp, z, sg, go, y, dy, ddt, gb, du, tmp;  // LP each
  std::vector<acc_t> S1, S2;  // L x kMaxLanes: per-step vectors whose lanes are summed after the loop
  // Backward only, (L + 1) x NP each: H row t + 1 holds h_t (row 0 is h_{-1}: 0, or the channel's h0) and Aexp
  // row t holds a_t = exp(dt_t A) (row L is 0, or 1 when the last state has a gradient: see ssm_backward), so the
  // reverse pass reads h_{t-1} and a_{t+1} without a branch at either end.
  std::vector<acc_t> H, Aexp;
  Workspace(int64_t L, int64_t NP, bool backward)
      : LP((L + kMaxLanes<acc_t> - 1) / kMaxLanes<acc_t> * kMaxLanes<acc_t>),
        u(LP), x(LP), dt(LP), z(LP), y(LP), tmp(LP), S1(L * kMaxLanes<acc_t>) {
    if (backward) {
      for (auto* v : {&dsp, &sg, &go, &dy, &ddt, &gb, &du}) v->assign(LP, acc_t(0));
      S2.resize(L * kMaxLanes<acc_t>);
      H.assign((L + 1) * NP, acc_t(0));
      Aexp.assign((L + 1) * NP, acc_t(0));
    }
  }
};

// ---------------------------------------------------------------------------------------------------------------
// The math, one (batch, channel) pair at a time. V is the vector type (its width set by the instruction set).
// ---------------------------------------------------------------------------------------------------------------

// dt = softplus(x + bias) (or x + bias) and, if dsp is given, d dt / d x. Rows of LP entries.
template <typename V>
SCAN_INLINE void prepare_delta(const elem_t<V>* __restrict x, elem_t<V> bias, bool use_softplus, int64_t LP,
                               elem_t<V>* __restrict dt, elem_t<V>* __restrict dsp) {
  constexpr int64_t W = SimdOf<V>::W;
  const V vb = splat<V>(bias);
  if (use_softplus) {
    for (int64_t t = 0; t < LP; t += W) {
      V sp{}, grad{};
      softplus(vload<V>(x + t) + vb, sp, grad);
      vstore(dt + t, sp);
      if (dsp) vstore(dsp + t, grad);
    }
  } else {
    for (int64_t t = 0; t < LP; t += W) vstore(dt + t, vload<V>(x + t) + vb);
    if (dsp) std::fill(dsp, dsp + LP, elem_t<V>(1));
  }
}

// The recurrence of one channel:
//   h_t[n] = a_t[n] h_{t-1}[n] + dt_t u_t B_t[n],  a_t[n] = exp(dt_t A[n]);   y[t] = sum_n h_t[n] C_t[n]
// (no D term, no gate). For the backward (kStore) it also keeps every h_t and a_t (see Workspace) and adds this
// channel's dC_t[n] += dy_t h_t[n] (dC is the caller's sum over channels). S: L x 8-lane scratch. `last` (NP entries,
// or null): receives the state after the last step, which is still in registers when the loop over time ends.
// `h0` (NP entries, or null for zero): the state h_{-1} before the first step.
template <typename V, bool kStore>
SCAN_INLINE void ssm_forward(int64_t L, int64_t NP, const elem_t<V>* __restrict A, const elem_t<V>* __restrict u,
                             const elem_t<V>* __restrict dt, const elem_t<V>* __restrict Bt,
                             const elem_t<V>* __restrict Ct, elem_t<V>* __restrict y, elem_t<V>* __restrict S,
                             elem_t<V>* __restrict H, elem_t<V>* __restrict Aexp, const elem_t<V>* __restrict dy,
                             elem_t<V>* __restrict dC, elem_t<V> exp_lo, elem_t<V> exp_hi,
                             elem_t<V>* __restrict last, const elem_t<V>* __restrict h0) {
  using E = elem_t<V>;
  using P = PartialOf<V>;
  constexpr int64_t W = SimdOf<V>::W, PW = SimdOf<P>::W;
  constexpr int kBlock = kStateBlock<E> / W;  // vectors of state per pass
  const V lo = splat<V>(exp_lo), hi = splat<V>(exp_hi);
  for (int64_t n0 = 0; n0 < NP; n0 += kStateBlock<E>) {
    V Ab[kBlock], h[kBlock];
    for (int j = 0; j < kBlock; ++j) {
      Ab[j] = vload<V>(A + n0 + j * W);
      h[j] = h0 ? vload<V>(h0 + n0 + j * W) : V{};
    }
    for (int64_t t = 0; t < L; ++t) {
      // Scalars times vectors: compiles to one broadcast each.
      const E d = dt[t], du = dt[t] * u[t];
      V s{};
      for (int j = 0; j < kBlock; ++j) {
        const int64_t at = t * NP + n0 + j * W;
        const V a = vexp(Ab[j] * d, lo, hi);
        h[j] = a * h[j] + du * vload<V>(Bt + at);
        s += h[j] * vload<V>(Ct + at);
        if (kStore) {
          vstore(H + NP + at, h[j]);
          vstore(Aexp + at, a);
          vstore(dC + at, vload<V>(dC + at) + dy[t] * h[j]);
        }
      }
      // y[t] is the sum of the lanes of s over all passes; the lane sums are done for all t after the loop.
      const P ps = fold(s);
      if (n0 == 0)
        vstore(S + t * PW, ps);
      else
        vstore(S + t * PW, vload<P>(S + t * PW) + ps);
    }
    if (last)
      for (int j = 0; j < kBlock; ++j) vstore(last + n0 + j * W, h[j]);
  }
  lane_sums<P>(S, L, y);
}

// Reverse pass of one channel, given dy = dL/dy (before the D term) and the stored h_t, a_t.
// g_t = dL/dh_t = dy_t C_t + a_{t+1} g_{t+1}; then with x_t[n] = dt_t A[n] and ga = g_t a_t h_{t-1} = dL/dx_t:
//   dA[n] = sum_t ga dt_t,  ddt_t = sum_n ga A[n] + u_t sum_n g_t B_t,  du_t += dt_t sum_n g_t B_t,
//   dB_t[n] += g_t dt_t u_t   (dB is the caller's sum over channels).
// Only g carries from step to step, through one FMA (a_{t+1} g_{t+1} + dy_t C_t); everything else per step is off
// that chain, so with one vector of state per pass (AVX-512, N = 16) the loop is bound by throughput, not by
// the chain's latency.
// Rows u, dt, du, ddt, gb have LP entries (gb zero beyond L); S_ga, S_gb: L x 8-lane scratch.
// `dlast` (NP entries, or null for zero): dL/dh_{L-1}, the last state's own gradient. It enters as g_L with the
// caller's Aexp row L set to 1, so that the first step's g_{L-1} = 1 * dlast + dy C_{L-1} needs no branch.
// `dh0` (NP entries, or null): receives dL/dh_{-1} = a_0 g_0, the gradient of the initial state.
template <typename V>
SCAN_INLINE void ssm_backward(int64_t L, int64_t NP, const elem_t<V>* __restrict A, const elem_t<V>* __restrict u,
                              const elem_t<V>* __restrict dt, const elem_t<V>* __restrict Bt,
                              const elem_t<V>* __restrict Ct, const elem_t<V>* __restrict H,
                              const elem_t<V>* __restrict Aexp,
                              const elem_t<V>* __restrict dy, elem_t<V>* __restrict dB, elem_t<V>* __restrict dA,
                              elem_t<V>* __restrict S_ga, elem_t<V>* __restrict S_gb, elem_t<V>* __restrict gb,
                              elem_t<V>* __restrict ddt, elem_t<V>* __restrict du,
                              const elem_t<V>* __restrict dlast, elem_t<V>* __restrict dh0) {
  using E = elem_t<V>;
  using P = PartialOf<V>;
  constexpr int64_t W = SimdOf<V>::W, PW = SimdOf<P>::W;
  constexpr int kBlock = kStateBlock<E> / W;
  for (int64_t n0 = 0; n0 < NP; n0 += kStateBlock<E>) {
    V Ab[kBlock], g[kBlock], dAb[kBlock];
    for (int j = 0; j < kBlock; ++j) {
      Ab[j] = vload<V>(A + n0 + j * W);
      g[j] = dlast ? vload<V>(dlast + n0 + j * W) : V{};  // g_L: the last state's gradient, or zero
      dAb[j] = V{};
    }
    for (int64_t t = L - 1; t >= 0; --t) {
      const E dtt = dt[t], dyt = dy[t], dut = dt[t] * u[t];
      const E* __restrict hprev = H + t * NP + n0;             // h_{t-1} (row 0: h_{-1} = 0)
      const E* __restrict anext = Aexp + (t + 1) * NP + n0;    // a_{t+1} (row L: 0)
      V s_ga{}, s_gb{};
      for (int j = 0; j < kBlock; ++j) {
        const int64_t at = t * NP + n0 + j * W;
        g[j] = vload<V>(anext + j * W) * g[j] + dyt * vload<V>(Ct + at);
        const V ga = g[j] * vload<V>(Aexp + at) * vload<V>(hprev + j * W);
        dAb[j] += ga * dtt;
        s_ga += ga * Ab[j];
        s_gb += g[j] * vload<V>(Bt + at);
        vstore(dB + at, vload<V>(dB + at) + g[j] * dut);
      }
      const P pga = fold(s_ga), pgb = fold(s_gb);
      if (n0 == 0) {
        vstore(S_ga + t * PW, pga);
        vstore(S_gb + t * PW, pgb);
      } else {
        vstore(S_ga + t * PW, vload<P>(S_ga + t * PW) + pga);
        vstore(S_gb + t * PW, vload<P>(S_gb + t * PW) + pgb);
      }
    }
    for (int j = 0; j < kBlock; ++j) vstore(dA + n0 + j * W, dAb[j]);
    // g now holds g_0; h_0 = a_0 h_{-1} + ..., so dL/dh_{-1} = a_0 g_0.
    if (dh0)
      for (int j = 0; j < kBlock; ++j) vstore(dh0 + n0 + j * W, vload<V>(Aexp + n0 + j * W) * g[j]);
  }
  // The sums over n, for all t at once.
  lane_sums<P>(S_ga, L, ddt);
  lane_sums<P>(S_gb, L, gb);
  for (int64_t t = 0; t < L; t += W) {
    const V g = vload<V>(gb + t);
    vstore(ddt + t, vload<V>(ddt + t) + vload<V>(u + t) * g);
    vstore(du + t, vload<V>(du + t) + vload<V>(dt + t) * g);
  }
}

// The initial state's gradient alone, dL/dh_{-1} = a_0 g_0, for an output gradient dy (before the D term): the
// reverse recurrence g_t = a_{t+1} g_{t+1} + dy_t C_t of ssm_backward with nothing else. It reads neither u nor B
// and needs no stored states, so it costs about what the forward costs (the full backward: about five times that).
// The sequence split asks for it before its backward proper (vim_ds/models/sequence_parallel.py). The operations
// are ssm_backward's, in its order, so with dlast = 0 the two give the same dh0.
template <typename V>
SCAN_INLINE void ssm_h0_grad(int64_t L, int64_t NP, const elem_t<V>* __restrict A, const elem_t<V>* __restrict dt,
                             const elem_t<V>* __restrict Ct, const elem_t<V>* __restrict dy,
                             elem_t<V>* __restrict dh0, elem_t<V> exp_lo, elem_t<V> exp_hi) {
  using E = elem_t<V>;
  constexpr int64_t W = SimdOf<V>::W;
  constexpr int kBlock = kStateBlock<E> / W;
  const V lo = splat<V>(exp_lo), hi = splat<V>(exp_hi);
  for (int64_t n0 = 0; n0 < NP; n0 += kStateBlock<E>) {
    V Ab[kBlock], g[kBlock], anext[kBlock];
    for (int j = 0; j < kBlock; ++j) {
      Ab[j] = vload<V>(A + n0 + j * W);
      g[j] = V{};
      anext[j] = V{};  // a_L: multiplies g_L = 0
    }
    for (int64_t t = L - 1; t >= 0; --t) {
      const E d = dt[t], dyt = dy[t];
      for (int j = 0; j < kBlock; ++j) {
        const V a = vexp(Ab[j] * d, lo, hi);
        g[j] = anext[j] * g[j] + dyt * vload<V>(Ct + t * NP + n0 + j * W);
        anext[j] = a;
      }
    }
    for (int j = 0; j < kBlock; ++j) vstore(dh0 + n0 + j * W, anext[j] * g[j]);
  }
}

template <typename V, typename in_t>
SCAN_INLINE void scan_channel_fwd(const ScanArgs<in_t, elem_t<V>>& p, int64_t b, int64_t d,
                                  Workspace<elem_t<V>>& ws) {
  using E = elem_t<V>;
  constexpr int64_t W = SimdOf<V>::W;
  const int64_t L = p.L, LP = ws.LP, NP = p.NP;
  const int64_t row = (b * p.dim + d) * L;
  E* __restrict u = ws.u.data();
  E* __restrict dt = ws.dt.data();
  E* __restrict y = ws.y.data();
  E* __restrict o = ws.tmp.data();
  load_row(p.u + row, L, u, p.reverse);
  load_row(p.delta + row, L, ws.x.data(), p.reverse);
  prepare_delta<V>(ws.x.data(), p.bias ? p.bias[d] : E(0), p.softplus, LP, dt, static_cast<E*>(nullptr));
  ssm_forward<V, false>(L, NP, p.A + d * NP, u, dt, p.Bt + b * L * NP, p.Ct + b * L * NP, y, ws.S1.data(),
                        nullptr, nullptr, nullptr, nullptr, p.exp_lo, p.exp_hi,
                        p.last_state ? p.last_state + (b * p.dim + d) * NP : nullptr,
                        p.h0 ? p.h0 + (b * p.dim + d) * NP : nullptr);
  // out = (y + D u) silu(z)
  const V vD = splat<V>(p.D ? p.D[d] : E(0));
  if (p.z) {
    E* __restrict z = ws.z.data();
    load_row(p.z + row, L, z, p.reverse);
    for (int64_t t = 0; t < LP; t += W) {
      const V zt = vload<V>(z + t);
      vstore(o + t, (vload<V>(y + t) + vD * vload<V>(u + t)) * zt * sigmoid(zt));
    }
  } else {
    for (int64_t t = 0; t < LP; t += W) vstore(o + t, vload<V>(y + t) + vD * vload<V>(u + t));
  }
  store_row(o, L, p.out + row, p.reverse);
}

// This channel's dB / dC are added into the work item's (L, NP) buffers dB, dC; its dA / dD / ddelta_bias go
// into the (b, d) slots of the partial buffers.
template <typename V, typename in_t>
SCAN_INLINE void scan_channel_bwd(const ScanArgs<in_t, elem_t<V>>& p, int64_t b, int64_t d,
                                  Workspace<elem_t<V>>& ws, elem_t<V>* dB, elem_t<V>* dC) {
  using E = elem_t<V>;
  constexpr int64_t W = SimdOf<V>::W;
  const int64_t L = p.L, LP = ws.LP, NP = p.NP;
  const int64_t row = (b * p.dim + d) * L;
  E* __restrict u = ws.u.data();
  E* __restrict dt = ws.dt.data();
  E* __restrict dsp = ws.dsp.data();
  E* __restrict z = ws.z.data();
  E* __restrict sg = ws.sg.data();
  E* __restrict y = ws.y.data();
  E* __restrict go = ws.go.data();
  E* __restrict dy = ws.dy.data();
  E* __restrict du = ws.du.data();
  E* __restrict ddt = ws.ddt.data();
  E* __restrict tmp = ws.tmp.data();
  const E* A = p.A + d * NP;
  const E* Bt = p.Bt + b * L * NP;
  const E* Ct = p.Ct + b * L * NP;
  const V vD = splat<V>(p.D ? p.D[d] : E(0)), one = splat<V>(1.0);

  // 1. Through the gate: dy = dout silu(z) does not depend on y, so it is known before the scan.
  load_row(p.dout + row, L, go, p.reverse);
  if (p.z) {
    load_row(p.z + row, L, z, p.reverse);
    for (int64_t t = 0; t < LP; t += W) {
      const V zt = vload<V>(z + t), st = sigmoid(zt);
      vstore(sg + t, st);
      vstore(dy + t, vload<V>(go + t) * zt * st);
    }
  } else {
    std::copy(go, go + LP, dy);
  }

  // 2. Recompute the forward of this channel, keeping the states (and adding its dC). Given an initial state, it
  // is H's row 0 (h_{-1}), which the reverse pass reads at t = 0; without one that row stays zero.
  const E* h0 = p.h0 ? p.h0 + (b * p.dim + d) * NP : nullptr;
  if (h0) std::copy(h0, h0 + NP, ws.H.data());
  load_row(p.u + row, L, u, p.reverse);
  load_row(p.delta + row, L, ws.x.data(), p.reverse);
  prepare_delta<V>(ws.x.data(), p.bias ? p.bias[d] : E(0), p.softplus, LP, dt, dsp);
  ssm_forward<V, true>(L, NP, A, u, dt, Bt, Ct, y, ws.S1.data(), ws.H.data(), ws.Aexp.data(), dy, dC, p.exp_lo,
                       p.exp_hi, nullptr, h0);

  // 3. dz = dout (y + D u) silu'(z), silu'(z) = s (1 + z (1 - s)); the skip term's share of du and dD.
  if (p.z) {
    for (int64_t t = 0; t < LP; t += W) {
      const V zt = vload<V>(z + t), st = vload<V>(sg + t);
      const V yt = vload<V>(y + t) + vD * vload<V>(u + t);
      vstore(tmp + t, vload<V>(go + t) * yt * st * (one + zt * (one - st)));
    }
    store_row(tmp, L, p.dz + row, p.reverse);
  }
  for (int64_t t = 0; t < LP; t += W) vstore(du + t, vload<V>(dy + t) * vD);
  const E dD = row_sum<V>(dy, u, L);

  // 4. The reverse recurrence.
  ssm_backward<V>(L, NP, A, u, dt, Bt, Ct, ws.H.data(), ws.Aexp.data(), dy, dB,
                  p.dA_part + (b * p.dim + d) * NP, ws.S1.data(), ws.S2.data(), ws.gb.data(), ddt, du,
                  p.dlast ? p.dlast + (b * p.dim + d) * NP : nullptr,
                  p.dh0 ? p.dh0 + (b * p.dim + d) * NP : nullptr);

  // 5. Back through softplus(delta + bias).
  for (int64_t t = 0; t < LP; t += W) vstore(tmp + t, vload<V>(ddt + t) * vload<V>(dsp + t));
  const E dbias = row_sum<V>(tmp, static_cast<const E*>(nullptr), L);
  store_row(tmp, L, p.ddelta + row, p.reverse);
  store_row(du, L, p.du + row, p.reverse);
  if (p.dD_part) p.dD_part[b * p.dim + d] = dD;
  if (p.dbias_part) p.dbias_part[b * p.dim + d] = dbias;
}

// The initial state's gradient of one channel into p.dh0 (see ssm_h0_grad); dy = dout silu(z) as in the backward.
template <typename V, typename in_t>
SCAN_INLINE void scan_channel_h0_grad(const ScanArgs<in_t, elem_t<V>>& p, int64_t b, int64_t d,
                                      Workspace<elem_t<V>>& ws) {
  using E = elem_t<V>;
  constexpr int64_t W = SimdOf<V>::W;
  const int64_t L = p.L, LP = ws.LP, NP = p.NP;
  const int64_t row = (b * p.dim + d) * L;
  E* __restrict dt = ws.dt.data();
  E* __restrict dy = ws.y.data();
  load_row(p.dout + row, L, dy, p.reverse);
  if (p.z) {
    E* __restrict z = ws.z.data();
    load_row(p.z + row, L, z, p.reverse);
    for (int64_t t = 0; t < LP; t += W) {
      const V zt = vload<V>(z + t);
      vstore(dy + t, vload<V>(dy + t) * zt * sigmoid(zt));
    }
  }
  load_row(p.delta + row, L, ws.x.data(), p.reverse);
  prepare_delta<V>(ws.x.data(), p.bias ? p.bias[d] : E(0), p.softplus, LP, dt, static_cast<E*>(nullptr));
  ssm_h0_grad<V>(L, NP, p.A + d * NP, dt, p.Ct + b * L * NP, dy, p.dh0 + (b * p.dim + d) * NP, p.exp_lo,
                 p.exp_hi);
}

// sum_t delta'_t of one channel (delta' = softplus(delta + bias), or delta + bias) into p.out_sum: what the
// product of the channel's decays needs, P = exp(A sum_t delta'_t), the (P, S) pair of a chunk of a split sequence.
template <typename V, typename in_t>
SCAN_INLINE void channel_delta_sum(const ScanArgs<in_t, elem_t<V>>& p, int64_t b, int64_t d,
                                   Workspace<elem_t<V>>& ws) {
  using E = elem_t<V>;
  const int64_t L = p.L;
  load_row(p.delta + (b * p.dim + d) * L, L, ws.x.data(), false);
  prepare_delta<V>(ws.x.data(), p.bias ? p.bias[d] : E(0), p.softplus, ws.LP, ws.dt.data(),
                   static_cast<E*>(nullptr));
  p.delta_sum[b * p.dim + d] = row_sum<V>(ws.dt.data(), static_cast<const E*>(nullptr), L);
}

// ---------------------------------------------------------------------------------------------------------------
// Ranges of work, compiled per instruction set: the *_impl bodies are force-inlined into each variant, so all
// of the math above is generated with that variant's instructions and vector width.
// ---------------------------------------------------------------------------------------------------------------

// The kinds of work done one (batch, channel) pair at a time, with a forward-sized workspace.
enum class PerChannel { kForward, kH0Grad, kDeltaSum };

template <PerChannel kWork, int kBytes, typename in_t, typename acc_t>
SCAN_INLINE void per_channel_impl(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  using V = typename Simd<acc_t, kBytes>::V;
  Workspace<acc_t> ws(p.L, p.NP, /*backward=*/false);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / p.dim, d = i % p.dim;
    if constexpr (kWork == PerChannel::kForward)
      scan_channel_fwd<V>(p, b, d, ws);
    else if constexpr (kWork == PerChannel::kH0Grad)
      scan_channel_h0_grad<V>(p, b, d, ws);
    else
      channel_delta_sum<V>(p, b, d, ws);
  }
}

template <int kBytes, typename in_t, typename acc_t>
SCAN_INLINE void bwd_range_impl(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  using V = typename Simd<acc_t, kBytes>::V;
  Workspace<acc_t> ws(p.L, p.NP, /*backward=*/true);
  // With the last state's gradient, a_L = 1 carries it into g_{L-1} (see ssm_backward); no channel writes row L.
  if (p.dlast) std::fill(ws.Aexp.begin() + p.L * p.NP, ws.Aexp.end(), acc_t(1));
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p.chunks;
    const int64_t d0 = (item % p.chunks) * p.chunk_dim;
    const int64_t d1 = std::min(p.dim, d0 + p.chunk_dim);
    acc_t* dB = p.dB_part + item * p.L * p.NP;
    acc_t* dC = p.dC_part + item * p.L * p.NP;
    for (int64_t d = d0; d < d1; ++d) scan_channel_bwd<V>(p, b, d, ws, dB, dC);
  }
}

// One entry per kind of work (forward, backward, the initial state's gradient, the sum of delta') and instruction
// set, each compiled with its target's instructions: fwd_range_NAME, bwd_range_NAME, h0_grad_range_NAME and
// delta_sum_range_NAME run the *_impl bodies with kBytes-wide vectors.
#define SCAN_VARIANT(NAME, TARGET, kBytes)                                                             \
  template <typename in_t, typename acc_t>                                                             \
  TARGET void fwd_range_##NAME(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {           \
    per_channel_impl<PerChannel::kForward, kBytes>(p, begin, end);                                     \
  }                                                                                                    \
  template <typename in_t, typename acc_t>                                                             \
  TARGET void bwd_range_##NAME(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {           \
    bwd_range_impl<kBytes>(p, begin, end);                                                             \
  }                                                                                                    \
  template <typename in_t, typename acc_t>                                                             \
  TARGET void h0_grad_range_##NAME(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {       \
    per_channel_impl<PerChannel::kH0Grad, kBytes>(p, begin, end);                                      \
  }                                                                                                    \
  template <typename in_t, typename acc_t>                                                             \
  TARGET void delta_sum_range_##NAME(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {     \
    per_channel_impl<PerChannel::kDeltaSum, kBytes>(p, begin, end);                                    \
  }

SCAN_VARIANT(generic, , 16)  // baseline: 16-byte vectors (SSE2 on x86-64, NEON on aarch64)
#if SCAN_X86_DISPATCH
SCAN_VARIANT(avx2, SCAN_TARGET_AVX2, 32)
SCAN_VARIANT(avx512, SCAN_TARGET_AVX512, 64)
#endif
#undef SCAN_VARIANT

// The names of the variants (cpu_isa.h), narrowest first.
#if SCAN_X86_DISPATCH
const char* const kIsaNames[] = {"sse2", "avx2", "avx512"};
#elif defined(__aarch64__)
const char* const kIsaNames[] = {"neon"};
#else
const char* const kIsaNames[] = {"generic"};
#endif

// The widest variant this CPU (and its OS, which must save the wide registers) can run.
int widest_isa() {
#if SCAN_X86_DISPATCH
  static const int widest = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
      return int(kAvx512);
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return int(kAvx2);
    return int(kGeneric);
  }();
  return widest;
#else
  return kGeneric;
#endif
}

// The variant in use (current_isa, below the anonymous namespace): the widest unless set_isa chose a narrower one.
std::atomic<int> g_isa{-1};

// KIND_range(p, begin, end): the variant of that kind of work for the instruction set in use.
#if SCAN_X86_DISPATCH
#define SCAN_DISPATCH(KIND)                                                     \
  template <typename in_t, typename acc_t>                                      \
  void KIND##_range(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) { \
    switch (current_isa()) {                                                    \
      case kAvx512: return KIND##_range_avx512(p, begin, end);                  \
      case kAvx2: return KIND##_range_avx2(p, begin, end);                      \
      default: return KIND##_range_generic(p, begin, end);                      \
    }                                                                           \
  }
#else
#define SCAN_DISPATCH(KIND)                                                     \
  template <typename in_t, typename acc_t>                                      \
  void KIND##_range(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) { \
    KIND##_range_generic(p, begin, end);                                        \
  }
#endif
SCAN_DISPATCH(fwd)
SCAN_DISPATCH(bwd)
SCAN_DISPATCH(h0_grad)
SCAN_DISPATCH(delta_sum)
#undef SCAN_DISPATCH

// ---------------------------------------------------------------------------------------------------------------
// Drivers.
// ---------------------------------------------------------------------------------------------------------------

// Roughly how many (b, d, t, n) steps one parallel chunk should hold, so that tiny problems stay on one thread.
constexpr int64_t kMinStepsPerChunk = 1 << 15;
// The backward cuts each batch row into enough channel blocks to have about this many work items overall
// (load balance). It depends on the shape only, so the summation order, and the result, do not depend on the
// number of threads.
constexpr int64_t kTargetBackwardItems = 32;

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

template <typename acc_t>
const acc_t* opt_ptr(const std::optional<at::Tensor>& t) {
  return has(t) ? t->data_ptr<acc_t>() : nullptr;
}

// Everything the forward and backward share: A (dim, NP) and B, C as (batch, L, NP), in the accumulation type,
// zero-padded in the state dimension and, in reverse mode, in scan order (time reversed): this copy exists anyway,
// so reversing costs nothing here.
struct Prepared {
  at::Tensor A, Bt, Ct;
  int64_t NP;
};

Prepared prepare(const at::Tensor& u, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C, bool reverse) {
  const auto acc = u.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t block = acc == at::kDouble ? kStateBlock<double> : kStateBlock<float>;
  const int64_t N = A.size(1), NP = (N + block - 1) / block * block;
  auto time_major = [&](const at::Tensor& x) {
    at::Tensor out = at::zeros({x.size(0), x.size(2), NP}, x.options().dtype(acc));
    out.narrow(2, 0, N).copy_(reverse ? x.flip({2}).transpose(1, 2) : x.transpose(1, 2));
    return out;
  };
  at::Tensor Ap = A;
  if (NP != N) {
    Ap = at::zeros({A.size(0), NP}, A.options());
    Ap.narrow(1, 0, N).copy_(A);
  }
  return {Ap, time_major(B), time_major(C), NP};
}

// A (batch, dim, N) state (h0, or the last state's gradient) in the kernels' zero-padded (batch, dim, NP) layout
// and the accumulation dtype; an undefined tensor when it is not given.
at::Tensor padded_state(const std::optional<at::Tensor>& s, const at::Tensor& A, int64_t NP) {
  if (!has(s)) return at::Tensor();
  const int64_t N = A.size(1);
  if (NP == N && s->scalar_type() == A.scalar_type() && s->is_contiguous()) return *s;
  at::Tensor out = at::zeros({s->size(0), s->size(1), NP}, A.options());
  out.narrow(2, 0, N).copy_(*s);
  return out;
}

template <typename acc_t>
acc_t* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<acc_t>() : nullptr;
}

template <typename in_t, typename acc_t>
ScanArgs<in_t, acc_t> common_args(const at::Tensor& u, const at::Tensor& delta, const Prepared& pr, int64_t N,
                                  const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                                  const std::optional<at::Tensor>& delta_bias, bool softplus, bool reverse) {
  ScanArgs<in_t, acc_t> p;
  p.reverse = reverse;
  p.batch = u.size(0);
  p.dim = u.size(1);
  p.L = u.size(2);
  p.N = N;
  p.NP = pr.NP;
  p.softplus = softplus;
  p.exp_lo = kExpLo;
  p.exp_hi = kExpHi;
  p.u = u.data_ptr<in_t>();
  p.delta = delta.data_ptr<in_t>();
  p.z = has(z) ? z->data_ptr<in_t>() : nullptr;
  p.A = pr.A.data_ptr<acc_t>();
  p.D = opt_ptr<acc_t>(D);
  p.bias = opt_ptr<acc_t>(delta_bias);
  p.Bt = pr.Bt.data_ptr<acc_t>();
  p.Ct = pr.Ct.data_ptr<acc_t>();
  return p;
}

template <typename in_t, typename acc_t>
void run_fwd(const at::Tensor& u, const at::Tensor& delta, const Prepared& pr, int64_t N,
             const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
             const std::optional<at::Tensor>& delta_bias, bool softplus, bool reverse, at::Tensor& out,
             at::Tensor& last_state, const at::Tensor& h0) {
  auto p = common_args<in_t, acc_t>(u, delta, pr, N, D, z, delta_bias, softplus, reverse);
  p.out = out.data_ptr<in_t>();
  p.h0 = ptr_or_null<acc_t>(h0);
  p.last_state = last_state.defined() ? last_state.data_ptr<acc_t>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, kMinStepsPerChunk / (p.L * p.NP));
  at::parallel_for(0, p.batch * p.dim, grain, [&](int64_t begin, int64_t end) { fwd_range(p, begin, end); });
}

template <typename in_t, typename acc_t>
void run_bwd(const at::Tensor& u, const at::Tensor& delta, const Prepared& pr, int64_t N,
             const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
             const std::optional<at::Tensor>& delta_bias, const at::Tensor& dout, bool softplus, bool reverse,
             at::Tensor& du,
             at::Tensor& ddelta, at::Tensor& dA, at::Tensor& dB, at::Tensor& dC, at::Tensor& dD, at::Tensor& dz,
             at::Tensor& dbias, const at::Tensor& h0, const at::Tensor& dlast, at::Tensor& dh0) {
  auto p = common_args<in_t, acc_t>(u, delta, pr, N, D, z, delta_bias, softplus, reverse);
  p.h0 = ptr_or_null<acc_t>(h0);
  p.dlast = ptr_or_null<acc_t>(dlast);
  p.dh0 = ptr_or_null<acc_t>(dh0);
  const int64_t batch = p.batch, dim = p.dim, L = p.L, NP = p.NP;
  p.dout = dout.data_ptr<in_t>();
  p.du = du.data_ptr<in_t>();
  p.ddelta = ddelta.data_ptr<in_t>();
  p.dz = dz.defined() ? dz.data_ptr<in_t>() : nullptr;

  // Work items and their partial sums (see the comment at the top of the file).
  int64_t chunks = std::min(dim, std::max<int64_t>(1, (kTargetBackwardItems + batch - 1) / batch));
  p.chunk_dim = (dim + chunks - 1) / chunks;
  p.chunks = chunks = (dim + p.chunk_dim - 1) / p.chunk_dim;
  const int64_t items = batch * chunks;
  const auto acc_opts = pr.A.options();
  at::Tensor dB_part = at::zeros({items, L, NP}, acc_opts);
  at::Tensor dC_part = at::zeros({items, L, NP}, acc_opts);
  at::Tensor dA_part = at::empty({batch, dim, NP}, acc_opts);
  at::Tensor dD_part = dD.defined() ? at::empty({batch, dim}, acc_opts) : at::Tensor();
  at::Tensor dbias_part = dbias.defined() ? at::empty({batch, dim}, acc_opts) : at::Tensor();
  p.dB_part = dB_part.data_ptr<acc_t>();
  p.dC_part = dC_part.data_ptr<acc_t>();
  p.dA_part = dA_part.data_ptr<acc_t>();
  p.dD_part = dD_part.defined() ? dD_part.data_ptr<acc_t>() : nullptr;
  p.dbias_part = dbias_part.defined() ? dbias_part.data_ptr<acc_t>() : nullptr;

  const int64_t grain = std::max<int64_t>(1, kMinStepsPerChunk / (p.chunk_dim * L * NP));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) { bwd_range(p, begin, end); });

  // Fixed-order sums of the partials.
  //   dB[b, n, t] = sum_k dB_part[b * chunks + k, t, n]   (dC alike), written in the input dtype; the partials
  //   are in scan order (time reversed in reverse mode).
  in_t* dB_out = dB.data_ptr<in_t>();
  in_t* dC_out = dC.data_ptr<in_t>();
  const acc_t* dBp = p.dB_part;
  const acc_t* dCp = p.dC_part;
  at::parallel_for(0, batch * N, std::max<int64_t>(1, kMinStepsPerChunk / (chunks * L)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t bn = begin; bn < end; ++bn) {
                       const int64_t b = bn / N, n = bn % N;
                       for (int64_t t = 0; t < L; ++t) {
                         acc_t sb = 0, sc = 0;
                         for (int64_t k = 0; k < chunks; ++k) {
                           const int64_t i = ((b * chunks + k) * L + t) * NP + n;
                           sb += dBp[i];
                           sc += dCp[i];
                         }
                         const int64_t to = bn * L + (reverse ? L - 1 - t : t);
                         dB_out[to] = static_cast<in_t>(sb);
                         dC_out[to] = static_cast<in_t>(sc);
                       }
                     }
                   });
  //   dA, dD, ddelta_bias: sums over the batch.
  const acc_t* dAp = p.dA_part;
  acc_t* dA_out = dA.data_ptr<acc_t>();
  for (int64_t d = 0; d < dim; ++d) {
    for (int64_t n = 0; n < N; ++n) {
      acc_t s = 0;
      for (int64_t b = 0; b < batch; ++b) s += dAp[(b * dim + d) * NP + n];
      dA_out[d * N + n] = s;
    }
  }
  auto sum_over_batch = [batch, dim](const acc_t* part, acc_t* result) {
    for (int64_t d = 0; d < dim; ++d) {
      acc_t s = 0;
      for (int64_t b = 0; b < batch; ++b) s += part[b * dim + d];
      result[d] = s;
    }
  };
  if (dD.defined()) sum_over_batch(p.dD_part, dD.data_ptr<acc_t>());
  if (dbias.defined()) sum_over_batch(p.dbias_part, dbias.data_ptr<acc_t>());
}

template <typename in_t, typename acc_t>
void run_h0_grad(const at::Tensor& delta, const at::Tensor& A, const at::Tensor& C, const std::optional<at::Tensor>& z,
                 const std::optional<at::Tensor>& delta_bias, const at::Tensor& dout, bool softplus, bool reverse,
                 at::Tensor& dh0) {
  // B is not read: C stands in for it in the shared preparation.
  const Prepared pr = prepare(delta, A, C, C, reverse);
  auto p = common_args<in_t, acc_t>(delta, delta, pr, A.size(1), std::nullopt, z, delta_bias, softplus, reverse);
  p.dout = dout.data_ptr<in_t>();
  p.dh0 = dh0.data_ptr<acc_t>();
  const int64_t grain = std::max<int64_t>(1, kMinStepsPerChunk / (p.L * p.NP));
  at::parallel_for(0, p.batch * p.dim, grain, [&](int64_t begin, int64_t end) { h0_grad_range(p, begin, end); });
}

template <typename in_t, typename acc_t>
void run_delta_sum(const at::Tensor& delta, const std::optional<at::Tensor>& delta_bias, bool softplus,
                   at::Tensor& sum) {
  ScanArgs<in_t, acc_t> p;
  p.batch = delta.size(0);
  p.dim = delta.size(1);
  p.L = delta.size(2);
  p.softplus = softplus;
  p.delta = delta.data_ptr<in_t>();
  p.bias = opt_ptr<acc_t>(delta_bias);
  p.delta_sum = sum.data_ptr<acc_t>();
  const int64_t grain = std::max<int64_t>(1, kMinStepsPerChunk / p.L);
  at::parallel_for(0, p.batch * p.dim, grain, [&](int64_t begin, int64_t end) { delta_sum_range(p, begin, end); });
}

}  // namespace

int current_isa() {
  const int chosen = g_isa.load(std::memory_order_relaxed);
  return chosen < 0 ? widest_isa() : chosen;
}

std::vector<at::Tensor> selective_scan_fwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                           const at::Tensor& B, const at::Tensor& C,
                                           const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                                           const std::optional<at::Tensor>& delta_bias, bool delta_softplus,
                                           bool reverse, bool return_last_state,
                                           const std::optional<at::Tensor>& h0) {
  at::Tensor out = at::empty_like(u);
  at::Tensor saved = at::empty({0}, u.options());
  const int64_t N = A.size(1);
  if (u.numel() == 0) return {out, saved, return_last_state ? at::zeros({u.size(0), u.size(1), N}, A.options())
                                                            : at::Tensor()};
  const Prepared pr = prepare(u, A, B, C, reverse);
  const at::Tensor h0p = padded_state(h0, A, pr.NP);
  // Written by every channel in its padded (NP) layout, trimmed to N below.
  at::Tensor last_padded = return_last_state ? at::empty({u.size(0), u.size(1), pr.NP}, A.options()) : at::Tensor();
  switch (u.scalar_type()) {
    case at::kFloat:
      run_fwd<float, float>(u, delta, pr, N, D, z, delta_bias, delta_softplus, reverse, out, last_padded, h0p);
      break;
    case at::kDouble:
      run_fwd<double, double>(u, delta, pr, N, D, z, delta_bias, delta_softplus, reverse, out, last_padded, h0p);
      break;
    case at::kBFloat16:
      run_fwd<c10::BFloat16, float>(u, delta, pr, N, D, z, delta_bias, delta_softplus, reverse, out, last_padded,
                                    h0p);
      break;
    default:
      TORCH_CHECK(false, "selective_scan (cpu): unsupported input dtype ", u.scalar_type(),
                  " (expected float32, float64 or bfloat16)");
  }
  at::Tensor last_state = last_padded;
  if (last_padded.defined() && pr.NP != N) last_state = last_padded.narrow(2, 0, N).contiguous();
  return {out, saved, last_state};
}

std::vector<at::Tensor> selective_scan_bwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                           const at::Tensor& B, const at::Tensor& C,
                                           const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                                           const std::optional<at::Tensor>& delta_bias, const at::Tensor& dout,
                                           bool delta_softplus, bool reverse, const std::optional<at::Tensor>& h0,
                                           const std::optional<at::Tensor>& dlast) {
  if (u.numel() == 0) {  // no (batch, channel) pairs: every gradient is zero (or empty)
    auto zeros = [](const at::Tensor& t) { return at::zeros_like(t); };
    std::vector<at::Tensor> grads = {zeros(u),
                                     zeros(delta),
                                     zeros(A),
                                     zeros(B),
                                     zeros(C),
                                     has(D) ? zeros(*D) : at::Tensor(),
                                     has(z) ? zeros(*z) : at::Tensor(),
                                     has(delta_bias) ? zeros(*delta_bias) : at::Tensor()};
    if (has(h0)) grads.push_back(zeros(*h0));
    return grads;
  }
  const Prepared pr = prepare(u, A, B, C, reverse);
  const int64_t N = A.size(1);
  const at::Tensor h0p = padded_state(h0, A, pr.NP), dlastp = padded_state(dlast, A, pr.NP);
  // Written by every channel in the padded layout, trimmed to N below.
  at::Tensor dh0p = has(h0) ? at::empty({u.size(0), u.size(1), pr.NP}, A.options()) : at::Tensor();
  at::Tensor du = at::empty_like(u);
  at::Tensor ddelta = at::empty_like(delta);
  at::Tensor dA = at::empty_like(A);
  at::Tensor dB = at::empty_like(B);
  at::Tensor dC = at::empty_like(C);
  at::Tensor dD = has(D) ? at::empty_like(*D) : at::Tensor();
  at::Tensor dz = has(z) ? at::empty_like(*z) : at::Tensor();
  at::Tensor dbias = has(delta_bias) ? at::empty_like(*delta_bias) : at::Tensor();
  switch (u.scalar_type()) {
    case at::kFloat:
      run_bwd<float, float>(u, delta, pr, N, D, z, delta_bias, dout, delta_softplus, reverse, du, ddelta, dA, dB, dC, dD,
                            dz, dbias, h0p, dlastp, dh0p);
      break;
    case at::kDouble:
      run_bwd<double, double>(u, delta, pr, N, D, z, delta_bias, dout, delta_softplus, reverse, du, ddelta, dA, dB, dC,
                              dD, dz, dbias, h0p, dlastp, dh0p);
      break;
    case at::kBFloat16:
      run_bwd<c10::BFloat16, float>(u, delta, pr, N, D, z, delta_bias, dout, delta_softplus, reverse, du, ddelta, dA, dB,
                                    dC, dD, dz, dbias, h0p, dlastp, dh0p);
      break;
    default:
      TORCH_CHECK(false, "selective_scan (cpu): unsupported input dtype ", u.scalar_type(),
                  " (expected float32, float64 or bfloat16)");
  }
  if (!dh0p.defined()) return {du, ddelta, dA, dB, dC, dD, dz, dbias};
  return {du, ddelta, dA, dB, dC, dD, dz, dbias, pr.NP == N ? dh0p : dh0p.narrow(2, 0, N).contiguous()};
}

at::Tensor selective_scan_h0_grad(const at::Tensor& delta, const at::Tensor& A, const at::Tensor& C,
                                  const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& delta_bias,
                                  const at::Tensor& dout, bool delta_softplus, bool reverse) {
  const int64_t N = A.size(1);
  if (delta.numel() == 0) return at::zeros({delta.size(0), delta.size(1), N}, A.options());
  const int64_t block = A.scalar_type() == at::kDouble ? kStateBlock<double> : kStateBlock<float>;
  const int64_t NP = (N + block - 1) / block * block;
  at::Tensor dh0 = at::empty({delta.size(0), delta.size(1), NP}, A.options());
  switch (delta.scalar_type()) {
    case at::kFloat:
      run_h0_grad<float, float>(delta, A, C, z, delta_bias, dout, delta_softplus, reverse, dh0);
      break;
    case at::kDouble:
      run_h0_grad<double, double>(delta, A, C, z, delta_bias, dout, delta_softplus, reverse, dh0);
      break;
    case at::kBFloat16:
      run_h0_grad<c10::BFloat16, float>(delta, A, C, z, delta_bias, dout, delta_softplus, reverse, dh0);
      break;
    default:
      TORCH_CHECK(false, "selective_scan (cpu): unsupported input dtype ", delta.scalar_type(),
                  " (expected float32, float64 or bfloat16)");
  }
  return NP == N ? dh0 : dh0.narrow(2, 0, N).contiguous();
}

at::Tensor delta_sum(const at::Tensor& delta, const std::optional<at::Tensor>& delta_bias, bool delta_softplus) {
  const auto acc = delta.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor sum = at::empty({delta.size(0), delta.size(1)}, delta.options().dtype(acc));
  if (delta.numel() == 0) return sum.zero_();
  switch (delta.scalar_type()) {
    case at::kFloat:
      run_delta_sum<float, float>(delta, delta_bias, delta_softplus, sum);
      break;
    case at::kDouble:
      run_delta_sum<double, double>(delta, delta_bias, delta_softplus, sum);
      break;
    case at::kBFloat16:
      run_delta_sum<c10::BFloat16, float>(delta, delta_bias, delta_softplus, sum);
      break;
    default:
      TORCH_CHECK(false, "selective_scan (cpu): unsupported input dtype ", delta.scalar_type(),
                  " (expected float32, float64 or bfloat16)");
  }
  return sum;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (int i = 0; i <= widest_isa(); ++i) names.emplace_back(kIsaNames[i]);
  return names;
}

std::string isa() { return kIsaNames[current_isa()]; }

std::string set_isa(const std::string& name) {
  const std::string before = isa();
  if (name == "auto") {
    g_isa.store(-1);
    return before;
  }
  for (int i = 0; i <= widest_isa(); ++i) {
    if (name == kIsaNames[i]) {
      g_isa.store(i);
      return before;
    }
  }
  std::string known;
  for (const auto& n : available_isas()) known += " " + n;
  TORCH_CHECK(false, "selective_scan (cpu): instruction set '", name, "' is not available on this CPU; choose auto or",
              known);
}

}  // namespace scan_cpu
}  // namespace vim_ds
