// Allocators: where tensor memory comes from. The CPU one hands out 64-byte aligned blocks and
// caches freed blocks by size class, so a training step in steady state asks the OS for nothing.
#pragma once

#include <cstddef>
#include <cstdint>

#include "lockstep/tensor/device.h"

namespace lockstep {

struct AllocatorStats {
  int64_t allocated_bytes = 0;       // handed out and not yet returned
  int64_t cached_bytes = 0;          // returned, kept for reuse
  int64_t os_allocations = 0;        // blocks obtained from the OS (cache misses), ever
  int64_t os_frees = 0;              // blocks given back to the OS, ever
  int64_t allocations = 0;           // allocate() calls, ever
  int64_t peak_allocated_bytes = 0;  // the most allocated_bytes has been (since reset_peak)
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns at least `nbytes` bytes aligned to kAlignment; never null (throws on failure).
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* ptr, size_t nbytes) = 0;
  virtual Device device() const = 0;
};

inline constexpr size_t kAlignment = 64;

// The process-wide caching CPU allocator (thread-safe).
Allocator& cpu_allocator();
AllocatorStats cpu_allocator_stats();
// Gives every cached block back to the OS.
void cpu_allocator_empty_cache();
// Bytes the CPU cache may hold before it frees instead of caching (default 4 GiB, or
// LOCKSTEP_CPU_CACHE_MB).
void set_cpu_allocator_cache_limit(size_t bytes);
// Note [CPU memory limit]: the most bytes of CPU tensors this process may hold at once (0: no
// limit; default LOCKSTEP_CPU_MEMORY_LIMIT_MB, else none). An allocation beyond it throws an
// out-of-memory error naming the rank, the size and what was being allocated.
void set_cpu_memory_limit(size_t bytes);
// Starts peak_allocated_bytes over from what is allocated now.
void reset_cpu_allocator_peak();

// What the allocations on this thread are for while it lives ("optimizer state", "FSDP: a
// gathered unit"), named by an out-of-memory error. Scopes nest; the innermost names.
class AllocationScope {
 public:
  explicit AllocationScope(const char* what);
  ~AllocationScope();
  AllocationScope(const AllocationScope&) = delete;
  AllocationScope& operator=(const AllocationScope&) = delete;
  // The innermost scope's name on this thread, or null.
  static const char* current();

 private:
  const char* previous_;
};

}  // namespace lockstep
