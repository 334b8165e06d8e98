// ProcessGroupNCCL: one NCCL communicator and one communication stream per group, stream-ordered
// works, and the watchdog that aborts a stuck collective.
#include "lockstep/distributed/nccl/process_group_nccl.h"

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "distributed/call_signature.h"
#include "distributed/nccl/nccl_check.h"
#include "distributed/nccl/register.h"
#include "lockstep/base/env_var.h"
#include "lockstep/base/log.h"
#include "lockstep/base/worker_env.h"
#include "tensor/cuda/runtime.h"

namespace lockstep::dist {

namespace detail {

void throw_nccl_error(ncclResult_t result, const char* call, const char* file, int line) {
  std::string msg = lockstep::detail::str_cat(call, " failed: ", ncclGetErrorString(result));
  // NCCL keeps a more specific line (which peer, which syscall) for some errors.
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && *last != '\0') msg += lockstep::detail::str_cat(" (", last, ")");
  throw Error(msg, file, line);
}

}  // namespace detail

namespace {

using Clock = std::chrono::steady_clock;

// How often the watchdog looks at the works in flight. Their completion becomes visible to
// is_completed() and synchronize() this late at most.
constexpr std::chrono::milliseconds kWatchdogPoll{1};
// How long an abort waits for a thread that is inside an NCCL call on the communicator (a
// collective whose host side blocks, e.g. connecting to a peer that never comes) before it
// aborts anyway: aborting is then the only way to get that thread out.
constexpr std::chrono::milliseconds kAbortLockWait{1000};
// Where rank 0 publishes the unique id, in the group's store namespace.
constexpr const char* kUniqueIdKey = "nccl/unique_id";
constexpr const char* kUniqueIdError = "error: ";

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
    case DType::b8:
      break;
  }
  LS_THROW("nccl: no NCCL reduction for ", dtype_name(t), " tensors");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::min:
      return ncclMin;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::product:
      return ncclProd;
  }
  LS_THROW("nccl: unknown reduce op");
}

std::string seconds(std::chrono::milliseconds t) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g s", static_cast<double>(t.count()) / 1000.0);
  return buf;
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    return err.message();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown exception";
  }
}

// Note [NCCL signature check]
// NCCL's collectives carry no header: ranks that disagree on a collective's kind, dtype, size or
// root hang until the timeout or read out of bounds. So, as Gloo and shm do (Note [Gloo
// signature check]), every collective first all-gathers each rank's 24-byte CallSignature, and
// a mismatch fails the collective on every rank, naming both sides, before any of its data
// moves (the group stays usable). The exchange runs on a communicator split from the group's
// (`check_comm_`) and on a stream of its own that waits for nothing the caller queued, so the
// host waits only for the 24-byte exchange itself (one small NCCL launch, tens of microseconds),
// never for the compute stream: DDP's overlap of communication with backward is kept. The wait
// is bounded by the collective's timeout; a rank that never issues the collective makes it fail
// there, as the collective itself would. LOCKSTEP_NCCL_CHECK=0 turns the check off (benchmarks
// of the bare collective).
constexpr size_t kSignatureBytes = sizeof(detail::CallSignature);

bool nccl_check_enabled() {
  return env_flag(env::kNcclCheck, {.note = "0 turns the signature check off"}).value_or(true);
}

// Note [Stream-ordered works]
// A collective of this group is three things queued on the group's stream: a wait for an event
// recorded on the caller's current stream (the tensors' producers), the NCCL call, and the
// public call's then() steps (unpacking a fused buffer, a copy back to a strided view), run at
// once with the group's stream current so that their copies queue after the collective; then
// the work's end event. wait() makes the caller's current stream wait for that event, as
// PyTorch's WorkNCCL::wait does: the host goes on queueing kernels, which run once the
// collective is done. The watchdog completes the Work (is_completed(), synchronize()) when it
// sees the end event, and until then holds the tensors and steps, so that no memory the
// collective uses is freed; the tensors are also record_stream'ed on the group's stream, so the
// caching allocator never hands their blocks out while the stream may still use them.
class WorkNCCL : public Work {
 public:
  WorkNCCL(std::string description, int64_t seq) : Work(std::move(description), seq) {}

  void wait() override {
    if (host_blocking_ || is_completed()) {
      Work::wait();  // a barrier, or already finished: rethrows a failure
      return;
    }
    end_.wait(cuda::current_stream(device_));
  }

