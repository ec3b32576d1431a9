// The race check of the counting build (see README.md, "Races"): every access a block's threads make to shared
// memory and to the launch's global buffers, logged with its thread and its round of the scheduler, and at each
// __syncthreads (and the block's end) the accesses since the last one searched for pairs a GPU does not order:
// two threads touch the same bytes, at least one of them writes, and no barrier lies between them.
//
// The emulator itself orders more than a GPU does: a shuffle is a switch point for the whole block there (every
// thread waits at it), on a GPU only for the lanes of one warp; and its blocks run one after another. So a pair is
// a hazard by the GPU's rules, whatever the emulator's results were:
//   - between warps: threads of two warps, no barrier between (a shuffle orders nothing between warps);
//   - within a warp, unordered: two lanes of one warp between the same two switch points (independent thread
//     scheduling on NVIDIA since Volta: a warp's lanes need not run in lockstep);
//   - within a warp, after a shuffle: two lanes of one warp with only a shuffle between them. A shuffle makes the
//     lanes wait for each other but is not a memory fence in the CUDA memory model (__syncwarp is); reported apart;
//   - between blocks: a block reads or overwrites global memory another block of the launch wrote, and no release
//     and acquire order them. The kernels order blocks only through a flag (the backward's chain): the block before
//     stores, passes a barrier, and its thread 0 sets the flag with atomicExch (a release: it publishes the block's
//     writes before that barrier and the thread's own); the block after reads the flag (an acquire: the reading
//     thread sees what the release published, the others after their next barrier), passed on from block to block.
//     Accesses inside atomics are not races; the fences are not modelled (the barriers' places are).
// Compiled without -fsanitize=thread (nothing here is instrumented); one OS thread runs the emulator.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <dlfcn.h>

#include "emu_count.h"

