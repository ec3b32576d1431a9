// CPU selective scan: forward and backward of the recurrence in csrc/README.md.
//
// Layout of the work
//   * One (batch b, channel d) pair is one independent scan over time with a state vector of d_state (N)
//     values. The per-channel routines (`ssm_forward` / `ssm_backward` for the recurrence, `scan_channel_fwd` /
//     `scan_channel_bwd` around them for softplus, D and the silu gate) hold all of the math; everything else
//     is plumbing (dtype conversion, threading, reductions over channels and batch).
//   * The inner loop runs over the state index n, written with GCC/Clang vector extensions: one 32-byte vector
//     (8 floats / 4 doubles) per step, so it does not depend on the auto-vectoriser. The state dimension is
//     zero-padded to a multiple of the vector width (NP >= N): padded lanes have A = B = C = 0, so their state
//     stays 0 and they contribute nothing. B and C are transposed once to (batch, L, NP) in the accumulation
//     type so that this loop reads contiguous memory.
//   * The backward recomputes the forward states of its channel into a thread-local L x NP buffer (cheap next
//     to the reverse pass) instead of saving anything from the forward, so `saved` is an empty tensor.
//   * Threads split the (batch, channel) pairs with at::parallel_for (so torch.set_num_threads applies).
//     Quantities that sum over channels (dB, dC) or over the batch (dA, dD, ddelta_bias) go into partial buffers
//     that belong to a fixed work item, never to a thread, and are summed in a fixed order at the end: results
//     are bitwise reproducible and independent of the number of threads.
//   * On x86-64 the hot code is compiled twice, for baseline x86-64 and for AVX2+FMA, and picked at run time
//     (the binary must not require AVX2). Elsewhere (aarch64) the compiler's baseline vector ISA is used.
//
// Precision: state and accumulation in float32 (float64 for float64 input). float32/bfloat16 use polynomial
// exp / log1p (1-2 ulp, branch-free so they vectorise); float64 uses std::exp / std::log1p so that it can be
// checked against the reference to ~1e-14.
//
// Needs GCC or Clang (vector extensions, target attributes).

#include "selective_scan_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if !defined(__GNUC__) && !defined(__clang__)
#error "selective_scan_cpu.cpp needs GCC or Clang (vector extensions)"
#endif

// Passing 32-byte vectors between functions compiled for different ISAs triggers a GCC ABI note; every function
// taking vectors here is force-inlined into its caller, so no such call exists.
#pragma GCC diagnostic ignored "-Wpsabi"

#define SCAN_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__)
#define SCAN_X86_DISPATCH 1
#define SCAN_TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define SCAN_X86_DISPATCH 0
#endif