  // Set by the group when it queues the collective, before the Work is returned.
  int device_ = 0;
  bool host_blocking_ = false;
  cuda::Event end_;
  Clock::time_point deadline_;
  std::chrono::milliseconds timeout_{0};
  std::vector<Tensor> keep_;                  // alive until the end event was reached
  std::vector<std::function<void()>> steps_;  // likewise what their closures hold
};

}  // namespace

class ProcessGroupNCCL::Impl {
 public:
  Impl(const BackendConfig& config, std::string who)
      : who_(std::move(who)), device_(cuda::current_device()) {
    LS_CHECK(cuda::is_available(), who_, ": the NCCL backend needs a CUDA GPU, and ",
             cuda::compiled_with_cuda() ? "none is visible (no GPU or no driver)"
                                        : "this build has no CUDA support");
    cuda::DeviceGuard on(device_);
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    if (config.rank == 0) {
      try {
        LS_NCCL_CHECK(ncclGetUniqueId(&id));
      } catch (const Error& e) {
        // The others wait for the id: tell them why it will not come.
        config.store->set(kUniqueIdKey, std::string(kUniqueIdError) + e.message());
        throw;
      }
      config.store->set(kUniqueIdKey, Bytes(id.internal, id.internal + sizeof(id.internal)));
    } else {
      Bytes b;
      try {
        b = config.store->get(kUniqueIdKey);
      } catch (const Error& e) {
        LS_THROW(who_,
                 ": NCCL's unique id from rank 0 did not arrive through the store: ", e.message());
      }
      if (b.size() != sizeof(id.internal)) {
        LS_THROW(who_, ": rank 0 could not create NCCL's unique id: ", to_string(b));
      }
      std::memcpy(id.internal, b.data(), b.size());
    }
    try {
      LS_NCCL_CHECK(ncclCommInitRank(&comm_, config.size, id, config.rank));
    } catch (const Error& e) {
      LS_THROW(who_, ": creating the NCCL communicator on cuda:", device_, " failed: ", e.message(),
               " (two ranks on one GPU are not possible with NCCL)");
    }
    stream_ = cuda::Stream::create(device_, /*high_priority=*/true);
    if (config.size > 1 && nccl_check_enabled()) {
      // Note [NCCL signature check]: a communicator and a stream of its own.
      LS_NCCL_CHECK(ncclCommSplit(comm_, 0, config.rank, &check_comm_, nullptr));
      check_stream_ = cuda::Stream::create(device_, /*high_priority=*/true);
      const auto on_device = TensorOptions(kUInt8).with_device(cuda_device(device_));
      check_send_ = empty({static_cast<int64_t>(kSignatureBytes)}, on_device);
      check_recv_ = empty({static_cast<int64_t>(kSignatureBytes) * config.size}, on_device);
      check_host_send_ = empty_pinned({static_cast<int64_t>(kSignatureBytes)}, kUInt8);
      check_host_recv_ =
          empty_pinned({static_cast<int64_t>(kSignatureBytes) * config.size}, kUInt8);
      size_ = config.size;
    }
    watchdog_ = std::thread([this] { watch(); });
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    for (ncclComm_t c : {check_comm_, comm_}) {
      if (c == nullptr || aborted_) continue;
      cuda::DeviceGuard on(device_);
      const ncclResult_t r = ncclCommDestroy(c);
      if (r != ncclSuccess) {
        log_warning(who_, ": ncclCommDestroy failed: ", ncclGetErrorString(r));
      }
    }
  }

  int device() const { return device_; }
  const cuda::Stream& stream() const { return stream_; }