namespace emu {
namespace {

constexpr uintptr_t kUnit = 2;      // bytes: the smallest element the kernels store (bf16, fp16)
constexpr size_t kMaxPairs = 200;  // distinct pairs of call sites kept

struct Access {
  uintptr_t unit;  // address / kUnit
  unsigned block;
  int tid;
  long long epoch;  // barriers the block passed before it
  long long round;  // rounds of the scheduler before it (every switch point ends one)
  long long seq;    // accesses of the launch before it: an order consistent with each thread's program order
  bool write;
  bool shared;
  const void* site;
};

// What one block may see of another's global writes: granted when a thread of it acquired a release.
struct Grant {
  unsigned from;         // the block whose writes
  long long before;      // its writes before this barrier epoch ...
  int releaser;          // ... and those of its releasing thread
  long long release_seq; // ... before the release
  int acquirer;          // who sees them: this thread at once,
  long long acquired_in; // the block's other threads after this epoch's barrier
};
struct Release {
  unsigned block;
  int tid;
  long long epoch, seq;
  std::vector<Grant> passed_on;  // what the releasing thread saw of other blocks (for whoever acquires this)
};
struct LastWrite {
  Access w;
  bool atomic;
  int release;  // index into Race::releases when w was an atomicExch, else -1
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
  long long round = 0, epoch = 0, seq = 0;
  uintptr_t smem_begin = 0;
  std::vector<std::pair<uintptr_t, uintptr_t>> globals;
  // between blocks, for the launch: the last write of each unit of global memory, the releases, each block's grants
  std::unordered_map<uintptr_t, LastWrite> writes;
  std::vector<Release> releases;
  std::unordered_map<unsigned, std::vector<Grant>> grants;
  int atomic = 0;  // inside an atomic: 1 read-modify-write, 2 exchange (a release)
  int release = -1;  // the release the exchange in progress makes
};
Race& R() {
  static Race r;
  return r;
}

// A pair within a block is kind 2 x (0 between warps, 1 within a warp unordered, 2 after a shuffle only) + (1 for
// global memory): check_epoch computes it so.
const char* kKindNames[kRaceKinds] = {"between warps (shared)", "between warps (global)",
                                      "within a warp, unordered (shared)", "within a warp, unordered (global)",
                                      "within a warp, after a shuffle only (shared)",
                                      "within a warp, after a shuffle only (global)", "between blocks (global)"};
constexpr int kBetweenBlocks = 6;

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
    return "block " + std::to_string(x.block) + " thread " + std::to_string(x.tid) + " (warp " +
           std::to_string(x.tid / r.warp) + ", round " + std::to_string(x.round) + ") " +
           (x.write ? "writes" : "reads") + " at " + site_name(x.site);
  };
  r.pairs.push_back({kind, lo, hi, 1, std::string(kKindNames[kind]) + ": " + r.kernel + ", " + where(a) + ": " +
                                          one(a) + ", " + one(b)});
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

// Whether block x.block's access x is ordered after w, another block's write, by the grants it acquired.
bool granted(const Access& w, const Access& x) {
  for (const Grant& g : R().grants[x.block])
    if (g.from == w.block && (w.epoch < g.before || (w.tid == g.releaser && w.seq < g.release_seq)) &&
        (x.tid == g.acquirer || x.epoch > g.acquired_in))
      return true;
  return false;
}

// Thread x.tid of block x.block reads the flag release r set: it sees what r published, its block after a barrier.
void acquire(const Access& x, int r) {
  Race& race = R();
  const Release rel = race.releases[size_t(r)];
  auto& mine = race.grants[x.block];
  mine.push_back(Grant{rel.block, rel.epoch, rel.tid, rel.seq, x.tid, x.epoch});
  for (const Grant& g : rel.passed_on) mine.push_back(Grant{g.from, g.before, g.releaser, g.release_seq, x.tid,
                                                            x.epoch});
}

// An access of global memory against the launch's last write of it by another block.
void between_blocks(const Access& x) {
  Race& r = R();
  if (r.atomic) {  // an atomic is no race; its write is the unit's last (a release for an exchange)
    if (x.write) r.writes[x.unit] = LastWrite{x, true, r.atomic == 2 ? r.release : -1};
    return;
  }
  const auto it = r.writes.find(x.unit);
  if (it != r.writes.end() && it->second.w.block != x.block) {
    const LastWrite& last = it->second;
    if (last.atomic) {
      if (!x.write && last.release >= 0) acquire(x, last.release);
    } else if (!granted(last.w, x)) {
      report(kBetweenBlocks, last.w, x);
    }
  }
  if (x.write) r.writes[x.unit] = LastWrite{x, false, -1};
}

}  // namespace

void race_launch(const char* kernel, int warp, uintptr_t smem_begin,
                 const std::vector<std::pair<uintptr_t, uintptr_t>>& globals) {
  Race& r = R();
  r.kernel = kernel;
  r.warp = warp;
  r.smem_begin = smem_begin;
  r.globals = globals;
  r.writes.clear();
  r.releases.clear();
  r.grants.clear();
  r.seq = 0;
}

void race_block(unsigned block) {
  R().block = block;
  R().epoch = 0;
  R().log.clear();
}

void race_atomic(int kind, int tid) {
  Race& r = R();
  r.atomic = kind;
  if (kind != 2) return;
  Release rel{r.block, tid, r.epoch, r.seq, {}};
  for (const Grant& g : r.grants[r.block])  // what the releasing thread sees of other blocks, passed on
    if (g.acquirer == tid || r.epoch > g.acquired_in) rel.passed_on.push_back(g);
  r.releases.push_back(rel);
  r.release = int(r.releases.size()) - 1;
}

void race_access(uintptr_t addr, size_t size, bool write, bool shared, int tid, const void* site) {
  Race& r = R();
  ++r.accesses;
  for (uintptr_t u = addr / kUnit; u <= (addr + size - 1) / kUnit; ++u) {
    const Access x{u, r.block, tid, r.epoch, r.round, r.seq++, write, shared, site};
    if (!shared) between_blocks(x);
    if (!r.atomic) r.log.push_back(x);
  }
}

void race_round_end() { ++R().round; }
void race_epoch_end() {
  check_epoch();
  ++R().epoch;
}

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
