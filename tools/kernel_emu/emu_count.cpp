// The counting build's bookkeeping (see shim/emu_count.h): compiled WITHOUT -fsanitize=thread, so that nothing in
// here calls the access hooks it defines. One OS thread runs the whole emulator, so plain globals suffice.
#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <string>

#include "emu_count.h"

namespace emu {
namespace {

// What one launch cost (every field summed over its blocks and lanes; bytes in 32-byte sectors).
struct LaunchCount {
  std::string name;
  int pass = -1;
  long long blocks = 0, threads = 0, barriers = 0, shuffles = 0;
  long long read_bytes = 0, write_bytes = 0;      // per warp instruction: 32 x its distinct sectors
  long long read_unique = 0, write_unique = 0;    // 32 x the distinct sectors of the whole launch (reads: those
                                                  // not written in full by the launch before, see access)
  long long exp = 0, fma = 0, chain = 0;
  long long smem_accesses = 0;   // warp instructions that load or store shared memory
  long long smem_wavefronts = 0; // what they take at 32 banks of 4 bytes: per instruction, the most distinct words
                                 // any one bank holds (a word several lanes read is served once)
  long long smem_conflicts = 0;  // the wavefronts beyond what each instruction's distinct words need at 32 banks
                                 // (their number / 32, rounded up: a 16-byte row a lane takes 4 for 32 lanes)
};

// The shadow of an accumulation value: a value number (0: never seen), the length of the longest chain of
// dependent steps that ends in it, and for a product not yet added anywhere the chain of its operands (else -1).
struct Shadow {
  uint32_t id;
  int32_t depth;
  int32_t fuse;
};

// Shadow memory, 12 bytes per 4-byte word, by page (values live on the threads' stacks, in shared memory and in
// the global buffers).
constexpr uintptr_t kPage = 4096;
struct ShadowMap {
  std::unordered_map<uintptr_t, std::unique_ptr<Shadow[]>> pages;
  uintptr_t last_page = ~uintptr_t(0);
  Shadow* last = nullptr;
  Shadow& at(const void* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p), page = a / kPage;
    if (page != last_page) {
      auto& slot = pages[page];
      if (!slot) {
        slot.reset(new Shadow[kPage / 4]);
        std::memset(slot.get(), 0, sizeof(Shadow) * (kPage / 4));
      }
      last_page = page;
      last = slot.get();
    }
    return last[(a % kPage) / 4];
  }
  void clear() {
    pages.clear();
    last_page = ~uintptr_t(0);
    last = nullptr;
  }
};

struct OpKey {
  char op;
  uint32_t a, b;
  bool operator==(const OpKey& o) const { return op == o.op && a == o.a && b == o.b; }
};
struct OpKeyHash {
  size_t operator()(const OpKey& k) const {
    return std::hash<uint64_t>()((uint64_t(k.a) << 32 | k.b) * 31 + uint64_t(k.op));
  }
};

// Per lane, between two switch points: how often it reached each access site, the values it computed (for the
// common-subexpression rule) and the products it has already fused into an add.
struct Lane {
  std::unordered_map<uintptr_t, int> visits;
  std::unordered_map<OpKey, Shadow, OpKeyHash> memo;
  std::unordered_set<uint32_t> fused;
  Shadow sent{0, 0, -1}, received{0, 0, -1};
};

// One warp instruction's accesses: (warp, site, occurrence, store?) -> sectors.
struct AccessKey {
  int warp;
  uintptr_t site;
  int visit;
  bool write;
  bool operator==(const AccessKey& o) const {
    return warp == o.warp && site == o.site && visit == o.visit && write == o.write;
  }
};
struct AccessKeyHash {
  size_t operator()(const AccessKey& k) const {
    return std::hash<uint64_t>()(uint64_t(k.site) * 1000003u + uint64_t(k.visit) * 131u + uint64_t(k.warp) * 2 +
                                 k.write);
  }
};

struct Counter {
  int lane = -1;  // the thread running now, -1: none (the scheduler or the host)
  int warp = 32;
  std::vector<std::pair<uintptr_t, uintptr_t>> globals;  // [begin, end)
  uintptr_t smem_begin = 0, smem_end = 0;
  std::vector<LaunchCount> launches;
  bool in_launch = false;
  ShadowMap shadow;
  uint32_t next_id = 1;
  std::vector<Lane> lanes;
  std::unordered_map<AccessKey, std::vector<uint64_t>, AccessKeyHash> round;
  std::unordered_map<AccessKey, std::vector<uint64_t>, AccessKeyHash> smem_round;  // -> 4-byte words
  std::unordered_set<uint64_t> read_sectors, write_sectors;
  std::unordered_map<uint64_t, uint32_t> written;  // sector -> the bytes of it the launch has written so far
};
Counter& C() {
  static Counter c;
  return c;
}

LaunchCount& cur() { return C().launches.back(); }

bool in_thread() { return C().lane >= 0; }
bool in_kernel() { return C().in_launch && in_thread(); }

Lane& lane() {
  const int tid = C().lane;
  auto& lanes = C().lanes;
  if (int(lanes.size()) <= tid) lanes.resize(tid + 1);
  return lanes[tid];
}

bool is_global(uintptr_t a) {
  for (const auto& r : C().globals)
    if (a >= r.first && a < r.second) return true;
  return false;
}

// In memory (shared or global) a product is a stored value: it no longer fuses into an add.
bool in_memory(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return (a >= C().smem_begin && a < C().smem_end) || is_global(a);
}

Shadow fresh_shadow() { return Shadow{C().next_id++, 0, -1}; }

// The shadow of a value about to be read; one never written by an accumulation value (an input) gets a number.
Shadow read(const void* p) {
  Shadow& s = C().shadow.at(p);
  if (s.id == 0) s = fresh_shadow();
  return s;
}

void note_depth(int32_t d) {
  if (C().in_launch && d > cur().chain) cur().chain = d;
}

void access(const void* p, size_t size, bool write, const void* site) {
  if (!in_kernel() || size == 0) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const bool shared = a >= C().smem_begin && a < C().smem_end;
  if (!shared && !is_global(a)) return;
  race_access(a, size, write, shared, C().lane, site);
  Lane& l = lane();
  const int visit = l.visits[reinterpret_cast<uintptr_t>(site)]++;
  const AccessKey key{C().lane / C().warp, reinterpret_cast<uintptr_t>(site), visit, write};
  if (shared) {  // 4-byte words, relative to the block's array (which starts on a bank boundary on a GPU)
    auto& words = C().smem_round[key];
    for (uint64_t w = (a - C().smem_begin) / 4; w <= (a - C().smem_begin + size - 1) / 4; ++w) words.push_back(w);
    return;
  }
  auto& sectors = C().round[key];
  for (uint64_t s = a / 32; s <= (a + size - 1) / 32; ++s) {
    sectors.push_back(s);
    // the bytes of sector s this access touches
    const uint64_t lo = std::max<uint64_t>(a, s * 32) - s * 32, hi = std::min<uint64_t>(a + size, s * 32 + 32) - s * 32;
    const uint32_t bytes = uint32_t(((uint64_t(1) << hi) - 1) & ~((uint64_t(1) << lo) - 1));
    if (write) {
      C().written[s] |= bytes;
    } else {
      // What an ideal cache fetches: a read of bytes the launch wrote before (a sum another block stored, read back
      // by the next: the backward's chain) finds them in the cache; any other read fetches the sector.
      auto it = C().written.find(s);
      if (it == C().written.end() || (it->second & bytes) != bytes) C().read_sectors.insert(s);
    }
  }
}

// An arithmetic result: `cost` FMA-pipe operations, a chain of `depth`, remembered for the subexpression rule.
void result(const void* dst, const OpKey& key, long long cost, int32_t depth, int32_t fuse) {
  Shadow s{C().next_id++, depth, fuse};
  if (C().in_launch) cur().fma += cost;
  note_depth(depth);
  if (in_thread()) lane().memo.emplace(key, s);
  C().shadow.at(dst) = s;
}

// The value this lane computed from the same operation on the same values since its last switch point, if any.
bool reuse(const void* dst, const OpKey& key) {
  if (!in_thread()) return false;
  Lane& l = lane();
  auto it = l.memo.find(key);
  if (it == l.memo.end()) return false;
  C().shadow.at(dst) = it->second;
  return true;
}

}  // namespace

