// The CUDA runtime as lockstep uses it: errors, the current device and stream per thread,
// streams, events, TF32.
#include "tensor/cuda/runtime.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "lockstep/base/env_var.h"
#include "lockstep/base/log.h"
#include "lockstep/base/worker_env.h"
#include "tensor/cuda_emulated.h"

namespace lockstep {

bool cuda_available() { return cuda::is_available(); }
int cuda_device_count() { return cuda::device_count(); }

namespace cuda {

namespace {
constexpr int kMaxDevices = 64;

// Probed once: cudaGetDeviceCount fails without a driver or a GPU, which means no devices.
int probe_device_count() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear it, so it is not reported by the next unrelated call
    log_debug("cuda: no device (", cudaGetErrorString(err), ")");
    return 0;
  }
  return n < kMaxDevices ? n : kMaxDevices;
}

thread_local int t_device = 0;
// The calling thread's current stream per device; a default Stream is the default stream.
thread_local std::array<Stream, kMaxDevices> t_streams{};

void check_index(int index, const char* what) {
  if (emulated()) return emulation::check_index(index, what);
  const int n = device_count();
  LS_CHECK(n > 0, what, "(", index, "): no CUDA device is visible (",
           compiled_with_cuda() ? "no GPU or no driver" : "this build has no CUDA support", ")");
  LS_CHECK(index >= 0 && index < n, what, "(", index, "): expected a device index in [0, ", n,
           "), as ", n, " GPU", n == 1 ? " is" : "s are", " visible");
}

int resolve(int device) { return device < 0 ? t_device : device; }

// LOCKSTEP_ALLOW_TF32 is read at the first allow_tf32(), not at static initialization, where a
// bad value could only reach std::terminate; a set_allow_tf32() that came first wins.
constexpr int kTf32Unset = -1;
std::atomic<int> g_allow_tf32{kTf32Unset};
}  // namespace

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  // Sticky errors (a kernel that faulted) poison the context; say so rather than let later
  // calls fail with the same words and no cause.
  throw Error(std::string(call) + " failed: " + cudaGetErrorName(err) + ": " +
                  cudaGetErrorString(err),
              file, line);
}

void check_launch(const char* op, const Tensor& t) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) [[likely]] return;
  LS_THROW(op, ": CUDA kernel launch failed for shape ", t.shape().str(), " of ",
           dtype_name(t.dtype()), " on ", t.device().str(), ": ", cudaGetErrorName(err), ": ",
           cudaGetErrorString(err));
}

void check_launch(const char* op) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) [[likely]] return;
  LS_THROW(op, ": CUDA kernel launch failed: ", cudaGetErrorName(err), ": ",
           cudaGetErrorString(err));
}

bool compiled_with_cuda() { return true; }

// Emulated devices (Note [Emulated CUDA devices]) replace the real ones: no CUDA call is made.
int device_count() {
  static const int n = emulated() ? emulation::device_count() : probe_device_count();
  return n;
}

bool is_available() { return device_count() > 0; }

void set_device(int index) {
  check_index(index, "set_device");
  if (!emulated()) LS_CUDA_CHECK(cudaSetDevice(index));
  t_device = index;
}

int current_device() { return t_device; }

void synchronize(int device) {
  DeviceGuard g(resolve(device));
  if (!emulated()) LS_CUDA_CHECK(cudaDeviceSynchronize());
}

struct Stream::Owned {
  cudaStream_t stream = nullptr;
  int device = 0;
  ~Owned() {
    if (stream == nullptr) return;
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    cudaStreamDestroy(stream);
    cudaSetDevice(prev);
  }
};

Stream Stream::create(int device, bool high_priority) {
  device = resolve(device);
  DeviceGuard g(device);
  if (emulated()) return default_stream(device);  // every emulated stream is the default one
  int least = 0, greatest = 0;
  LS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  Stream s;
  s.owned_ = std::make_shared<Owned>();
  s.owned_->device = device;
  LS_CUDA_CHECK(cudaStreamCreateWithPriority(&s.owned_->stream, cudaStreamNonBlocking,
                                             high_priority ? greatest : least));
  s.device_ = device;
  return s;
}

Stream Stream::default_stream(int device) {
  Stream s;
  s.device_ = resolve(device);
  return s;
}

void* Stream::handle() const { return owned_ ? owned_->stream : nullptr; }

void Stream::synchronize() const {
  if (emulated()) return;
  DeviceGuard g(device_);
  LS_CUDA_CHECK(cudaStreamSynchronize(raw(*this)));
}

bool Stream::query() const {
  if (emulated()) return true;
  DeviceGuard g(device_);
  cudaError_t err = cudaStreamQuery(raw(*this));
  if (err == cudaErrorNotReady) return false;
  LS_CUDA_CHECK(err);
  return true;
}

