// The caching CPU allocator: 64-byte aligned blocks, freed blocks kept per size class.
#include "lockstep/tensor/allocator.h"

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
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

class CachingCpuAllocator final : public Allocator {
 public:
  ~CachingCpuAllocator() override { empty_cache(); }

  void* allocate(size_t nbytes) override {
    size_t cls = size_class(nbytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.allocations;
      auto it = free_.find(cls);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        stats_.cached_bytes -= static_cast<int64_t>(cls);
        stats_.allocated_bytes += static_cast<int64_t>(cls);
        return p;
      }
      ++stats_.os_allocations;
      stats_.allocated_bytes += static_cast<int64_t>(cls);
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

 private:
  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  AllocatorStats stats_;
  size_t limit_ = default_cache_limit();  // Note [CPU cache limit from the environment]
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

}  // namespace lockstep