void count_global(const void* p, size_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  C().globals.emplace_back(a, a + bytes);
}
void count_clear_globals() { C().globals.clear(); }

void count_smem(const void* p, size_t bytes) {
  C().smem_begin = reinterpret_cast<uintptr_t>(p);
  C().smem_end = C().smem_begin + bytes;
}

void count_lane(int tid) { C().lane = tid; }

// The call site of a row (smem_load / smem_store, inlined into the kernel) is the return address of these calls.
__attribute__((noinline)) void wide_load(void* dst, const void* src, size_t bytes, size_t elem) {
  access(src, bytes, false, __builtin_return_address(0));
  for (size_t i = 0; i < bytes; i += elem) {
    std::memcpy(static_cast<char*>(dst) + i, static_cast<const char*>(src) + i, elem);
    acc_copy(static_cast<char*>(dst) + i, static_cast<const char*>(src) + i);
  }
}
__attribute__((noinline)) void wide_store(void* dst, const void* src, size_t bytes, size_t elem) {
  access(dst, bytes, true, __builtin_return_address(0));
  for (size_t i = 0; i < bytes; i += elem) {
    std::memcpy(static_cast<char*>(dst) + i, static_cast<const char*>(src) + i, elem);
    acc_assign(static_cast<char*>(dst) + i, static_cast<const char*>(src) + i);
  }
}

