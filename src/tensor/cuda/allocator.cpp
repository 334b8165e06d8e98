// The caching CUDA device allocator and the pinned host pool.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lockstep/base/log.h"
#include "tensor/block_cache.h"
#include "tensor/cuda/runtime.h"
#include "tensor/cuda_emulated.h"

namespace lockstep::cuda {

namespace {

constexpr int kMaxDevices = 64;

// Note [CUDA caching allocator]
// Device memory comes from a BlockCache per device (Note [Block cache] in
// src/tensor/block_cache.cpp: segments from cudaMalloc cut into blocks and merged again, one
// pool per stream), so a steady training step calls cudaMalloc never (memory_stats().
// cuda_mallocs stops growing after the first step; tests/cuda checks it) and varying sizes do
// not grow the cache without bound. What is CUDA's is here:
// - A block also used on other streams (record_stream: NCCL's communication stream reading a
//   gradient bucket) waits for an event on each of them before it returns to the cache.
// - When cudaMalloc runs out of memory, the blocks still fenced by other streams are waited for
//   and freed into the cache, every free segment is released and the call retried once (the
//   cache's reclaim and retry); then the error says how much was asked, allocated and reserved.
//   Any other cudaMalloc error is thrown as it is.
// - A block freed while fenced counts as allocated no longer (memory_stats()), though the cache
//   hands it out only once its fences have passed.
class DeviceCache final : public Allocator {
 public:
  explicit DeviceCache(int device)
      : device_(device),
        blocks_({.reserve = [this](size_t n) { return cuda_malloc(n); },
                 .release = [this](void* p) { cuda_free(p); },
                 .reclaim = [this] { wait_pending(); }}) {}

  void* allocate(size_t nbytes) override {
    cudaStream_t stream = raw(current_stream(device_));
    std::lock_guard<std::mutex> lock(mu_);
    collect_pending();
    void* p = blocks_.allocate(nbytes, stream);
    if (p == nullptr) out_of_memory(nbytes);
    return p;
  }

  void deallocate(void* ptr, size_t) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (!blocks_.owns(ptr)) return;  // not ours (cannot happen); never free a stranger
    auto used = uses_.find(ptr);
    if (used == uses_.end()) {
      blocks_.free(ptr);
      return;
    }
    // Wait for every other stream that used the block (Note [CUDA caching allocator]).
    Pending p{ptr, {}};
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    for (cudaStream_t s : used->second) {
      cudaEvent_t e = nullptr;
      if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess ||
          cudaEventRecord(e, s) != cudaSuccess) {
        // Cannot fence it: synchronize instead (rare; keeps the block correct).
        (void)cudaGetLastError();
        if (e != nullptr) cudaEventDestroy(e);
        cudaStreamSynchronize(s);
        continue;
      }
      p.events.push_back(e);
    }
    cudaSetDevice(prev);
    uses_.erase(used);
    pending_bytes_ += static_cast<int64_t>(blocks_.size_of(ptr));
    pending_.push_back(std::move(p));
  }

  Device device() const override { return Device(DeviceType::cuda, device_); }

  void record_stream(void* ptr, cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    LS_CHECK(blocks_.owns(ptr), "record_stream: the tensor's memory is not from the caching "
                                "allocator of cuda:", device_);
    if (s == blocks_.stream_of(ptr)) return;
    auto& u = uses_[ptr];
    if (std::find(u.begin(), u.end(), s) == u.end()) u.push_back(s);
  }

  MemoryStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    const detail::BlockCache::Stats& b = blocks_.stats();
    return {.allocated_bytes = b.allocated_bytes - pending_bytes_,
            .reserved_bytes = b.reserved_bytes,
            .peak_allocated_bytes = b.peak_allocated_bytes,
            .peak_reserved_bytes = b.peak_reserved_bytes,
            .allocations = b.allocations,
            .cuda_mallocs = b.reserves,
            .cuda_frees = b.releases,
            .oom_retries = b.oom_retries};
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.reset_peak();
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mu_);
    collect_pending();
    blocks_.release_free_segments();
  }

 private:
  struct Pending {
    void* ptr;
    std::vector<cudaEvent_t> events;
  };

  // Frees into the cache the blocks whose other-stream uses have finished.
  void collect_pending() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      bool done = true;
      for (cudaEvent_t e : it->events) {
        cudaError_t err = cudaEventQuery(e);
        if (err == cudaErrorNotReady) {
          done = false;
          break;
        }
        if (err != cudaSuccess) (void)cudaGetLastError();
      }
      if (!done) {
        ++it;
        continue;
      }
      for (cudaEvent_t e : it->events) cudaEventDestroy(e);
      pending_bytes_ -= static_cast<int64_t>(blocks_.size_of(it->ptr));
      blocks_.free(it->ptr);
      it = pending_.erase(it);
    }
  }

  // The cache's reclaim (out of device memory): waits for every fenced block and frees it.
  void wait_pending() {
    for (auto& pend : pending_)
      for (cudaEvent_t e : pend.events) cudaEventSynchronize(e);
    collect_pending();
  }

  // The cache's device (Note [Block cache]): cudaMalloc on this device, nullptr when it is out
  // of memory; any other error is thrown.
  void* cuda_malloc(size_t n) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, n);
    cudaSetDevice(prev);
    if (err == cudaSuccess) return p;
    (void)cudaGetLastError();
    LS_CHECK(err == cudaErrorMemoryAllocation, "cudaMalloc of ", n, " bytes on cuda:", device_,
             " failed: ", cudaGetErrorString(err));
    return nullptr;
  }

  void cuda_free(void* p) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    cudaFree(p);
    cudaSetDevice(prev);
  }

  [[noreturn]] void out_of_memory(size_t asked) {
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    (void)cudaGetLastError();
    const detail::BlockCache::Stats& b = blocks_.stats();
    LS_THROW("out of memory on cuda:", device_, ": could not allocate ", asked, " bytes (",
             cudaGetErrorString(cudaErrorMemoryAllocation), "); lockstep holds ", b.allocated_bytes,
             " bytes in tensors and ", b.reserved_bytes, " reserved; the device has ", free_b,
             " of ", total_b, " bytes free");
  }

  const int device_;
  std::mutex mu_;
  int64_t pending_bytes_ = 0;  // of the blocks in pending_
  detail::BlockCache blocks_;
  // Blocks used on streams other than their own (record_stream), until they are freed.
  std::unordered_map<void*, std::vector<cudaStream_t>> uses_;
  std::deque<Pending> pending_;
};

struct Caches {
  std::mutex mu;
  std::array<DeviceCache*, kMaxDevices> by_device{};
};

// Never destroyed: tensors in static storage may be freed after main returns.
Caches& caches() {
  static Caches* c = new Caches();
  return *c;
}

DeviceCache& cache_of(int device) {
  LS_CHECK(device >= 0 && device < device_count(), "cuda:", device,
           " is not a visible device (", device_count(), " visible)");
  Caches& c = caches();
  std::lock_guard<std::mutex> lock(c.mu);
  DeviceCache*& d = c.by_device[static_cast<size_t>(device)];
  if (d == nullptr) d = new DeviceCache(device);
  return *d;
}

// -- pinned host memory ------------------------------------------------------------------------
// Size classes as the CPU allocator's (Note [CPU size classes]); a freed block waits for an
// event on the stream that last used it before it is handed out again.
size_t pinned_class(size_t n) {
  if (n == 0) n = 1;
  if (n <= 4096) return (n + 63) & ~size_t{63};
  int k = 63 - __builtin_clzll(n);
  size_t quarter = size_t{1} << (k - 2);
  return (n + quarter - 1) & ~(quarter - 1);
}

