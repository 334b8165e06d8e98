// The caching CPU allocator: 64-byte aligned blocks, freed blocks kept per size class.
#include "lockstep/tensor/allocator.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "lockstep/base/env_var.h"
#include "lockstep/base/error.h"
#include "lockstep/base/worker_env.h"

namespace lockstep {

namespace {

// Note [CPU size classes]
// Requests are rounded up to a class: multiples of 64 bytes up to 1 KiB, then four classes per
// power of two (1, 1.25, 1.5, 1.75 x 2^k), so at most 25% is wasted. A freed block goes on its
// class's free list and the next request of that class takes it back without a system call.
// Fresh pages from the OS cost a page fault each on first touch; reusing warm blocks is what
// keeps a steady training step free of them.
size_t size_class(size_t n) {
  if (n == 0) n = 1;
  if (n <= 1024) return (n + 63) & ~size_t{63};
  int k = 63 - __builtin_clzll(n);  // 2^k <= n < 2^(k+1)
  size_t quarter = size_t{1} << (k - 2);
  return (n + quarter - 1) & ~(quarter - 1);
}

// Note [CPU cache limit from the environment]
// LOCKSTEP_CPU_CACHE_MB is read when the allocator is made, at the first allocation, not at
// static initialization: a bad value then throws from that allocation like an out-of-memory
// error, to a caller that can catch it and print it (the examples' main()), where an exception
// from a static initializer could only reach std::terminate. The allocator is not made until the
// value is good, so every later allocation reports it too.
constexpr int64_t kMaxCacheMb = int64_t{1} << 20;  // 1 TiB
constexpr int64_t kDefaultCacheMb = 4096;

size_t default_cache_limit() {
  const int64_t mb = env_int(env::kCpuCacheMb, 0, kMaxCacheMb,
                             {.unit = "MiB", .note = "freed host memory kept for reuse"})
                         .value_or(kDefaultCacheMb);
  return static_cast<size_t>(mb) << 20;
}

// Note [CPU memory limit]
// With a limit (LOCKSTEP_CPU_MEMORY_LIMIT_MB, or set_cpu_memory_limit), an allocation that would
// bring the bytes of live CPU tensors above it fails before asking the OS: a rank that would not
// fit in its share of a machine's memory stops with a message that names the rank, the size, the
// total it would have reached and what the allocation was for (an AllocationScope's name), rather
// than being killed by the kernel's OOM killer with no word. It is also how a test holds a rank
// to a budget without cgroups: the same model that fails under DDP must train under FSDP.
thread_local const char* current_scope = nullptr;

size_t default_memory_limit() {
  const int64_t mb = env_int(env::kCpuMemoryLimitMb, 0, kMaxCacheMb,
                             {.unit = "MiB", .note = "CPU tensor memory a process may hold"})
                         .value_or(0);
  return static_cast<size_t>(mb) << 20;
}

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / 1048576.0);
  return buf;
}

class CachingCpuAllocator final : public Allocator {
 public:
  ~CachingCpuAllocator() override { empty_cache(); }

  void* allocate(size_t nbytes) override {
    size_t cls = size_class(nbytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (memory_limit_ > 0 && static_cast<size_t>(stats_.allocated_bytes) + cls > memory_limit_)
        throw_over_limit(nbytes, cls);
      ++stats_.allocations;
      auto it = free_.find(cls);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        stats_.cached_bytes -= static_cast<int64_t>(cls);
        stats_.allocated_bytes += static_cast<int64_t>(cls);
        stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
        return p;
      }
      ++stats_.os_allocations;
      stats_.allocated_bytes += static_cast<int64_t>(cls);
      stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
    }
    void* p = std::aligned_alloc(kAlignment, cls);
    if (p == nullptr) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.allocated_bytes -= static_cast<int64_t>(cls);
      LS_THROW("out of CPU memory: could not allocate ", nbytes, " bytes");
    }
    return p;
  }

  void deallocate(void* ptr, size_t nbytes) override {
    if (ptr == nullptr) return;
    size_t cls = size_class(nbytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.allocated_bytes -= static_cast<int64_t>(cls);
      if (static_cast<size_t>(stats_.cached_bytes) + cls <= limit_) {
        free_[cls].push_back(ptr);
        stats_.cached_bytes += static_cast<int64_t>(cls);
        return;
      }
      ++stats_.os_frees;
    }
    std::free(ptr);
  }

  Device device() const override { return kCPU; }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [cls, list] : free_) {
      for (void* p : list) std::free(p);
      stats_.os_frees += static_cast<int64_t>(list.size());
    }
    free_.clear();
    stats_.cached_bytes = 0;
  }

  AllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void set_limit(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    limit_ = bytes;
  }

  void set_memory_limit(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    memory_limit_ = bytes;
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak_allocated_bytes = stats_.allocated_bytes;
  }

 private:
  // Called with mu_ held.
  [[noreturn]] void throw_over_limit(size_t nbytes, size_t cls) const {
    // Under a lock, on the path to an error: the rank as the environment says it, as text.
    const std::optional<std::string> rank_text = env_string(env::kRank);
    const char* rank = rank_text ? rank_text->c_str() : nullptr;
    const char* what = AllocationScope::current();
    LS_THROW(rank ? "rank " : "", rank ? rank : "", rank ? ": " : "", "out of memory: allocating ",
             mib(static_cast<int64_t>(nbytes)), " for ",
             what ? what
                  : "a tensor (activations or "
                    "temporaries)",
             " would bring this process's CPU tensors to ",
             mib(stats_.allocated_bytes + static_cast<int64_t>(cls)), ", above its limit of ",
             mib(static_cast<int64_t>(memory_limit_)), " (", env::kCpuMemoryLimitMb,
             "). Shard the model (FullyShardedDataParallel: --zero 3 in the examples), spread it "
             "over more ranks, or train with a smaller batch.");
  }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  AllocatorStats stats_;
  size_t limit_ = default_cache_limit();          // Note [CPU cache limit from the environment]
  size_t memory_limit_ = default_memory_limit();  // Note [CPU memory limit]
};

CachingCpuAllocator& instance() {
  // Leaked on purpose: tensors in static storage may be freed after main returns.
  static auto* a = new CachingCpuAllocator();
  return *a;
}

}  // namespace

Allocator& cpu_allocator() { return instance(); }
AllocatorStats cpu_allocator_stats() { return instance().stats(); }
void cpu_allocator_empty_cache() { instance().empty_cache(); }
void set_cpu_allocator_cache_limit(size_t bytes) { instance().set_limit(bytes); }
void set_cpu_memory_limit(size_t bytes) { instance().set_memory_limit(bytes); }
void reset_cpu_allocator_peak() { instance().reset_peak(); }

AllocationScope::AllocationScope(const char* what) : previous_(current_scope) {
  current_scope = what;
}
AllocationScope::~AllocationScope() { current_scope = previous_; }
const char* AllocationScope::current() { return current_scope; }

}  // namespace lockstep