namespace vim_ds {
namespace scan_cpu {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Vector types: 32 bytes of the accumulation type (8 floats / 4 doubles), and the integer vector that a
// comparison of two of them yields. Every loop that matters is written on these, explicitly, rather than left to
// the auto-vectoriser (which, without -ffast-math-like flags, refuses loops with selects of float expressions).
// ---------------------------------------------------------------------------------------------------------------

template <typename acc_t>
struct Simd;
template <>
struct Simd<float> {
  typedef float V __attribute__((vector_size(32)));
  typedef int32_t M __attribute__((vector_size(32)));
  static constexpr int64_t W = 8;
};
template <>
struct Simd<double> {
  typedef double V __attribute__((vector_size(32)));
  typedef int64_t M __attribute__((vector_size(32)));
  static constexpr int64_t W = 4;
};
using vf8 = Simd<float>::V;
using vi8 = Simd<float>::M;
using vu8 = uint32_t __attribute__((vector_size(32)));
using vd4 = Simd<double>::V;

// The scans walk the state in blocks of kBlock vectors (16 floats / 8 doubles): one pass over time per block,
// with the block's state and gradient accumulators held in registers. The state dimension is zero-padded to a
// multiple of the block (NP), so N = 16 in float is exactly one block.
constexpr int64_t kBlock = 2;
template <typename acc_t>
constexpr int64_t block_lanes() {
  return kBlock * Simd<acc_t>::W;
}

// Unaligned load / store (memcpy compiles to one vmovups; scratch buffers are only 16-byte aligned).
template <typename V, typename T>
SCAN_INLINE V vload(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V, typename T>
SCAN_INLINE void vstore(T* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
// Every lane = x (brace-initialised so that it compiles to one broadcast).
template <typename V>
SCAN_INLINE V splat(double x);
template <>
SCAN_INLINE vf8 splat<vf8>(double x) {
  const float f = static_cast<float>(x);
  return vf8{f, f, f, f, f, f, f, f};
}
template <>
SCAN_INLINE vd4 splat<vd4>(double x) {
  return vd4{x, x, x, x};
}
template <typename V>
SCAN_INLINE auto hsum(V v) {  // pairwise tree: shorter dependency chain than a running sum
  constexpr int W = sizeof(V) / sizeof(v[0]);
  for (int w = W / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) v[i] += v[i + w];
  return v[0];
}
// Lane-wise m ? a : b, where each lane of m is all ones or all zeros (a comparison result).
template <typename M, typename V>
SCAN_INLINE V select(M m, V a, V b) {
  return (V)((m & (M)a) | (~m & (M)b));
}

// ---------------------------------------------------------------------------------------------------------------
// Elementary functions on vectors. float: branch-free polynomials (Cephes coefficients), 1-2 ulp; double: libm
// per lane, so the float64 path is as exact as the reference.
// ---------------------------------------------------------------------------------------------------------------

// exp(x) = 2^k exp(r), k = round(x / ln2), |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (minimax for relative
// error, 2e-9, far below float rounding): within 1-2 ulp on [kExpLo, kExpHi]. Outside, the argument is clamped:
// exp(x < -87.3) returns a value below 1.2e-38 instead of a subnormal or 0 (irrelevant for a decay factor or a
// sigmoid), and exp(x > 88.3) saturates at ~2e38. NaN propagates.
//
// lo / hi must be splat(kExpLo) / splat(kExpHi). The state loops pass them in as values that are only known at
// run time (ScanArgs::exp_lo / exp_hi): with compile-time constants GCC compiles each clamp to compare + blend,
// with run-time ones to a single max / min, and this function is most of the work of the scan.
constexpr float kExpLo = -87.3f, kExpHi = 88.3f;
SCAN_INLINE vf8 vexp(vf8 x, vf8 lo, vf8 hi) {
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // Round x / ln2 to an integer k with the 1.5 * 2^23 trick: after the addition, k sits in the low mantissa
  // bits of `shifted` (needs no SSE4.1 rounding, nor a float -> int conversion).
  const vf8 magic = splat<vf8>(12582912.0);
  const vf8 shifted = x * 1.44269504088896341f + magic;
  const vf8 k = shifted - magic;
  // Cody-Waite: ln2 split into a part exact in float and a small correction, so r keeps full precision.
  vf8 r = x - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  vf8 p = splat<vf8>(1.384365042e-3);
  p = p * r + 8.374155439e-3f;
  p = p * r + 4.166800210e-2f;
  p = p * r + 1.666643126e-1f;
  p = p * r + 4.999999421e-1f;
  p = p * r + 1.000000032f;
  p = p * r + 1.0f;
  // Times 2^k: add k to the exponent field of p (p is in [0.7, 1.42], k in [-126, 127] after the clamp). The shift
  // by 23 keeps exactly k's two's-complement bits out of `shifted` and drops the magic's.
  return (vf8)((vu8)p + ((vu8)shifted << 23));
}
SCAN_INLINE vd4 vexp(vd4 x, vd4, vd4) {
  for (int i = 0; i < 4; ++i) x[i] = std::exp(x[i]);
  return x;
}
template <typename V>
SCAN_INLINE V vexp(V x) {
  return vexp(x, splat<V>(kExpLo), splat<V>(kExpHi));
}

// log1p(e) for e in [0, 1] (all that softplus needs). log(w) for w = 1 + e with the Cephes logf polynomial,
// plus the classic correction (e - (w - 1)) / w for the rounding of 1 + e, which keeps tiny e exact.
SCAN_INLINE vf8 log1p_unit(vf8 e) {
  const vf8 one = splat<vf8>(1.0);
  const vf8 w = one + e;
  // Bring the argument to [sqrt(1/2), sqrt(2)): log(w) = k ln2 + log(m), with m = w or w / 2.
  const vi8 hi = w > splat<vf8>(1.41421356);
  const vf8 m = select(hi, w * 0.5f, w);
  const vf8 k = select(hi, one, vf8{});
  const vf8 f = m - one;  // exact
  const vf8 f2 = f * f;
  vf8 p = splat<vf8>(7.0376836292e-2);
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  vf8 y = f * f2 * p + k * -2.12194440e-4f;
  y = y - 0.5f * f2;
  const vf8 logw = f + y + k * 0.693359375f;
  return logw + (e - (w - one)) / w;
}

// torch's F.softplus (beta 1, threshold 20): above 20 the input passes through unchanged.
SCAN_INLINE vf8 softplus(vf8 x) {
  // log(1 + e^x) = max(x, 0) + log1p(e^-|x|), which never overflows.
  const vf8 zero{};
  const vf8 ax = select(x < zero, -x, x);
  const vf8 sp = select(x > zero, x, zero) + log1p_unit(vexp(-ax));
  return select(x > splat<vf8>(20.0), x, sp);
}
SCAN_INLINE vd4 softplus(vd4 x) {
  for (int i = 0; i < 4; ++i) x[i] = x[i] > 20.0 ? x[i] : std::log1p(std::exp(x[i]));
  return x;
}

template <typename V>
SCAN_INLINE V sigmoid(V x) {
  const V one = splat<V>(1.0);
  return one / (one + vexp(-x));
}

// d softplus(x) / dx, with the same threshold as torch.
template <typename V>
SCAN_INLINE V softplus_grad(V x) {
  return select(x > splat<V>(20.0), splat<V>(1.0), sigmoid(x));
}

// ---------------------------------------------------------------------------------------------------------------
// Arguments and per-thread scratch.
// ---------------------------------------------------------------------------------------------------------------

template <typename in_t, typename acc_t>
struct ScanArgs {
  int64_t batch = 0, dim = 0, L = 0, N = 0;
  int64_t NP = 0;  // N rounded up to the vector width
  bool softplus = false;
  acc_t exp_lo = 0, exp_hi = 0;  // kExpLo, kExpHi, set at run time (see vexp)
  const in_t* u = nullptr;      // (batch, dim, L)
  const in_t* delta = nullptr;  // (batch, dim, L)
  const in_t* z = nullptr;      // (batch, dim, L) or null
  const acc_t* A = nullptr;     // (dim, NP), zero-padded
  const acc_t* D = nullptr;     // (dim) or null
  const acc_t* bias = nullptr;  // (dim) or null
  const acc_t* Bt = nullptr;    // (batch, L, NP): B transposed, zero-padded, in acc_t
  const acc_t* Ct = nullptr;    // (batch, L, NP)
  // forward output
  in_t* out = nullptr;  // (batch, dim, L)
  // backward
  const in_t* dout = nullptr;  // (batch, dim, L)
  in_t* du = nullptr;          // (batch, dim, L)
  in_t* ddelta = nullptr;      // (batch, dim, L)
  in_t* dz = nullptr;          // (batch, dim, L) or null
  // Backward work items: item i = (b = i / chunks, channel block i % chunks of `chunk_dim` channels).
  int64_t chunks = 1, chunk_dim = 0;
  acc_t* dB_part = nullptr;     // (items, L, NP): sum over the item's channels, zero-initialised
  acc_t* dC_part = nullptr;     // (items, L, NP)
  acc_t* dA_part = nullptr;     // (batch, dim, NP): sum over time
  acc_t* dD_part = nullptr;     // (batch, dim) or null
  acc_t* dbias_part = nullptr;  // (batch, dim) or null
};

// Per-thread scratch. Rows over time have LP = L rounded up to the vector width, so the elementwise loops run in
// whole vectors; the padding lanes start at zero, and whatever they compute is never written out or summed.
template <typename acc_t>
struct Workspace {
  int64_t LP;
  std::vector<acc_t> u, x, dt, dsp, z, go, y, dy, ddt, du, tmp;  // LP each
  std::vector<acc_t> zeros;                                      // NP
  std::vector<acc_t> H, Aexp;                                    // L x NP each (backward only)
  Workspace(int64_t L, int64_t NP, bool backward)
      : LP((L + Simd<acc_t>::W - 1) / Simd<acc_t>::W * Simd<acc_t>::W),
        u(LP), x(LP), dt(LP), z(LP), y(LP), tmp(LP), zeros(NP) {
    if (backward) {
      for (auto* v : {&dsp, &go, &dy, &ddt, &du}) v->assign(LP, acc_t(0));
      H.resize(L * NP);
      Aexp.resize(L * NP);
    }
  }
};

template <typename in_t, typename acc_t>
SCAN_INLINE void load_row(const in_t* __restrict src, int64_t L, acc_t* __restrict dst) {
  for (int64_t t = 0; t < L; ++t) dst[t] = static_cast<acc_t>(src[t]);
}
template <typename in_t, typename acc_t>
SCAN_INLINE void store_row(const acc_t* __restrict src, int64_t L, in_t* __restrict dst) {
  for (int64_t t = 0; t < L; ++t) dst[t] = static_cast<in_t>(src[t]);
}

// ---------------------------------------------------------------------------------------------------------------
// The math, one (batch, channel) pair at a time.
// ---------------------------------------------------------------------------------------------------------------

// dt = softplus(x + bias) (or x + bias), and, if dsp is given, d dt / d x.
template <typename acc_t>
SCAN_INLINE void prepare_delta(const acc_t* __restrict x, acc_t bias, bool use_softplus, int64_t LP,
                               acc_t* __restrict dt, acc_t* __restrict dsp) {
  using V = typename Simd<acc_t>::V;
  constexpr int64_t W = Simd<acc_t>::W;
  const V vb = splat<V>(bias);
  if (use_softplus) {
    for (int64_t t = 0; t < LP; t += W) {
      const V xt = vload<V>(x + t) + vb;
      vstore(dt + t, softplus(xt));
      if (dsp) vstore(dsp + t, softplus_grad(xt));
    }
  } else {
    for (int64_t t = 0; t < LP; t += W) vstore(dt + t, vload<V>(x + t) + vb);
    if (dsp) std::fill(dsp, dsp + LP, acc_t(1));
  }
}

// The recurrence of one channel:
//   h_t[n] = a_t[n] h_{t-1}[n] + dt_t u_t B_t[n],  a_t[n] = exp(dt_t A[n]);   y[t] = sum_n h_t[n] C_t[n]
// (no D term, no gate). For the backward (kStore) it also keeps every h_t and a_t (L x NP each) and adds this
// channel's dC_t[n] += dy_t h_t[n] (dC is the caller's sum over channels).
template <typename acc_t, bool kStore>
SCAN_INLINE void ssm_forward(int64_t L, int64_t NP, const acc_t* __restrict A, const acc_t* __restrict u,
                             const acc_t* __restrict dt, const acc_t* __restrict Bt, const acc_t* __restrict Ct,
                             acc_t* __restrict y, acc_t* __restrict H, acc_t* __restrict Aexp,
                             const acc_t* __restrict dy, acc_t* __restrict dC, acc_t exp_lo, acc_t exp_hi) {
  using V = typename Simd<acc_t>::V;
  constexpr int64_t W = Simd<acc_t>::W;
  const V lo = splat<V>(exp_lo), hi = splat<V>(exp_hi);
  std::fill(y, y + L, acc_t(0));
  for (int64_t n0 = 0; n0 < NP; n0 += kBlock * W) {
    V Ab[kBlock], h[kBlock];
    for (int j = 0; j < kBlock; ++j) {
      Ab[j] = vload<V>(A + n0 + j * W);
      h[j] = V{};
    }
    for (int64_t t = 0; t < L; ++t) {
      // Scalars times vectors below: GCC emits one broadcast for these (better than for a splat helper).
      const acc_t d = dt[t], du = dt[t] * u[t];
      V s{};
      for (int j = 0; j < kBlock; ++j) {
        const int64_t at = t * NP + n0 + j * W;
        const V a = vexp(Ab[j] * d, lo, hi);
        h[j] = a * h[j] + du * vload<V>(Bt + at);
        s += h[j] * vload<V>(Ct + at);
        if (kStore) {
          vstore(H + at, h[j]);
          vstore(Aexp + at, a);
          vstore(dC + at, vload<V>(dC + at) + dy[t] * h[j]);
        }
      }
      y[t] += hsum(s);
    }
  }
}

// Reverse pass of one channel, given dy = dL/dy (before the D term) and the stored h_t, a_t.
// g_t = dL/dh_t = dy_t C_t + a_{t+1} g_{t+1}; then with x_t[n] = dt_t A[n] and ga = g_t h_{t-1} a_t = dL/dx_t:
//   dA[n] = sum_t ga dt_t,  ddt_t = sum_n ga A[n] + u_t sum_n g_t B_t,  du_t += dt_t sum_n g_t B_t,
//   dB_t[n] += g_t dt_t u_t   (dB is the caller's sum over channels).
template <typename acc_t>
SCAN_INLINE void ssm_backward(int64_t L, int64_t NP, const acc_t* __restrict A, const acc_t* __restrict u,
                              const acc_t* __restrict dt, const acc_t* __restrict Bt,
                              const acc_t* __restrict Ct, const acc_t* __restrict H,
                              const acc_t* __restrict Aexp, const acc_t* __restrict zeros,
                              const acc_t* __restrict dy, acc_t* __restrict dB, acc_t* __restrict dA,
                              acc_t* __restrict ddt, acc_t* __restrict du) {
  using V = typename Simd<acc_t>::V;
  constexpr int64_t W = Simd<acc_t>::W;
  std::fill(ddt, ddt + L, acc_t(0));
  for (int64_t n0 = 0; n0 < NP; n0 += kBlock * W) {
    V Ab[kBlock], g[kBlock], dAb[kBlock];
    for (int j = 0; j < kBlock; ++j) {
      Ab[j] = vload<V>(A + n0 + j * W);
      g[j] = V{};  // holds a_{t+1} g_{t+1} on entry to step t
      dAb[j] = V{};
    }
    for (int64_t t = L - 1; t >= 0; --t) {
      const acc_t dtt = dt[t], ut = u[t], dyt = dy[t], dut = dtt * ut;
      const acc_t* __restrict hprev = (t > 0 ? H + (t - 1) * NP : zeros) + n0;
      V s_ga{}, s_gb{};
      for (int j = 0; j < kBlock; ++j) {
        const int64_t at = t * NP + n0 + j * W;
        const V a = vload<V>(Aexp + at);
        const V gn = g[j] + dyt * vload<V>(Ct + at);
        const V ga = gn * vload<V>(hprev + j * W) * a;
        dAb[j] += ga * dtt;
        s_ga += ga * Ab[j];
        s_gb += gn * vload<V>(Bt + at);
        vstore(dB + at, vload<V>(dB + at) + gn * dut);
        g[j] = gn * a;
      }
      const acc_t gb = hsum(s_gb);
      ddt[t] += hsum(s_ga) + ut * gb;
      du[t] += dtt * gb;
    }
    for (int j = 0; j < kBlock; ++j) vstore(dA + n0 + j * W, dAb[j]);
  }
}

template <typename in_t, typename acc_t>
SCAN_INLINE void scan_channel_fwd(const ScanArgs<in_t, acc_t>& p, int64_t b, int64_t d, Workspace<acc_t>& ws) {
  using V = typename Simd<acc_t>::V;
  constexpr int64_t W = Simd<acc_t>::W;
  const int64_t L = p.L, LP = ws.LP, NP = p.NP;
  const int64_t row = (b * p.dim + d) * L;
  acc_t* __restrict u = ws.u.data();
  acc_t* __restrict dt = ws.dt.data();
  acc_t* __restrict y = ws.y.data();
  acc_t* __restrict o = ws.tmp.data();
  load_row(p.u + row, L, u);
  load_row(p.delta + row, L, ws.x.data());
  prepare_delta(ws.x.data(), p.bias ? p.bias[d] : acc_t(0), p.softplus, LP, dt, static_cast<acc_t*>(nullptr));
  ssm_forward<acc_t, false>(L, NP, p.A + d * NP, u, dt, p.Bt + b * L * NP, p.Ct + b * L * NP, y, nullptr,
                            nullptr, nullptr, nullptr, p.exp_lo, p.exp_hi);
  // out = (y + D u) silu(z)
  const V Dd = splat<V>(p.D ? p.D[d] : acc_t(0));
  if (p.z) {
    acc_t* __restrict z = ws.z.data();
    load_row(p.z + row, L, z);
    for (int64_t t = 0; t < LP; t += W) {
      const V zt = vload<V>(z + t);
      vstore(o + t, (vload<V>(y + t) + Dd * vload<V>(u + t)) * zt * sigmoid(zt));
    }
  } else {
    for (int64_t t = 0; t < LP; t += W) vstore(o + t, vload<V>(y + t) + Dd * vload<V>(u + t));
  }
  store_row(o, L, p.out + row);
}

// dB / dC of this channel are added into the work item's (L, NP) buffers dB, dC; dA / dD / ddelta_bias go into
// this (b, d)'s own slots of the partial buffers.
template <typename in_t, typename acc_t>
SCAN_INLINE void scan_channel_bwd(const ScanArgs<in_t, acc_t>& p, int64_t b, int64_t d, Workspace<acc_t>& ws,
                                  acc_t* dB, acc_t* dC) {
  using V = typename Simd<acc_t>::V;
  constexpr int64_t W = Simd<acc_t>::W;
  const int64_t L = p.L, LP = ws.LP, NP = p.NP;
  const int64_t row = (b * p.dim + d) * L;
  acc_t* __restrict u = ws.u.data();
  acc_t* __restrict dt = ws.dt.data();
  acc_t* __restrict dsp = ws.dsp.data();
  acc_t* __restrict y = ws.y.data();
  acc_t* __restrict go = ws.go.data();
  acc_t* __restrict dy = ws.dy.data();
  acc_t* __restrict du = ws.du.data();
  acc_t* __restrict ddt = ws.ddt.data();
  acc_t* __restrict tmp = ws.tmp.data();
  const acc_t* A = p.A + d * NP;
  const acc_t* Bt = p.Bt + b * L * NP;
  const acc_t* Ct = p.Ct + b * L * NP;

  // 1. Through the gate: dy = dout silu(z) does not depend on y, so it is known before the scan.
  const acc_t Dd = p.D ? p.D[d] : acc_t(0);
  const V vD = splat<V>(Dd), one = splat<V>(1.0);
  acc_t* __restrict z = ws.z.data();
  load_row(p.dout + row, L, go);
  if (p.z) {
    load_row(p.z + row, L, z);
    for (int64_t t = 0; t < LP; t += W) {
      const V zt = vload<V>(z + t);
      vstore(dy + t, vload<V>(go + t) * zt * sigmoid(zt));
    }
  } else {
    std::copy(go, go + LP, dy);
  }

  // 2. Recompute the forward of this channel, keeping the states (and adding its dC).
  load_row(p.u + row, L, u);
  load_row(p.delta + row, L, ws.x.data());
  prepare_delta(ws.x.data(), p.bias ? p.bias[d] : acc_t(0), p.softplus, LP, dt, dsp);
  ssm_forward<acc_t, true>(L, NP, A, u, dt, Bt, Ct, y, ws.H.data(), ws.Aexp.data(), dy, dC, p.exp_lo, p.exp_hi);

  // 3. dz = dout y silu'(z), silu'(z) = s (1 + z (1 - s)) with y the full output before the gate; the skip term.
  if (p.z) {
    for (int64_t t = 0; t < LP; t += W) {
      const V zt = vload<V>(z + t);
      const V sg = sigmoid(zt);
      const V yt = vload<V>(y + t) + vD * vload<V>(u + t);
      vstore(tmp + t, vload<V>(go + t) * yt * sg * (one + zt * (one - sg)));
    }
    store_row(tmp, L, p.dz + row);
  }
  for (int64_t t = 0; t < LP; t += W) vstore(du + t, vload<V>(dy + t) * vD);
  acc_t dD = 0;
  for (int64_t t = 0; t < L; ++t) dD += dy[t] * u[t];

  // 4. The reverse recurrence.
  ssm_backward(L, NP, A, u, dt, Bt, Ct, ws.H.data(), ws.Aexp.data(), ws.zeros.data(), dy, dB,
               p.dA_part + (b * p.dim + d) * NP, ddt, du);

  // 5. Back through softplus(delta + bias).
  for (int64_t t = 0; t < LP; t += W) vstore(tmp + t, vload<V>(ddt + t) * vload<V>(dsp + t));
  acc_t dbias = 0;
  for (int64_t t = 0; t < L; ++t) dbias += tmp[t];
  store_row(tmp, L, p.ddelta + row);
  store_row(du, L, p.du + row);
  if (p.dD_part) p.dD_part[b * p.dim + d] = dD;
  if (p.dbias_part) p.dbias_part[b * p.dim + d] = dbias;
}

// ---------------------------------------------------------------------------------------------------------------
// Ranges of work, compiled per instruction set. The *_impl bodies are force-inlined into each variant so that
// all of the math above is generated with that variant's instructions.
// ---------------------------------------------------------------------------------------------------------------

template <typename in_t, typename acc_t>
SCAN_INLINE void fwd_range_impl(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  Workspace<acc_t> ws(p.L, p.NP, /*backward=*/false);
  for (int64_t i = begin; i < end; ++i) scan_channel_fwd(p, i / p.dim, i % p.dim, ws);
}

template <typename in_t, typename acc_t>
SCAN_INLINE void bwd_range_impl(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  Workspace<acc_t> ws(p.L, p.NP, /*backward=*/true);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / p.chunks;
    const int64_t d0 = (item % p.chunks) * p.chunk_dim;
    const int64_t d1 = std::min(p.dim, d0 + p.chunk_dim);
    acc_t* dB = p.dB_part + item * p.L * p.NP;
    acc_t* dC = p.dC_part + item * p.L * p.NP;
    for (int64_t d = d0; d < d1; ++d) scan_channel_bwd(p, b, d, ws, dB, dC);
  }
}

template <typename in_t, typename acc_t>
void fwd_range_generic(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  fwd_range_impl(p, begin, end);
}
template <typename in_t, typename acc_t>
void bwd_range_generic(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  bwd_range_impl(p, begin, end);
}

#if SCAN_X86_DISPATCH
template <typename in_t, typename acc_t>
SCAN_TARGET_AVX2 void fwd_range_avx2(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  fwd_range_impl(p, begin, end);
}
template <typename in_t, typename acc_t>
SCAN_TARGET_AVX2 void bwd_range_avx2(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
  bwd_range_impl(p, begin, end);
}

bool cpu_has_avx2_fma() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
}
#endif

template <typename in_t, typename acc_t>
void fwd_range(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
#if SCAN_X86_DISPATCH
  if (cpu_has_avx2_fma()) return fwd_range_avx2(p, begin, end);
#endif
  fwd_range_generic(p, begin, end);
}

template <typename in_t, typename acc_t>
void bwd_range(const ScanArgs<in_t, acc_t>& p, int64_t begin, int64_t end) {
#if SCAN_X86_DISPATCH
  if (cpu_has_avx2_fma()) return bwd_range_avx2(p, begin, end);
#endif
  bwd_range_generic(p, begin, end);
}

// ---------------------------------------------------------------------------------------------------------------
// Drivers.
// ---------------------------------------------------------------------------------------------------------------

// Roughly how many (b, d, t, n) steps one parallel chunk should hold, so tiny problems do not pay for threads.
constexpr int64_t kMinStepsPerChunk = 1 << 15;
// The backward cuts each batch row into enough channel blocks to have about this many work items overall.
// It depends on the shape only, so the summation order (and the result) does not depend on the thread count.
constexpr int64_t kTargetBackwardItems = 32;

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

template <typename acc_t>
const acc_t* opt_ptr(const std::optional<at::Tensor>& t) {
  return has(t) ? t->data_ptr<acc_t>() : nullptr;
}

int64_t padded_state(int64_t N, at::ScalarType acc) {
  const int64_t W = acc == at::kDouble ? block_lanes<double>() : block_lanes<float>();
  return (N + W - 1) / W * W;
}

// B or C (batch, N, L) -> (batch, L, NP) in the accumulation type, zero in the padding.
at::Tensor to_time_major(const at::Tensor& x, at::ScalarType acc, int64_t NP) {
  at::Tensor out = at::zeros({x.size(0), x.size(2), NP}, x.options().dtype(acc));
  out.narrow(2, 0, x.size(1)).copy_(x.transpose(1, 2));
  return out;
}

// A (dim, N) -> (dim, NP), zero in the padding.
at::Tensor pad_state(const at::Tensor& A, int64_t NP) {
  if (A.size(1) == NP) return A;
  at::Tensor out = at::zeros({A.size(0), NP}, A.options());
  out.narrow(1, 0, A.size(1)).copy_(A);
  return out;
}

// Everything the forward and backward share; the tensors it points into must outlive the returned struct.
struct Prepared {
  at::Tensor A, Bt, Ct;
  int64_t NP;
};

Prepared prepare(const at::Tensor& u, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C) {
  const auto acc = u.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t NP = padded_state(A.size(1), acc);
  return {pad_state(A, NP), to_time_major(B, acc, NP), to_time_major(C, acc, NP), NP};
}

template <typename in_t, typename acc_t>
ScanArgs<in_t, acc_t> common_args(const at::Tensor& u, const at::Tensor& delta, const Prepared& pr, int64_t N,
                                  const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                                  const std::optional<at::Tensor>& delta_bias, bool softplus) {
  ScanArgs<in_t, acc_t> p;
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
             const std::optional<at::Tensor>& delta_bias, bool softplus, at::Tensor& out) {
  auto p = common_args<in_t, acc_t>(u, delta, pr, N, D, z, delta_bias, softplus);
  p.out = out.data_ptr<in_t>();
  const int64_t grain = std::max<int64_t>(1, kMinStepsPerChunk / (p.L * p.NP));
  at::parallel_for(0, p.batch * p.dim, grain, [&](int64_t begin, int64_t end) { fwd_range(p, begin, end); });
}

template <typename in_t, typename acc_t>
void run_bwd(const at::Tensor& u, const at::Tensor& delta, const Prepared& pr, int64_t N,
             const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
             const std::optional<at::Tensor>& delta_bias, const at::Tensor& dout, bool softplus, at::Tensor& du,
             at::Tensor& ddelta, at::Tensor& dA, at::Tensor& dB, at::Tensor& dC, at::Tensor& dD, at::Tensor& dz,
             at::Tensor& dbias) {
  auto p = common_args<in_t, acc_t>(u, delta, pr, N, D, z, delta_bias, softplus);
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
  at::Tensor dD_part = dD.defined() ? at::zeros({batch, dim}, acc_opts) : at::Tensor();
  at::Tensor dbias_part = dbias.defined() ? at::zeros({batch, dim}, acc_opts) : at::Tensor();
  p.dB_part = dB_part.data_ptr<acc_t>();
  p.dC_part = dC_part.data_ptr<acc_t>();
  p.dA_part = dA_part.data_ptr<acc_t>();
  p.dD_part = dD_part.defined() ? dD_part.data_ptr<acc_t>() : nullptr;
  p.dbias_part = dbias_part.defined() ? dbias_part.data_ptr<acc_t>() : nullptr;

  const int64_t grain = std::max<int64_t>(1, kMinStepsPerChunk / (p.chunk_dim * L * NP));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) { bwd_range(p, begin, end); });

