// The caching CUDA device allocator and the pinned host pool.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lockstep/base/log.h"
#include "tensor/cuda/runtime.h"
#include "tensor/cuda_emulated.h"

namespace lockstep::cuda {

namespace {

constexpr int kMaxDevices = 64;

// Note [CUDA caching allocator]
// cudaMalloc and cudaFree synchronize the device and cost tens of microseconds to milliseconds;
// a training step allocates hundreds of tensors. So freed blocks stay cached per device and are
// handed out again, and a step in steady state calls cudaMalloc never (memory_stats().
// cuda_mallocs stops growing after the first step; tests/cuda checks it).
// - Sizes are rounded to 512 bytes below 1 MiB and to 2 MiB above, so the same shapes step after
//   step land on the same blocks. A request takes the smallest cached block that fits and is
//   at most twice its size (small) or 1/8 larger (large), so a small tensor never pins a big
//   block.
// - Stream-aware: a block belongs to the stream that was current when it was allocated, and only
//   requests on that stream reuse it. Kernels on one stream run in order, so a block freed by the
//   host can be reused at once on its own stream even while earlier kernels still read it. A
//   block also used on other streams (record_stream: NCCL's communication stream reading a
//   gradient bucket) waits for an event on each of them before it returns to the cache.
// - When cudaMalloc runs out, every cached block is freed and the call retried once; then the
//   error says how much was asked, allocated and cached.
constexpr size_t kSmallLimit = size_t{1} << 20;
constexpr size_t kSmallRound = 512;
constexpr size_t kLargeRound = size_t{2} << 20;

size_t round_size(size_t n) {
  if (n == 0) n = 1;
  if (n <= kSmallLimit) return (n + kSmallRound - 1) / kSmallRound * kSmallRound;
  return (n + kLargeRound - 1) / kLargeRound * kLargeRound;
}

size_t max_fit(size_t size) { return size <= kSmallLimit ? 2 * size : size + size / 8; }

struct Block {
  void* ptr = nullptr;
  size_t size = 0;
  cudaStream_t stream = nullptr;
  std::vector<cudaStream_t> uses;  // other streams the block was used on (record_stream)
};

struct FreeKey {
  cudaStream_t stream;
  size_t size;
  void* ptr;
  friend bool operator<(const FreeKey& a, const FreeKey& b) {
    if (a.stream != b.stream) return std::less<cudaStream_t>()(a.stream, b.stream);
    if (a.size != b.size) return a.size < b.size;
    return std::less<void*>()(a.ptr, b.ptr);
  }
};

class DeviceCache final : public Allocator {
 public:
  explicit DeviceCache(int device) : device_(device) {}

  void* allocate(size_t nbytes) override {
    const size_t size = round_size(nbytes);
    cudaStream_t stream = raw(current_stream(device_));
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.allocations;
    collect_pending();
    auto it = free_.lower_bound(FreeKey{stream, size, nullptr});
    if (it != free_.end() && it->stream == stream && it->size <= max_fit(size)) {
      Block* b = blocks_.at(it->ptr).get();
      free_.erase(it);
      cached_bytes_ -= b->size;
      add_allocated(b->size);
      return b->ptr;
    }
    void* p = malloc_with_retry(size, nbytes);
    auto b = std::make_unique<Block>();
    b->ptr = p;
    b->size = size;
    b->stream = stream;
    blocks_.emplace(p, std::move(b));
    stats_.reserved_bytes += static_cast<int64_t>(size);
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
    add_allocated(size);
    return p;
  }

  void deallocate(void* ptr, size_t) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(ptr);
    if (it == blocks_.end()) return;  // not ours (cannot happen); never free a stranger
    Block* b = it->second.get();
    stats_.allocated_bytes -= static_cast<int64_t>(b->size);
    if (b->uses.empty()) {
      cache(b);
      return;
    }
    // Wait for every other stream that used the block (Note [CUDA caching allocator]).
    Pending p{b, {}};
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    for (cudaStream_t s : b->uses) {
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
    b->uses.clear();
    pending_.push_back(std::move(p));
  }

  Device device() const override { return Device(DeviceType::cuda, device_); }

  void record_stream(void* ptr, cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(ptr);
    LS_CHECK(it != blocks_.end(), "record_stream: the tensor's memory is not from the caching "
                                  "allocator of cuda:", device_);
    Block* b = it->second.get();
    if (s == b->stream) return;
    if (std::find(b->uses.begin(), b->uses.end(), s) == b->uses.end()) b->uses.push_back(s);
  }

  MemoryStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak_allocated_bytes = stats_.allocated_bytes;
    stats_.peak_reserved_bytes = stats_.reserved_bytes;
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mu_);
    collect_pending();
    release_cached();
  }

 private:
  struct Pending {
    Block* block;
    std::vector<cudaEvent_t> events;
  };

  void add_allocated(size_t size) {
    stats_.allocated_bytes += static_cast<int64_t>(size);
    stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  }

  void cache(Block* b) {
    free_.insert(FreeKey{b->stream, b->size, b->ptr});
    cached_bytes_ += b->size;
  }

  // Moves blocks whose other-stream uses have finished back into the cache.
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
      cache(it->block);
      it = pending_.erase(it);
    }
  }

  // cudaFree of every cached block (caller holds mu_).
  void release_cached() {
    if (free_.empty()) return;
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    for (const FreeKey& k : free_) {
      cudaFree(k.ptr);
      ++stats_.cuda_frees;
      stats_.reserved_bytes -= static_cast<int64_t>(k.size);
      blocks_.erase(k.ptr);
    }
    free_.clear();
    cached_bytes_ = 0;
    cudaSetDevice(prev);
  }

  void* malloc_with_retry(size_t size, size_t asked) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      ++stats_.oom_retries;
      // Wait for blocks still fenced by other streams, then give everything cached back.
      for (auto& pend : pending_)
        for (cudaEvent_t e : pend.events) cudaEventSynchronize(e);
      collect_pending();
      release_cached();
      err = cudaMalloc(&p, size);
    }
    cudaSetDevice(prev);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      LS_THROW("out of memory on cuda:", device_, ": could not allocate ", asked, " bytes (",
               cudaGetErrorString(err), "); lockstep holds ", stats_.allocated_bytes,
               " bytes in tensors and ", stats_.reserved_bytes, " reserved; the device has ",
               free_b, " of ", total_b, " bytes free");
    }
    ++stats_.cuda_mallocs;
    return p;
  }

  const int device_;
  std::mutex mu_;
  std::unordered_map<void*, std::unique_ptr<Block>> blocks_;  // every block we cudaMalloc'ed
  std::set<FreeKey> free_;
  std::deque<Pending> pending_;
  size_t cached_bytes_ = 0;
  MemoryStats stats_;
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
