// CPU stand-in for hip/hip_runtime.h (emulator only): the CUDA shim plus HIP's shuffle, whose width defaults to
// the wavefront (64 on CDNA), and whose lane ids are 0..63. The wave64 build of the emulator compiles the device
// code through its HIP branch (SS_HIP) with this header and schedules 64-lane wavefronts.
#pragma once
#include "../cuda_runtime.h"

#ifndef __AMDGCN_WAVEFRONT_SIZE
#define __AMDGCN_WAVEFRONT_SIZE 64
#endif

template <typename T>
inline T __shfl_xor(T v, int lanemask, int width = __AMDGCN_WAVEFRONT_SIZE) {
  if (width != emu::config().warp) emu::fatal("HIP shuffle width differs from the emulated wavefront");
  emu::Thread* t = emu::sched().cur;
  t->val = double(v);
  t->lanemask = lanemask;
  emu::yield(emu::AT_SHFL);
  return T(t->res);
}
#if defined(EMU_COUNT)
template <typename T>
inline emu::Acc<T> __shfl_xor(emu::Acc<T> v, int lanemask, int width = __AMDGCN_WAVEFRONT_SIZE) {
  emu::acc_shfl_send(&v);
  emu::Acc<T> r(__shfl_xor(v.v, lanemask, width));
  emu::acc_shfl_recv(&r);
  return r;
}
#endif
// HIP's pause between two reads of a flag (see __nanosleep in the CUDA shim).
inline void __builtin_amdgcn_s_sleep(int) { __nanosleep(0); }