  // Queues `body` (the NCCL call on the communicator and the group's stream) as the collective of
  // `w` (Note [Stream-ordered works]); `tensors` are what it reads and writes.
  void launch(const WorkPtr& w, std::chrono::milliseconds timeout, std::vector<Tensor> tensors,
              const detail::CallSignature& sig,
              const std::function<void(ncclComm_t, cudaStream_t)>& body,
              bool host_blocking = false) {
    auto work = std::static_pointer_cast<WorkNCCL>(w);
    work->device_ = device_;
    work->host_blocking_ = host_blocking;
    work->timeout_ = timeout;
    // A poisoned group fails at once, without waiting for an abort in progress (comm_mu_).
    if (refuse_if_broken(*work)) return;
    std::exception_ptr error;
    {
      std::unique_lock<std::timed_mutex> comm(comm_mu_);
      if (refuse_if_broken(*work)) return;
      std::string mismatch;
      try {
        if (check_comm_ != nullptr) mismatch = check_signatures(sig, timeout);
      } catch (...) {
        error = std::current_exception();
      }
      if (!mismatch.empty()) {
        // Nothing was sent: this collective fails, the group goes on.
        work_finish(*work, make_error(lockstep::detail::str_cat(who_, ": ", work->description(),
                                                                " failed: ", mismatch)));
        return;
      }
      if (!error) try {
          cuda::DeviceGuard on(device_);
          // The group's stream waits for what the caller queued so far: the tensors' producers.
          cuda::Event ready;
          ready.record(cuda::current_stream(device_));
          ready.wait(stream_);
          body(comm_, cuda::raw(stream_));
          work_start(*work);  // queued on the stream: the trace's "started"
          std::vector<std::function<void()>> steps = work_take_steps(*work);
          {
            cuda::StreamGuard on_comm(stream_);
            for (auto& step : steps) step();
          }
          for (const Tensor& t : tensors) {
            if (t.numel() > 0 && t.storage()->owned()) cuda::record_stream(t, stream_);
          }
          work->end_.record(stream_);
          work->keep_ = std::move(tensors);
          work->steps_ = std::move(steps);
          work->deadline_ = Clock::now() + timeout;
        } catch (...) {
          error = std::current_exception();
        }
    }
    if (error) {
      // The communicator's state is unknown after a failed call: no collective may follow.
      fail_all(work, lockstep::detail::str_cat("could not be queued: ", what_of(error)));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Queued while the group was failing (fail_all waits for comm_mu_ before it aborts): the
      // watchdog fails it with the others once the abort is done.
      in_flight_.push_back(work);
    }
    cv_.notify_all();
  }

