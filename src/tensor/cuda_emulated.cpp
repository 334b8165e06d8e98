// Emulated CUDA devices: host memory behind the device seam, for tests of the multi-GPU path on
// machines without GPUs.
#include "tensor/cuda_emulated.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "lockstep/base/env_var.h"
#include "lockstep/base/error.h"
#include "lockstep/base/log.h"
#include "lockstep/base/worker_env.h"

namespace lockstep::cuda {

// Note [Emulated CUDA devices]
// One GPU per process with NCCL between them is lockstep's production setting, and neither our
// development machines nor CI have several GPUs (one GPU cannot host two NCCL ranks either). So
// a test switch, LOCKSTEP_TEST_EMULATE_GPUS=N, makes a process see N emulated CUDA devices:
//
// - Tensors on cuda:i are allocated from host memory, labelled cuda:i (allocator(i)), with the
//   device allocator's statistics; `to(kCPU)`, `item()`, `at()` treat them as device tensors
//   (a copy through the device's copy kernel; `at()` refuses them), exactly as on a GPU.
// - The runtime (device_count, set_device, streams, events, guards) answers for them without a
//   single CUDA call; every stream is the device's default stream and work is done when the
//   call returns, so events are timestamps.
// - Their kernel table is the CPU's, less every entry the CUDA table lacks (Note [Emulated
//   kernels] in src/ops/kernels.cpp), so an op that has no CUDA kernel fails here as on a GPU.
// - The "nccl" backend is an emulated one that keeps NCCL's contract (tensors on the rank's own
//   device only, NCCL's dtypes, no host staging) over the CPU transport (Note [Emulated NCCL] in
//   src/distributed/emulated_nccl/emulated_nccl.cpp).
//
// What it catches: host tensors handed to the NCCL group, ops mixing host and device tensors,
// element access to device tensors, a missing device kernel, device memory in reports. What it
// cannot: host code that dereferences a device tensor's data_ptr() (host memory here), stream
// races (everything is synchronous), device memory limits, NCCL's own bugs (docs/GPU.md).
// Nothing changes unless the variable is set: then the real CUDA runtime is never asked.

namespace {

constexpr int kMaxEmulated = 64;

int read_count() {
  const auto count =
      env_int(env::kTestEmulateGpus, 1, kMaxEmulated,
              {.unit = "emulated GPUs", .note = "a test switch; unset it to use real GPUs"});
  if (!count) return 0;
  const int64_t n = *count;
  log_warning("EMULATED GPUs: ", env::kTestEmulateGpus, "=", n, " makes cuda:0..cuda:", n - 1,
              " host memory run by CPU kernels, with an emulated nccl backend; a test switch, "
              "nothing runs on a GPU");
  return static_cast<int>(n);
}

// The host allocator of one emulated device: the CPU's caching allocator, with the device
// allocator's accounting (a block is "reserved" while allocated: nothing is cached per device).
class EmulatedAllocator final : public Allocator {
 public:
  explicit EmulatedAllocator(int device) : device_(device) {}

  void* allocate(size_t nbytes) override {
    void* p = cpu_allocator().allocate(nbytes);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.allocations;
    stats_.allocated_bytes += static_cast<int64_t>(nbytes);
    stats_.reserved_bytes = stats_.allocated_bytes;
    stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
    stats_.peak_reserved_bytes = stats_.peak_allocated_bytes;
    return p;
  }

  void deallocate(void* ptr, size_t nbytes) override {
    if (ptr == nullptr) return;
    cpu_allocator().deallocate(ptr, nbytes);
    std::lock_guard<std::mutex> lock(mu_);
    stats_.allocated_bytes -= static_cast<int64_t>(nbytes);
    stats_.reserved_bytes = stats_.allocated_bytes;
  }

  Device device() const override { return cuda_device(device_); }

  MemoryStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak_allocated_bytes = stats_.allocated_bytes;
    stats_.peak_reserved_bytes = stats_.reserved_bytes;
  }

 private:
  const int device_;
  std::mutex mu_;
  MemoryStats stats_;
};

EmulatedAllocator& allocator_of(int device) {
  // Leaked on purpose, as the CPU allocator: tensors in static storage may outlive main.
  static auto* all = [] {
    auto* v = new std::vector<EmulatedAllocator*>();
    for (int d = 0; d < emulation::device_count(); ++d) v->push_back(new EmulatedAllocator(d));
    return v;
  }();
  return *(*all)[static_cast<size_t>(device)];
}

}  // namespace

bool emulated() { return emulation::device_count() > 0; }

namespace emulation {

int device_count() {
  static const int n = read_count();
  return n;
}

void check_index(int index, const char* what) {
  const int n = device_count();
  LS_CHECK(index >= 0 && index < n, what, "(", index, "): expected a device index in [0, ", n,
           "), as ", n, " emulated GPU", n == 1 ? " is" : "s are", " visible (",
           env::kTestEmulateGpus, ")");
}

Allocator& allocator(int device) {
  check_index(device, "allocate on cuda");
  return allocator_of(device);
}

MemoryStats memory_stats(int device) {
  check_index(device, "memory_stats");
  return allocator_of(device).stats();
}

void reset_peak_stats(int device) {
  check_index(device, "reset_peak_stats");
  allocator_of(device).reset_peak();
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace emulation
}  // namespace lockstep::cuda

namespace lockstep::detail {

Tensor emulated_as_host(const Tensor& t) {
  LS_CHECK(t.defined() && t.device().is_cuda() && cuda::emulated(),
           "emulated_as_host: expected a tensor on an emulated GPU, got ",
           t.defined() ? t.device().str() : std::string("an undefined tensor"));
  const Storage& s = t.storage();
  auto host = std::make_shared<StorageImpl>(s->data(), s->nbytes(), kCPU, s);
  return Tensor(std::make_shared<TensorImpl>(std::move(host), t.shape(), t.strides(), t.offset(),
                                             t.dtype()));
}

}  // namespace lockstep::detail