  // Fixed-order reductions of the partials.
  //   dB[b, n, t] = sum_k dB_part[b * chunks + k, t, n]   (and dC alike), written in the input dtype.
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
                         dB_out[bn * L + t] = static_cast<in_t>(sb);
                         dC_out[bn * L + t] = static_cast<in_t>(sc);
                       }
                     }
                   });
  //   dA, dD, ddelta_bias: sum over the batch.
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

}  // namespace

std::vector<at::Tensor> selective_scan_fwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                           const at::Tensor& B, const at::Tensor& C,
                                           const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                                           const std::optional<at::Tensor>& delta_bias, bool delta_softplus) {
  const Prepared pr = prepare(u, A, B, C);
  const int64_t N = A.size(1);
  at::Tensor out = at::empty_like(u);
  switch (u.scalar_type()) {
    case at::kFloat:
      run_fwd<float, float>(u, delta, pr, N, D, z, delta_bias, delta_softplus, out);
      break;
    case at::kDouble:
      run_fwd<double, double>(u, delta, pr, N, D, z, delta_bias, delta_softplus, out);
      break;
    case at::kBFloat16:
      run_fwd<c10::BFloat16, float>(u, delta, pr, N, D, z, delta_bias, delta_softplus, out);
      break;
    default:
      TORCH_CHECK(false, "selective_scan (cpu): unsupported input dtype ", u.scalar_type(),
                  " (expected float32, float64 or bfloat16)");
  }
  return {out, at::empty({0}, u.options())};
}