 private:
  // Note [NCCL signature check]: every rank's signature of this collective, gathered on the
  // check communicator; "" when they agree, else call_mismatch's sentence. Throws when the
  // exchange does not finish within `timeout` (a rank did not issue the collective).
  std::string check_signatures(const detail::CallSignature& sig,
                               std::chrono::milliseconds timeout) {
    cuda::DeviceGuard on(device_);
    std::memcpy(check_host_send_.data_ptr(), &sig, kSignatureBytes);
    const cudaStream_t s = cuda::raw(check_stream_);
    LS_CUDA_CHECK(cudaMemcpyAsync(check_send_.data_ptr(), check_host_send_.data_ptr(),
                                  kSignatureBytes, cudaMemcpyHostToDevice, s));
    LS_NCCL_CHECK(ncclAllGather(check_send_.data_ptr(), check_recv_.data_ptr(), kSignatureBytes,
                                ncclUint8, check_comm_, s));
    LS_CUDA_CHECK(cudaMemcpyAsync(check_host_recv_.data_ptr(), check_recv_.data_ptr(),
                                  kSignatureBytes * static_cast<size_t>(size_),
                                  cudaMemcpyDeviceToHost, s));
    // Polled, not synchronized: a rank that never comes must not hold this thread forever.
    const auto deadline = Clock::now() + timeout;
    int spins = 0;
    while (!check_stream_.query()) {
      if (Clock::now() >= deadline) {
        LS_THROW("timed out after ", seconds(timeout),
                 " waiting for every rank's signature of this collective (Note [NCCL signature "
                 "check]): a rank did not reach it or is far behind");
      }
      if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    std::vector<detail::CallSignature> all(static_cast<size_t>(size_));
    std::memcpy(all.data(), check_host_recv_.data_ptr(), kSignatureBytes * all.size());
    return detail::call_mismatch(all);
  }

  std::exception_ptr make_error(const std::string& msg) const {
    return std::make_exception_ptr(Error(msg, __FILE__, __LINE__));
  }

  bool refuse_if_broken(Work& work) {
    std::string broken;
    {
      std::lock_guard<std::mutex> lock(mu_);
      broken = broken_;
    }
    if (broken.empty()) return false;
    work_refuse(work, who_, broken);  // Note [Poisoned group]
    return true;
  }

  // Fails `culprit` with `reason` and every other work in flight as aborted because of it,
  // poisons the group, and aborts the communicator (once, whoever comes first).
  void fail_all(const std::shared_ptr<WorkNCCL>& culprit, const std::string& reason) {
    std::deque<std::shared_ptr<WorkNCCL>> victims;
    std::string first;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_.empty()) broken_ = lockstep::detail::str_cat(culprit->description(), " ", reason);
      first = broken_;
      victims.swap(in_flight_);
    }
    cv_.notify_all();
    // The waiting callers learn of it first: an abort may take long (it waits for the device).
    work_finish(*culprit, make_error(lockstep::detail::str_cat(who_, ": ", culprit->description(),
                                                               " ", reason)));
    for (const auto& w : victims) {
      if (w == culprit) continue;
      work_finish(*w, make_error(lockstep::detail::str_cat(
                          who_, ": ", w->description(),
                          " failed: the communicator was aborted after ", first)));
    }
    abort();
    // Only now may the memory the aborted kernels used be freed.
    for (const auto& w : victims) {
      w->keep_.clear();
      w->steps_.clear();
    }
  }

  void abort() {
    bool expected = false;
    if (!aborting_.compare_exchange_strong(expected, true)) return;
    std::unique_lock<std::timed_mutex> comm(comm_mu_, std::defer_lock);
    if (!comm.try_lock_for(kAbortLockWait)) {
      log_warning(who_, ": aborting the NCCL communicator while a thread is inside an NCCL call");
    }
    cuda::DeviceGuard on(device_);
    for (ncclComm_t c : {check_comm_, comm_}) {
      if (c == nullptr) continue;
      const ncclResult_t r = ncclCommAbort(c);
      if (r != ncclSuccess) {
        log_warning(who_, ": ncclCommAbort failed: ", ncclGetErrorString(r));
      }
    }
    aborted_ = true;
  }

  // The watchdog: completes works whose end event was reached, in order (one stream); fails
  // everything when the oldest one passed its deadline or NCCL reports an error.
  void watch() {
    try {
      cuda::set_device(device_);
    } catch (const Error& e) {
      log_error(who_, ": the NCCL watchdog cannot use cuda:", device_, ": ", e.message());
      return;
    }
    for (;;) {
      std::shared_ptr<WorkNCCL> oldest;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !in_flight_.empty(); });
        if (in_flight_.empty()) return;  // stop_, and nothing left in flight
        oldest = in_flight_.front();
      }
      if (aborting_.load()) {
        // Queued while the group was failing: fail them too, once the abort is done.
        if (!aborted_.load()) {
          std::this_thread::sleep_for(kWatchdogPoll);
          continue;
        }
        std::deque<std::shared_ptr<WorkNCCL>> late;
        std::string first;
        {
          std::lock_guard<std::mutex> lock(mu_);
          late.swap(in_flight_);
          first = broken_;
        }
        for (const auto& w : late) {
          w->keep_.clear();
          w->steps_.clear();
          work_finish(*w, make_error(lockstep::detail::str_cat(
                              who_, ": ", w->description(),
                              " failed: the communicator was aborted after ", first)));
        }
        continue;
      }
      // An error NCCL found on its own (a peer that failed, a network error).
      ncclResult_t async = ncclSuccess;
      {
        std::unique_lock<std::timed_mutex> comm(comm_mu_, std::try_to_lock);
        if (comm.owns_lock() && !aborting_.load()) {
          const ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
          if (r != ncclSuccess) async = r;
        }
      }
      if (async != ncclSuccess && async != ncclInProgress) {
        const char* last = ncclGetLastError(nullptr);
        fail_all(oldest,
                 lockstep::detail::str_cat(
                     "failed: NCCL reported an error: ", ncclGetErrorString(async),
                     last != nullptr && *last != '\0' ? lockstep::detail::str_cat(" (", last, ")")
                                                      : std::string()));
        continue;
      }
      bool done = false;
      try {
        done = oldest->end_.query();
      } catch (const Error& e) {
        fail_all(oldest, lockstep::detail::str_cat("failed on the device: ", e.message()));
        continue;
      }
      if (done) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (in_flight_.empty() || in_flight_.front() != oldest) continue;  // failed meanwhile
          in_flight_.pop_front();
        }
        oldest->keep_.clear();
        oldest->steps_.clear();
        work_finish(*oldest);
        continue;  // the next one may be done too
      }
      if (Clock::now() >= oldest->deadline_) {
        fail_all(oldest, lockstep::detail::str_cat(
                             "timed out after ", seconds(oldest->timeout_),
                             ": a rank did not reach this collective or is far behind (every rank "
                             "must issue the same collectives in the same order); the NCCL "
                             "communicator was aborted"));
        continue;
      }
      std::this_thread::sleep_for(kWatchdogPoll);
    }
  }

  const std::string who_;
  const int device_;
  ncclComm_t comm_ = nullptr;
  cuda::Stream stream_;
  // Note [NCCL signature check]; check_comm_ null: no check (one rank, or turned off).
  ncclComm_t check_comm_ = nullptr;
  cuda::Stream check_stream_;
  Tensor check_send_, check_recv_, check_host_send_, check_host_recv_;
  int size_ = 1;

  // Held while the communicator is used by a thread other than the watchdog's polling (a call
  // queueing a collective, the abort).
  std::timed_mutex comm_mu_;
  std::atomic<bool> aborting_{false};
  std::atomic<bool> aborted_{false};  // the communicator is gone: the destructor leaves it

  std::mutex mu_;  // guards what follows
  std::condition_variable cv_;
  std::deque<std::shared_ptr<WorkNCCL>> in_flight_;  // in stream order
  std::string broken_;                               // the first failure; the group is poisoned
  bool stop_ = false;
  std::thread watchdog_;  // last: starts once everything above exists
};