void count_launch_begin(const void* kernel, int pass, unsigned blocks, unsigned threads, int warp) {
  C().warp = warp;
  LaunchCount n;
  Dl_info info;
  if (dladdr(kernel, &info) != 0 && info.dli_sname != nullptr) {
    int status = 0;
    char* demangled = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
    n.name = status == 0 ? demangled : info.dli_sname;
    std::free(demangled);
  } else {
    n.name = "?";
  }
  n.pass = pass;
  n.blocks = blocks;
  n.threads = (long long)blocks * threads;
  race_launch(n.name.c_str(), warp, C().smem_begin, C().globals);
  C().launches.push_back(n);
  C().in_launch = true;
  C().shadow.clear();  // values loaded by this launch start their chains here
  C().read_sectors.clear();
  C().write_sectors.clear();
  C().written.clear();
}

void count_launch_end() {
  cur().read_unique = 32 * (long long)C().read_sectors.size();
  cur().write_unique = 32 * (long long)C().write_sectors.size();
  C().read_sectors.clear();
  C().write_sectors.clear();
  C().written.clear();
  C().in_launch = false;
}

void count_round_end() {
  race_round_end();
  for (auto& kv : C().round) {
    std::vector<uint64_t>& s = kv.second;
    std::sort(s.begin(), s.end());
    s.erase(std::unique(s.begin(), s.end()), s.end());
    (kv.first.write ? cur().write_bytes : cur().read_bytes) += 32 * (long long)s.size();
    if (kv.first.write) C().write_sectors.insert(s.begin(), s.end());  // (reads: see access)
  }
  C().round.clear();
  for (auto& kv : C().smem_round) {
    std::vector<uint64_t>& w = kv.second;
    std::sort(w.begin(), w.end());
    w.erase(std::unique(w.begin(), w.end()), w.end());
    int per_bank[32] = {0};
    int most = 0;
    for (uint64_t word : w) most = std::max(most, ++per_bank[word % 32]);
    ++cur().smem_accesses;
    cur().smem_wavefronts += most;
    cur().smem_conflicts += most - (long long)(w.size() + 31) / 32;
  }
  C().smem_round.clear();
  for (Lane& l : C().lanes) {
    l.visits.clear();
    l.memo.clear();
    l.fused.clear();
  }
}

void count_barrier() {
  ++cur().barriers;
  race_epoch_end();
}
void count_block_begin(unsigned block) { race_block(block); }
void count_block_end() { race_epoch_end(); }
void count_shuffle(int warps) { cur().shuffles += warps; }
void count_shuffle_pair(int dst_tid, int src_tid) {
  auto& lanes = C().lanes;
  const int need = std::max(dst_tid, src_tid) + 1;
  if (int(lanes.size()) < need) lanes.resize(need);
  lanes[dst_tid].received = lanes[src_tid].sent;
}

void acc_fresh(const void* self) { C().shadow.at(self) = fresh_shadow(); }

void acc_copy(const void* dst, const void* src) {
  Shadow s = read(src);
  if (in_memory(dst) || in_memory(src)) s.fuse = -1;
  C().shadow.at(dst) = s;
}

void acc_assign(const void* dst, const void* src) {
  Shadow s = read(src);
  s.fuse = -1;
  C().shadow.at(dst) = s;
}

void acc_arith(const void* dst, char op, const void* a, const void* b) {
  Shadow x = read(a), y = read(b);
  const bool commutes = op != '-';
  const OpKey key{op, commutes ? std::min(x.id, y.id) : x.id, commutes ? std::max(x.id, y.id) : y.id};
  if (reuse(dst, key)) return;
  if (op == '*') {
    const int32_t operands = std::max(x.depth, y.depth);
    result(dst, key, 1, operands + 1, operands);
    return;
  }
  // An add or subtract with a product operand is the product's fused multiply-add: free the first time that
  // product is fused, one more FMA each further time (the multiply was counted when it was made).
  if (y.fuse >= 0 && (x.fuse < 0 || (in_thread() && lane().fused.count(x.id)))) std::swap(x, y);
  if (x.fuse >= 0) {
    long long cost = 1;
    if (in_thread()) cost = lane().fused.insert(x.id).second ? 0 : 1;
    result(dst, key, cost, std::max(x.fuse, y.depth) + 1, -1);
    return;
  }
  result(dst, key, 1, std::max(x.depth, y.depth) + 1, -1);
}