Stream current_stream(int device) {
  device = resolve(device);
  LS_CHECK(device >= 0 && device < kMaxDevices, "current_stream: device ", device,
           " out of range");
  Stream s = t_streams[static_cast<size_t>(device)];
  if (s.is_default()) return Stream::default_stream(device);
  return s;
}

cudaStream_t current_cuda_stream() { return raw(t_streams[static_cast<size_t>(t_device)]); }

StreamGuard::StreamGuard(const Stream& s) : prev_(current_stream(s.device())) {
  t_streams[static_cast<size_t>(s.device())] = s;
}

StreamGuard::~StreamGuard() { t_streams[static_cast<size_t>(prev_.device())] = prev_; }

DeviceGuard::DeviceGuard(int index) : prev_(t_device) {
  if (index == t_device) return;
  check_index(index, "DeviceGuard");
  if (!emulated()) LS_CUDA_CHECK(cudaSetDevice(index));
  t_device = index;
}

DeviceGuard::~DeviceGuard() {
  if (prev_ == t_device) return;
  if (!emulated()) cudaSetDevice(prev_);
  t_device = prev_;
}

TensorDeviceGuard::TensorDeviceGuard(const Tensor& t) {
  const int d = t.device().index;
  if (!t.device().is_cuda() || d == t_device) return;
  if (!emulated()) LS_CUDA_CHECK(cudaSetDevice(d));
  prev_ = t_device;
  t_device = d;
}

TensorDeviceGuard::~TensorDeviceGuard() {
  if (prev_ < 0) return;
  if (!emulated()) cudaSetDevice(prev_);
  t_device = prev_;
}

Event::Event(bool timing) : timing_(timing) {}

Event::~Event() {
  if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

Event::Event(Event&& o) noexcept
    : event_(o.event_), device_(o.device_), timing_(o.timing_), host_ns_(o.host_ns_) {
  o.event_ = nullptr;
}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    event_ = o.event_;
    device_ = o.device_;
    timing_ = o.timing_;
    host_ns_ = o.host_ns_;
    o.event_ = nullptr;
  }
  return *this;
}

void Event::record(const Stream& s) {
  if (emulated()) {  // the work before it is done: a timestamp is the event
    emulation::check_index(s.device(), "Event::record");
    device_ = s.device();
    host_ns_ = emulation::now_ns();
    return;
  }
  DeviceGuard g(s.device());
  if (event_ == nullptr) {
    cudaEvent_t e = nullptr;
    LS_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing_ ? cudaEventDefault
                                                        : cudaEventDisableTiming));
    event_ = e;
    device_ = s.device();
  }
  LS_CHECK(device_ == s.device(), "Event::record: the event belongs to cuda:", device_,
           " but the stream to cuda:", s.device());
  LS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), raw(s)));
}

void Event::wait(const Stream& s) const {
  if (event_ == nullptr) return;
  DeviceGuard g(s.device());
  LS_CUDA_CHECK(cudaStreamWaitEvent(raw(s), static_cast<cudaEvent_t>(event_), 0));
}

void Event::synchronize() const {
  if (event_ == nullptr) return;
  LS_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
}

bool Event::query() const {
  if (event_ == nullptr) return true;
  cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (err == cudaErrorNotReady) return false;
  LS_CUDA_CHECK(err);
  return true;
}

float Event::elapsed_ms(const Event& start) const {
  LS_CHECK(timing_ && start.timing_, "Event::elapsed_ms: both events need timing=true");
  if (emulated()) {
    LS_CHECK(device_ >= 0 && start.device_ >= 0,
             "Event::elapsed_ms: both events must have been recorded");
    return static_cast<float>(static_cast<double>(host_ns_ - start.host_ns_) / 1e6);
  }
  LS_CHECK(event_ != nullptr && start.event_ != nullptr,
           "Event::elapsed_ms: both events must have been recorded");
  float ms = 0;
  LS_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_),
                                     static_cast<cudaEvent_t>(event_)));
  return ms;
}

void set_allow_tf32(bool allow) { g_allow_tf32.store(allow ? 1 : 0, std::memory_order_relaxed); }

bool allow_tf32() {
  const int v = g_allow_tf32.load(std::memory_order_relaxed);
  if (v != kTf32Unset) return v == 1;
  const bool from_env = env_flag(env::kAllowTf32).value_or(false);
  int expected = kTf32Unset;
  g_allow_tf32.compare_exchange_strong(expected, from_env ? 1 : 0);
  return g_allow_tf32.load(std::memory_order_relaxed) == 1;
}

}  // namespace cuda
}  // namespace lockstep