void register_nccl_backend() {
  register_backend("nccl", [](const BackendConfig& config) -> ProcessGroupPtr {
    return std::make_shared<ProcessGroupNCCL>(config);
  });
}

ProcessGroupNCCL::ProcessGroupNCCL(const BackendConfig& config)
    : ProcessGroup(config.rank, config.size, config.timeout) {
  LS_CHECK(config.store != nullptr, who(), ": a store to rendezvous through is required");
  impl_ = std::make_unique<Impl>(config, who());
}

ProcessGroupNCCL::~ProcessGroupNCCL() = default;

int ProcessGroupNCCL::device() const { return impl_->device(); }
const cuda::Stream& ProcessGroupNCCL::stream() const { return impl_->stream(); }

bool ProcessGroupNCCL::supports(Device device) const {
  return device.is_cuda() && device.index == impl_->device();
}

Device ProcessGroupNCCL::object_device() const { return cuda_device(impl_->device()); }

WorkPtr ProcessGroupNCCL::create_work(std::string description, int64_t seq) {
  return std::make_shared<WorkNCCL>(std::move(description), seq);
}

void ProcessGroupNCCL::do_all_reduce(Tensor tensor, ReduceOp op, std::chrono::milliseconds timeout,
                                     const WorkPtr& work) {
  impl_->launch(work, timeout, {tensor},
                detail::signature(detail::CallKind::all_reduce, &tensor, op),
                [&](ncclComm_t comm, cudaStream_t stream) {
                  if (tensor.numel() == 0) return;
                  LS_NCCL_CHECK(ncclAllReduce(
                      tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                      nccl_type(tensor.dtype()), nccl_op(op), comm, stream));
                });
}

// Broadcast and all_gather move bytes: any dtype, bool included.
void ProcessGroupNCCL::do_broadcast(Tensor tensor, int root, std::chrono::milliseconds timeout,
                                    const WorkPtr& work) {
  impl_->launch(work, timeout, {tensor},
                detail::signature(detail::CallKind::broadcast, &tensor, ReduceOp::sum, root),
                [&](ncclComm_t comm, cudaStream_t stream) {
                  if (tensor.numel() == 0) return;
                  LS_NCCL_CHECK(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(),
                                              static_cast<size_t>(tensor.nbytes()), ncclUint8, root,
                                              comm, stream));
                });
}

void ProcessGroupNCCL::do_all_gather(Tensor output, Tensor input, std::chrono::milliseconds timeout,
                                     const WorkPtr& work) {
  impl_->launch(
      work, timeout, {output, input}, detail::signature(detail::CallKind::all_gather, &input),
      [&](ncclComm_t comm, cudaStream_t stream) {
        if (input.numel() == 0) return;
        LS_NCCL_CHECK(ncclAllGather(input.data_ptr(), output.data_ptr(),
                                    static_cast<size_t>(input.nbytes()), ncclUint8, comm, stream));
      });
}

void ProcessGroupNCCL::do_reduce_scatter(Tensor output, Tensor input, ReduceOp op,
                                         std::chrono::milliseconds timeout, const WorkPtr& work) {
  impl_->launch(work, timeout, {output, input},
                detail::signature(detail::CallKind::reduce_scatter, &output, op),
                [&](ncclComm_t comm, cudaStream_t stream) {
                  if (output.numel() == 0) return;
                  LS_NCCL_CHECK(ncclReduceScatter(
                      input.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()),
                      nccl_type(output.dtype()), nccl_op(op), comm, stream));
                });
}

// NCCL has no barrier: an all-reduce of one element, whose wait() blocks the host.
void ProcessGroupNCCL::do_barrier(std::chrono::milliseconds timeout, const WorkPtr& work) {
  Tensor one = empty({1}, TensorOptions(kFloat32).with_device(cuda_device(impl_->device())));
  one.zero_();
  impl_->launch(
      work, timeout, {one}, detail::signature(detail::CallKind::barrier, nullptr),
      [&](ncclComm_t comm, cudaStream_t stream) {
        LS_NCCL_CHECK(
            ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclFloat32, ncclSum, comm, stream));
      },
      /*host_blocking=*/true);
}

}  // namespace lockstep::dist
