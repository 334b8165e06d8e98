// The CUDA device as a user sees it: the current device per thread, streams and events as small
// RAII handles, the caching device allocator's statistics, TF32. Compiles in every build; in a
// build without CUDA, is_available() is false and everything that needs a device throws an Error
// that says this build has no CUDA support. Handles are opaque (no CUDA header here); code inside
// lockstep reaches the cudaStream_t through src/tensor/cuda/runtime.h.
#pragma once

#include <cstdint>
#include <memory>

#include "lockstep/tensor/device.h"

namespace lockstep {
class Tensor;
}

namespace lockstep::cuda {

// True when this build has CUDA support (whether or not a GPU is present).
bool compiled_with_cuda();
// True when LOCKSTEP_TEST_EMULATE_GPUS made this process's cuda devices emulated ones (host
// memory, CPU kernels; a test switch: Note [Emulated CUDA devices]). Then is_available() and
// device_count() answer for the emulated devices, in any build, and no CUDA call is made.
bool emulated();
// True when built with CUDA and at least one GPU is visible.
bool is_available();
// Visible GPUs (0 without CUDA support, without a driver or without a GPU).
int device_count();

// The calling thread's current device (initially 0), where new cuda tensors without an index
// and kernels go. Throws when the index is not a visible GPU.
void set_device(int index);
int current_device();
// Waits for everything queued on every stream of the device (-1: the current one).
void synchronize(int device = -1);

// A CUDA stream: a queue of kernels and copies that run in order on one device. A default
// constructed Stream is the device's default (legacy) stream. Copies share one stream.
class Stream {
 public:
  Stream() = default;
  // A new non-blocking stream on `device` (-1: the current one); destroyed with its last handle.
  static Stream create(int device = -1, bool high_priority = false);
  // The default stream of `device` (-1: the current one).
  static Stream default_stream(int device = -1);

  int device() const { return device_; }
  void* handle() const;  // cudaStream_t
  bool is_default() const { return owned_ == nullptr; }
  void synchronize() const;
  bool query() const;  // true when everything queued has finished
  friend bool operator==(const Stream& a, const Stream& b) {
    return a.device_ == b.device_ && a.handle() == b.handle();
  }

 private:
  struct Owned;
  std::shared_ptr<Owned> owned_;
  int device_ = 0;
};

// The stream kernels of the calling thread go to on `device` (-1: the current one).
Stream current_stream(int device = -1);
// Makes `s` the current stream of its device for this thread (and restores the previous one).
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& s);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream prev_;
};

// Sets the current device for a scope (and restores the previous one).
class DeviceGuard {
 public:
  explicit DeviceGuard(int index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

// A CUDA event: a point in a stream that others can wait for without blocking the host.
class Event {
 public:
  explicit Event(bool timing = false);
  ~Event();
  Event(Event&&) noexcept;
  Event& operator=(Event&&) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(const Stream& s);
  void record() { record(current_stream()); }
  // Makes `s` wait (on the device) for the work recorded before this event.
  void wait(const Stream& s) const;
  void synchronize() const;  // blocks the host
  bool query() const;        // true when recorded work has finished (or nothing was recorded)
  // Milliseconds from `start` to this event, both recorded with timing on and finished.
  float elapsed_ms(const Event& start) const;
  void* handle() const { return event_; }

 private:
  void* event_ = nullptr;  // cudaEvent_t
  int device_ = -1;        // where it was created (-1: not yet)
  bool timing_ = false;
  int64_t host_ns_ = 0;  // when recorded, on an emulated device (Note [Emulated CUDA devices])
};

// The caching device allocator (Note [CUDA caching allocator]).
struct MemoryStats {
  int64_t allocated_bytes = 0;       // in tensors now
  int64_t reserved_bytes = 0;        // obtained from cudaMalloc and not freed (in use + cached)
  int64_t peak_allocated_bytes = 0;  // most allocated_bytes since start or reset_peak_stats()
  int64_t peak_reserved_bytes = 0;
  int64_t allocations = 0;   // allocate() calls, ever
  int64_t cuda_mallocs = 0;  // cudaMalloc calls, ever (a steady training step adds none)
  int64_t cuda_frees = 0;    // cudaFree calls, ever
  int64_t oom_retries = 0;   // cudaMalloc failures retried after freeing the cache
};
MemoryStats memory_stats(int device = -1);
void reset_peak_stats(int device = -1);
// Returns every cached (unused) block of every device to CUDA.
void empty_cache();
// Tells the allocator that `t`'s memory is in use on `s` too, so it is not handed out again
// until the work queued on `s` so far has finished.
void record_stream(const Tensor& t, const Stream& s);

// Whether f32 matrix products may use TF32 tensor cores (default off, as PyTorch; also
// LOCKSTEP_ALLOW_TF32=1, read at the first allow_tf32() unless set_allow_tf32 came first).
void set_allow_tf32(bool allow);
bool allow_tf32();

}  // namespace lockstep::cuda