std::vector<at::Tensor> selective_scan_bwd(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                           const at::Tensor& B, const at::Tensor& C,
                                           const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                                           const std::optional<at::Tensor>& delta_bias, const at::Tensor& dout,
                                           bool delta_softplus) {
  const Prepared pr = prepare(u, A, B, C);
  const int64_t N = A.size(1);
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
      run_bwd<float, float>(u, delta, pr, N, D, z, delta_bias, dout, delta_softplus, du, ddelta, dA, dB, dC, dD,
                            dz, dbias);
      break;
    case at::kDouble:
      run_bwd<double, double>(u, delta, pr, N, D, z, delta_bias, dout, delta_softplus, du, ddelta, dA, dB, dC,
                              dD, dz, dbias);
      break;
    case at::kBFloat16:
      run_bwd<c10::BFloat16, float>(u, delta, pr, N, D, z, delta_bias, dout, delta_softplus, du, ddelta, dA, dB,
                                    dC, dD, dz, dbias);
      break;
    default:
      TORCH_CHECK(false, "selective_scan (cpu): unsupported input dtype ", u.scalar_type(),
                  " (expected float32, float64 or bfloat16)");
  }
  return {du, ddelta, dA, dB, dC, dD, dz, dbias};
}

}  // namespace scan_cpu
}  // namespace vim_ds
