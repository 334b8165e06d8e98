// lockstep::cuda in a build without CUDA: nothing is available, and whatever needs a device
// says that this build has no CUDA support.
#include "lockstep/tensor/cuda.h"

#ifndef LOCKSTEP_WITH_CUDA

#include "lockstep/base/error.h"

namespace lockstep::cuda {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  LS_THROW(what, ": this build of lockstep has no CUDA support (configure it where the CUDA ",
           "toolkit is installed, with -DLOCKSTEP_CUDA=AUTO or ON)");
}
}  // namespace

bool compiled_with_cuda() { return false; }
bool is_available() { return false; }
int device_count() { return 0; }
void set_device(int) { no_cuda("set_device"); }
int current_device() { return 0; }
void synchronize(int) { no_cuda("synchronize"); }

struct Stream::Owned {};
Stream Stream::create(int, bool) { no_cuda("Stream::create"); }
Stream Stream::default_stream(int) { no_cuda("Stream::default_stream"); }
void* Stream::handle() const { return nullptr; }
void Stream::synchronize() const { no_cuda("Stream::synchronize"); }
bool Stream::query() const { no_cuda("Stream::query"); }
Stream current_stream(int) { no_cuda("current_stream"); }
StreamGuard::StreamGuard(const Stream&) { no_cuda("StreamGuard"); }
StreamGuard::~StreamGuard() = default;
DeviceGuard::DeviceGuard(int) { no_cuda("DeviceGuard"); }
DeviceGuard::~DeviceGuard() = default;

Event::Event(bool) {}
Event::~Event() = default;
Event::Event(Event&&) noexcept = default;
Event& Event::operator=(Event&&) noexcept = default;
void Event::record(const Stream&) { no_cuda("Event::record"); }
void Event::wait(const Stream&) const { no_cuda("Event::wait"); }
void Event::synchronize() const { no_cuda("Event::synchronize"); }
bool Event::query() const { return true; }
float Event::elapsed_ms(const Event&) const { no_cuda("Event::elapsed_ms"); }

MemoryStats memory_stats(int) { return {}; }
void reset_peak_stats(int) {}
void empty_cache() {}
void record_stream(const Tensor&, const Stream&) { no_cuda("record_stream"); }

void set_allow_tf32(bool) {}
bool allow_tf32() { return false; }

}  // namespace lockstep::cuda

#endif  // LOCKSTEP_WITH_CUDA