class PinnedPool final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    const size_t cls = pinned_class(nbytes);
    std::lock_guard<std::mutex> lock(mu_);
    collect();
    auto it = free_.find(cls);
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      return p;
    }
    void* p = nullptr;
    cudaError_t err = cudaHostAlloc(&p, cls, cudaHostAllocPortable);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      LS_THROW("could not allocate ", nbytes, " bytes of pinned host memory: ",
               cudaGetErrorString(err));
    }
    size_of_[p] = cls;
    return p;
  }

  // A pinned tensor freed while a copy still reads it waits for the streams that copy ran on.
  // Each fence is waited for on its own device: the legacy default stream (nullptr) means the
  // current device's, so an event recorded with another device current would not order it.
  void deallocate(void* ptr, size_t) override {
    std::vector<std::pair<cudaStream_t, int>> used;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = uses_.find(ptr);
      if (it != uses_.end()) {
        used = std::move(it->second);
        uses_.erase(it);
      }
    }
    if (used.empty()) return release(ptr, nullptr, false);
    int prev = 0;
    cudaGetDevice(&prev);
    for (size_t i = 1; i < used.size(); ++i) {
      cudaSetDevice(used[i].second);
      cudaStreamSynchronize(used[i].first);
    }
    cudaSetDevice(used[0].second);
    release(ptr, used[0].first, true);
    cudaSetDevice(prev);
  }

  // Called with the stream's device current (the copy's device guard).
  void fence(void* ptr, cudaStream_t stream) {
    int device = 0;
    cudaGetDevice(&device);
    std::lock_guard<std::mutex> lock(mu_);
    if (size_of_.count(ptr) == 0) return;
    auto& u = uses_[ptr];
    const std::pair<cudaStream_t, int> use{stream, device};
    if (std::find(u.begin(), u.end(), use) == u.end()) u.push_back(use);
  }
  Device device() const override { return kCPU; }

  void release(void* ptr, cudaStream_t stream, bool fence) {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = size_of_.find(ptr);
    if (it == size_of_.end()) return;
    if (!fence) {
      free_[it->second].push_back(ptr);
      return;
    }
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventRecord(e, stream) != cudaSuccess) {
      (void)cudaGetLastError();
      if (e != nullptr) cudaEventDestroy(e);
      cudaStreamSynchronize(stream);
      free_[it->second].push_back(ptr);
      return;
    }
    pending_.push_back({ptr, e});
  }

  bool contains(const void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    return size_of_.count(const_cast<void*>(p)) != 0;
  }

 private:
  void collect() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      cudaError_t err = cudaEventQuery(it->second);
      if (err == cudaErrorNotReady) {
        ++it;
        continue;
      }
      if (err != cudaSuccess) (void)cudaGetLastError();
      cudaEventDestroy(it->second);
      free_[size_of_.at(it->first)].push_back(it->first);
      it = pending_.erase(it);
    }
  }

  std::mutex mu_;
  std::unordered_map<void*, size_t> size_of_;
  // fence(): (stream, its device) per block
  std::unordered_map<void*, std::vector<std::pair<cudaStream_t, int>>> uses_;
  std::map<size_t, std::vector<void*>> free_;
  std::deque<std::pair<void*, cudaEvent_t>> pending_;
};

PinnedPool& pinned_pool() {
  static PinnedPool* p = new PinnedPool();
  return *p;
}

int resolve(int device) { return device < 0 ? current_device() : device; }

}  // namespace

Allocator& device_allocator(int device) {
  return emulated() ? emulation::allocator(device) : cache_of(device);
}

void* alloc_pinned(size_t nbytes) { return pinned_pool().allocate(nbytes); }
void free_pinned(void* ptr, cudaStream_t stream) { pinned_pool().release(ptr, stream, true); }
void fence_pinned(void* block, cudaStream_t stream) { pinned_pool().fence(block, stream); }
Allocator& pinned_allocator() { return pinned_pool(); }
bool is_pinned(const void* ptr) { return pinned_pool().contains(ptr); }

MemoryStats memory_stats(int device) {
  if (emulated()) return emulation::memory_stats(resolve(device));
  if (!is_available()) return {};
  return cache_of(resolve(device)).stats();
}

void reset_peak_stats(int device) {
  if (emulated()) return emulation::reset_peak_stats(resolve(device));
  if (!is_available()) return;
  cache_of(resolve(device)).reset_peak();
}

void empty_cache() {
  if (emulated()) return;  // nothing is cached per emulated device
  for (int d = 0; d < device_count(); ++d) cache_of(d).empty_cache();
}

void record_stream(const Tensor& t, const Stream& s) {
  LS_CHECK(t.defined() && t.device().is_cuda(), "record_stream: expected a cuda tensor, got ",
           t.defined() ? t.device().str() : std::string("an undefined tensor"));
  LS_CHECK(t.device().index == s.device(), "record_stream: the tensor is on ",
           t.device().str(), " but the stream on cuda:", s.device());
  if (emulated()) return;  // everything is synchronous there
  cache_of(t.device().index).record_stream(t.storage()->data(), raw(s));
}

}  // namespace lockstep::cuda
