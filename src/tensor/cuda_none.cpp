// lockstep::cuda in a build without CUDA: nothing is available, and whatever needs a device
// says that this build has no CUDA support; unless LOCKSTEP_TEST_EMULATE_GPUS makes the devices
// emulated ones (Note [Emulated CUDA devices] in cuda_emulated.cpp), which need no CUDA at all.
#include "lockstep/tensor/cuda.h"

#ifndef LOCKSTEP_WITH_CUDA

#include "lockstep/base/error.h"
#include "tensor/cuda_emulated.h"

namespace lockstep {

bool cuda_available() { return cuda::is_available(); }
int cuda_device_count() { return cuda::device_count(); }

namespace cuda {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  LS_THROW(what, ": this build of lockstep has no CUDA support (configure it where the CUDA ",
           "toolkit is installed, with -DLOCKSTEP_CUDA=AUTO or ON)");
}

// The calling thread's current emulated device.
thread_local int t_device = 0;

// The emulated device `device` (-1: the current one), checked; without emulation, no_cuda.
int emulated_device(int device, const char* what) {
  if (!emulated()) no_cuda(what);
  if (device < 0) return t_device;
  emulation::check_index(device, what);
  return device;
}
}  // namespace

bool compiled_with_cuda() { return false; }
bool is_available() { return emulated(); }
int device_count() { return emulation::device_count(); }
void set_device(int index) { t_device = emulated_device(index, "set_device"); }
int current_device() { return t_device; }
void synchronize(int device) { emulated_device(device, "synchronize"); }

// Every emulated stream is its device's default stream, and its work is done on return.
struct Stream::Owned {};
Stream Stream::create(int device, bool) {
  return default_stream(emulated_device(device, "Stream::create"));
}
Stream Stream::default_stream(int device) {
  Stream s;
  s.device_ = emulated_device(device, "Stream::default_stream");
  return s;
}
void* Stream::handle() const { return nullptr; }
void Stream::synchronize() const { emulated_device(device_, "Stream::synchronize"); }
bool Stream::query() const { return emulated_device(device_, "Stream::query") >= 0; }
Stream current_stream(int device) { return Stream::default_stream(device); }
StreamGuard::StreamGuard(const Stream& s) { emulated_device(s.device(), "StreamGuard"); }
StreamGuard::~StreamGuard() = default;
DeviceGuard::DeviceGuard(int index) : prev_(t_device) {
  t_device = emulated_device(index, "DeviceGuard");
}
DeviceGuard::~DeviceGuard() { t_device = prev_; }

Event::Event(bool timing) : timing_(timing) {}
Event::~Event() = default;
Event::Event(Event&&) noexcept = default;
Event& Event::operator=(Event&&) noexcept = default;
void Event::record(const Stream& s) {
  device_ = emulated_device(s.device(), "Event::record");
  host_ns_ = emulation::now_ns();
}
void Event::wait(const Stream& s) const { emulated_device(s.device(), "Event::wait"); }
void Event::synchronize() const {}
bool Event::query() const { return true; }
float Event::elapsed_ms(const Event& start) const {
  if (!emulated()) no_cuda("Event::elapsed_ms");
  LS_CHECK(timing_ && start.timing_, "Event::elapsed_ms: both events need timing=true");
  LS_CHECK(device_ >= 0 && start.device_ >= 0,
           "Event::elapsed_ms: both events must have been recorded");
  return static_cast<float>(static_cast<double>(host_ns_ - start.host_ns_) / 1e6);
}

MemoryStats memory_stats(int device) {
  if (!emulated()) return {};
  return emulation::memory_stats(device < 0 ? t_device : device);
}
void reset_peak_stats(int device) {
  if (emulated()) emulation::reset_peak_stats(device < 0 ? t_device : device);
}
void empty_cache() {}
void record_stream(const Tensor&, const Stream& s) { emulated_device(s.device(), "record_stream"); }

void set_allow_tf32(bool) {}
bool allow_tf32() { return false; }

}  // namespace cuda
}  // namespace lockstep

#endif  // LOCKSTEP_WITH_CUDA
