// The race check of the counting build (see README.md, "Races"): every access a block's threads make to shared
// memory and to the launch's global buffers, logged with its thread and its round of the scheduler, and at each
// __syncthreads (and the block's end) the accesses since the last one searched for pairs a GPU does not order:
// two threads touch the same bytes, at least one of them writes, and no barrier lies between them.
//
// The emulator itself orders more than a GPU does: a shuffle is a switch point for the whole block there (every
// thread waits at it), on a GPU only for the lanes of one warp. So a pair is a hazard by the GPU's rules, whatever
// the emulator's results were:
//   - between warps: threads of two warps, no barrier between (a shuffle orders nothing between warps);
//   - within a warp, unordered: two lanes of one warp between the same two switch points (independent thread
//     scheduling on NVIDIA since Volta: a warp's lanes need not run in lockstep);
//   - within a warp, after a shuffle: two lanes of one warp with only a shuffle between them. A shuffle makes the
//     lanes wait for each other but is not a memory fence in the CUDA memory model (__syncwarp is); reported apart.
// Compiled without -fsanitize=thread (nothing here is instrumented); one OS thread runs the emulator.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include <dlfcn.h>

#include "emu_count.h"

namespace emu {
namespace {

constexpr uintptr_t kUnit = 2;
constexpr size_t kMaxPairs = 200;  // distinct pairs of call sites kept  // bytes: the smallest element the kernels store (bf16, fp16)

struct Access {
  uintptr_t unit;  // address / kUnit
  int tid;
  long long round;
  bool write;
  bool shared;
  const void* site;
};

struct Race {
  std::string kernel;
  unsigned block = 0;
  int warp = 32;
  long long accesses = 0;
  std::vector<Access> log;
  struct Pair {
    int kind;
    const void *a, *b;  // the two call sites (in address order)
    long long times;    // pairs of accesses found
    std::string example;
  };
  std::vector<Pair> pairs;  // each (kind, site, site) once
  long long round = 0;
  uintptr_t smem_begin = 0;
  std::vector<std::pair<uintptr_t, uintptr_t>> globals;
};
Race& R() {
  static Race r;
  return r;
}

const char* kKindNames[kRaceKinds] = {"between warps (shared)", "between warps (global)",
                                      "within a warp, unordered (shared)", "within a warp, unordered (global)",
                                      "within a warp, after a shuffle only (shared)",
                                      "within a warp, after a shuffle only (global)"};

// "library+0xOFFSET", for addr2line on the library's file.
std::string site_name(const void* site) {
  Dl_info info;
  char buf[64];
  if (dladdr(site, &info) != 0 && info.dli_fbase != nullptr) {
    std::snprintf(buf, sizeof buf, "+0x%lx", static_cast<unsigned long>(reinterpret_cast<uintptr_t>(site) -
                                                                       reinterpret_cast<uintptr_t>(info.dli_fbase)));
    return buf;
  }
  std::snprintf(buf, sizeof buf, "%p", site);
  return buf;
}

std::string where(const Access& a) {
  char buf[96];
  const uintptr_t addr = a.unit * kUnit;
  if (a.shared) {
    std::snprintf(buf, sizeof buf, "shared memory byte %lu", static_cast<unsigned long>(addr - R().smem_begin));
    return buf;
  }
  const auto& g = R().globals;
  for (size_t i = 0; i < g.size(); ++i)
    if (addr >= g[i].first && addr < g[i].second) {
      std::snprintf(buf, sizeof buf, "global buffer %zu byte %lu", i, static_cast<unsigned long>(addr - g[i].first));
      return buf;
    }
  return "global memory";
}

void report(int kind, const Access& a, const Access& b) {
  Race& r = R();
  const void *lo = std::min(a.site, b.site), *hi = std::max(a.site, b.site);
  for (auto& p : r.pairs)
    if (p.kind == kind && p.a == lo && p.b == hi) {
      ++p.times;
      return;
    }
  if (r.pairs.size() >= kMaxPairs) return;
  auto one = [&](const Access& x) {
    return "thread " + std::to_string(x.tid) + " (warp " + std::to_string(x.tid / r.warp) + ", round " +
           std::to_string(x.round) + ") " + (x.write ? "writes" : "reads") + " at " + site_name(x.site);
  };
  r.pairs.push_back({kind, lo, hi, 1,
                     std::string(kKindNames[kind]) + ": " + r.kernel + ", block " + std::to_string(r.block) + ", " +
                         where(a) + ": " + one(a) + ", " + one(b)});
}

// The pairs of the accesses since the last barrier.
void check_epoch() {
  Race& r = R();
  auto& log = r.log;
  // in order of bytes, then thread, round, kind and site; a thread's repeats of one access kept once
  auto order = [](const Access& x) { return std::make_tuple(x.unit, x.tid, x.round, x.write, x.site); };
  std::sort(log.begin(), log.end(), [&](const Access& x, const Access& y) { return order(x) < order(y); });
  log.erase(std::unique(log.begin(), log.end(), [&](const Access& x, const Access& y) { return order(x) == order(y); }),
            log.end());
  for (size_t lo = 0; lo < log.size();) {
    size_t hi = lo + 1;
    bool written = log[lo].write, several = false;
    while (hi < log.size() && log[hi].unit == log[lo].unit) {
      written |= log[hi].write;
      several |= log[hi].tid != log[lo].tid;
      ++hi;
    }
    if (written && several) {
      for (size_t i = lo; i < hi; ++i) {
        if (!log[i].write) continue;
        for (size_t j = lo; j < hi; ++j) {
          const Access &w = log[i], &o = log[j];
          if (o.tid == w.tid || (o.write && j < i)) continue;  // one thread; a pair of writes once
          const int base = w.tid / r.warp != o.tid / r.warp ? 0 : w.round == o.round ? 2 : 4;
          report(base + (w.shared ? 0 : 1), w, o);
        }
      }
    }
    lo = hi;
  }
  log.clear();
}

}  // namespace

void race_launch(const char* kernel, int warp, uintptr_t smem_begin,
                 const std::vector<std::pair<uintptr_t, uintptr_t>>& globals) {
  Race& r = R();
  r.kernel = kernel;
  r.warp = warp;
  r.smem_begin = smem_begin;
  r.globals = globals;
}

void race_block(unsigned block) {
  R().block = block;
  R().log.clear();
}

void race_access(uintptr_t addr, size_t size, bool write, bool shared, int tid, const void* site) {
  Race& r = R();
  ++r.accesses;
  for (uintptr_t u = addr / kUnit; u <= (addr + size - 1) / kUnit; ++u)
    r.log.push_back(Access{u, tid, r.round, write, shared, site});
}

void race_round_end() { ++R().round; }
void race_epoch_end() { check_epoch(); }

}  // namespace emu

extern "C" {
// For ctypes (tools/kernel_emu/run_emu.py --races): what was found since the last emu_race_reset.
void emu_race_reset() {
  emu::R().pairs.clear();
  emu::R().accesses = 0;
}
long long emu_race_accesses() { return emu::R().accesses; }
// The distinct (kind, call site, call site) pairs found (at most 200).
int emu_race_pairs() { return int(emu::R().pairs.size()); }
// Pair i: its kind (an index into emu_race_kind's names), how many pairs of accesses it was, and one of them in
// words, the sites as +0xOFFSET into the library (for addr2line). Returns -1 for no such pair.
int emu_race_pair(int i, long long* times, char* text, int text_len) {
  const auto& p = emu::R().pairs;
  if (i < 0 || i >= int(p.size())) return -1;
  *times = p[size_t(i)].times;
  std::snprintf(text, size_t(text_len), "%s", p[size_t(i)].example.c_str());
  return p[size_t(i)].kind;
}
const char* emu_race_kind(int i) { return i >= 0 && i < emu::kRaceKinds ? emu::kKindNames[i] : nullptr; }
}
