// Allocators: where tensor memory comes from. The CPU one hands out 64-byte aligned blocks and
// caches freed blocks by size class, so a training step in steady state asks the OS for nothing.
#pragma once

#include <cstddef>
#include <cstdint>

#include "lockstep/tensor/device.h"

namespace lockstep {

struct AllocatorStats {
  int64_t allocated_bytes = 0;   // handed out and not yet returned
  int64_t cached_bytes = 0;      // returned, kept for reuse
  int64_t os_allocations = 0;    // blocks obtained from the OS (cache misses), ever
  int64_t os_frees = 0;          // blocks given back to the OS, ever
  int64_t allocations = 0;       // allocate() calls, ever
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

}  // namespace lockstep