void acc_div(const void* dst, const void* a, const void* b, bool dividend_is_one) {
  // a reciprocal (special-function unit), then a multiply unless the dividend is 1
  const Shadow x = read(a), y = read(b);
  const OpKey key{dividend_is_one ? 'r' : '/', dividend_is_one ? 0 : x.id, y.id};
  if (reuse(dst, key)) return;
  if (C().in_launch) ++cur().exp;
  const int32_t depth = dividend_is_one ? y.depth + 1 : std::max(x.depth, y.depth + 1) + 1;
  result(dst, key, dividend_is_one ? 0 : 1, depth, -1);
}

void acc_neg(const void* dst, const void* a) {
  // a sign flip is an operand modifier on both vendors: no operation, no step
  const Shadow x = read(a);
  const OpKey key{'n', x.id, 0};
  if (reuse(dst, key)) return;
  Shadow s{C().next_id++, x.depth, x.fuse};
  if (in_thread()) lane().memo.emplace(key, s);
  C().shadow.at(dst) = s;
}

void acc_sfu(const void* dst, char op, const void* a) {
  const Shadow x = read(a);
  const OpKey key{op, x.id, 0};
  if (reuse(dst, key)) return;
  if (C().in_launch) ++cur().exp;
  result(dst, key, 0, x.depth + 1, -1);
}

void acc_shfl_send(const void* v) {
  if (in_thread()) lane().sent = read(v);
}

void acc_shfl_recv(const void* dst) {
  // the exchange is one step of the chain
  if (!in_thread()) return;
  const Shadow got = lane().received;
  Shadow s{C().next_id++, got.depth + 1, -1};
  note_depth(s.depth);
  C().shadow.at(dst) = s;
}

}  // namespace emu

// The ThreadSanitizer instrumentation's calls (-fsanitize=thread on emu_main.cpp): each load and store of the
// kernels, with its address and size; the call site is the return address.
#define EMU_SITE __builtin_return_address(0)
extern "C" {
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
// the guard of a function-local static (one OS thread: a plain load)
char __tsan_atomic8_load(const volatile char* p, int) { return *p; }
#define EMU_TSAN_SIZED(n)                                                                         \
  void __tsan_read##n(void* p) { emu::access(p, n, false, EMU_SITE); }                            \
  void __tsan_write##n(void* p) { emu::access(p, n, true, EMU_SITE); }                            \
  void __tsan_unaligned_read##n(void* p) { emu::access(p, n, false, EMU_SITE); }                  \
  void __tsan_unaligned_write##n(void* p) { emu::access(p, n, true, EMU_SITE); }
EMU_TSAN_SIZED(1)
EMU_TSAN_SIZED(2)
EMU_TSAN_SIZED(4)
EMU_TSAN_SIZED(8)
EMU_TSAN_SIZED(16)
#undef EMU_TSAN_SIZED
void __tsan_read_range(void* p, unsigned long n) { emu::access(p, n, false, EMU_SITE); }
void __tsan_write_range(void* p, unsigned long n) { emu::access(p, n, true, EMU_SITE); }

// For ctypes (run_emu.py, vim_ds/cli/bench/scan_counts.py): the launches since the last emu_count_reset.
void emu_count_reset() { emu::C().launches.clear(); }
int emu_count_launches() { return int(emu::C().launches.size()); }
// fields: blocks, threads, pass, barriers, shuffles, read_bytes, write_bytes, read_unique, write_unique, exp, fma,
// chain, smem_accesses, smem_wavefronts, smem_conflicts (15 values); name: the kernel's demangled name. Returns 0, or -1 for no
// such launch.
int emu_count_launch(int i, long long* fields, char* name, int name_len) {
  if (i < 0 || i >= int(emu::C().launches.size())) return -1;
  const auto& n = emu::C().launches[i];
  const long long v[] = {n.blocks,     n.threads,     n.pass,          n.barriers,        n.shuffles,
                         n.read_bytes, n.write_bytes, n.read_unique,   n.write_unique,    n.exp,
                         n.fma,        n.chain,       n.smem_accesses, n.smem_wavefronts, n.smem_conflicts};
  std::copy(v, v + 15, fields);
  std::snprintf(name, size_t(name_len), "%s", n.name.c_str());
  return 0;
}
}
