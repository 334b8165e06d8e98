// ProcessGroup: collectives over a set of ranks, each returning an asynchronous Work handle.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/distributed/store/store.h"
#include "lockstep/distributed/trace.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::dist {

// How long a collective may take before it fails on every rank that waits for it (PyTorch's
// default as well). Long enough for a slow first step, short enough that a lost rank does not
// hold a job of many machines for hours.
inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{30 * 60 * 1000};

// Note [Spin before sleeping]
// A thread wake-up can cost hundreds of microseconds on a virtual machine. Work::wait() therefore
// yields in a loop for this long before it blocks, so that a collective about to finish on the
// communication thread is seen at once.
inline constexpr std::chrono::microseconds kSpinBeforeSleep{200};

enum class ReduceOp : uint8_t { sum, avg, min, max, product };
std::string_view reduce_op_name(ReduceOp op);

// In every options struct a timeout of 0 means the group's default (ProcessGroup::timeout()).
struct AllReduceOptions {
  ReduceOp op = ReduceOp::sum;
  std::chrono::milliseconds timeout{0};
};
struct BroadcastOptions {
  int root = 0;
  std::chrono::milliseconds timeout{0};
};
struct AllGatherOptions {
  std::chrono::milliseconds timeout{0};
};
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::sum;
  std::chrono::milliseconds timeout{0};
};
struct BarrierOptions {
  std::chrono::milliseconds timeout{0};
};

// The handle of one collective in flight. Contract (c10d's):
// - is_completed() never blocks; it is true once the collective finished, successfully or not.
// - wait() returns once the collective's results may be used by the caller, and rethrows its
//   failure (a lockstep::Error naming the rank, the op and its sequence number). On the CPU
//   backends it blocks until the collective finished. On a device backend (NCCL) it blocks
//   nothing: it makes the calling thread's current CUDA stream wait for the collective, so the
//   kernels queued after it see the results (Note [Stream-ordered works] in
//   src/distributed/nccl/process_group_nccl.cpp). The collective is bounded by its own timeout, so
//   wait() cannot block forever; wait(timeout) blocks the host, and gives up after `timeout` (an
//   Error, the collective keeps running).
// - synchronize() blocks the host until the collective finished on every backend (what a caller
//   that reads results on the host, or times a collective, needs), and rethrows its failure.
// - The tensors passed to the collective must stay untouched until it completed.
// Completing a Work is the backend's business: finish(), then() and the wait hook are reached
// only through ProcessGroup's protected work_* functions (a backend derives from ProcessGroup; a
// device backend also derives its own Work, through ProcessGroup::create_work).
class Work {
 public:
  Work(std::string description, int64_t seq);
  virtual ~Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  bool is_completed() const;
  bool is_success() const;  // completed without error
  virtual void wait();
  void wait(std::chrono::milliseconds timeout);
  virtual void synchronize();
  std::exception_ptr exception() const;

  // "all_reduce #12 (sum, 2 tensors, 4.0 MiB of float32)" and 12.
  const std::string& description() const { return description_; }
  int64_t seq() const { return seq_; }

 private:
  friend class ProcessGroup;

  // Runs `fn` when the collective succeeds, before the Work counts as completed (on the thread
  // that finishes it); an exception from `fn` fails the Work. For the group's own packing: set
  // before the collective is queued; a step must neither own its group nor wait on it (it runs
  // on the thread that executes the group's collectives).
  void then(std::function<void()> fn);
  // Called by wait() (not by wait(timeout)) before it blocks, with this Work: a backend may run
  // queued collectives on the waiting thread (Note [Caller runs] in
  // src/distributed/gloo/process_group_gloo.cpp). Set before the collective is queued.
  void set_wait_hook(std::function<void(const Work&)> hook) { wait_hook_ = std::move(hook); }
  // Called once by the backend; `error` null on success.
  void finish(std::exception_ptr error = nullptr);
  // Hands the then() steps to a backend that runs them itself, queued on its stream right after
  // the collective (Note [Stream-ordered works]); finish() then runs none, and then() is refused.
  std::vector<std::function<void()>> take_steps();

  const std::string description_;
  const int64_t seq_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool completed_ = false;
  bool finishing_ = false;                   // finish() has started: no more then() steps
  bool steps_taken_ = false;                 // take_steps() was called: no more then() steps
  std::atomic<bool> completed_flag_{false};  // completed_, readable without the lock
  std::exception_ptr error_;
  std::vector<std::function<void()>> on_success_;
  std::function<void(const Work&)> wait_hook_;
  std::shared_ptr<CollectiveTrace> trace_;  // the group's (Note [Collective trace]); may be null
};
using WorkPtr = std::shared_ptr<Work>;

// One interface for collectives over `size()` ranks; backends (distributed/gloo, shm, hier,
// distributed/nccl) implement the do_* hooks. The public methods check their arguments (the same
// on every backend, so an error reads the same everywhere), number each collective and build its
// description.
//
// Every rank must call the same collectives in the same order with matching arguments (sizes,
// dtypes, root). Collectives run in the order they were issued; a backend may run them on its
// own thread, so the caller computes while they are in flight. One thread at a time issues a
// group's collectives (their order is the contract between ranks).
class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  ProcessGroup(int rank, int size, std::chrono::milliseconds timeout);
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  virtual std::string_view backend() const = 0;

  // In place on every tensor; several tensors of one dtype travel as one fused buffer.
  // avg is defined for floating-point tensors only.
  WorkPtr all_reduce(const Tensor& tensor, const AllReduceOptions& opts = {});
  WorkPtr all_reduce(std::vector<Tensor> tensors, const AllReduceOptions& opts = {});
  // Every rank's tensors become root's.
  WorkPtr broadcast(const Tensor& tensor, const BroadcastOptions& opts = {});
  WorkPtr broadcast(std::vector<Tensor> tensors, const BroadcastOptions& opts = {});
  // `output` has size() * input.numel() elements; rank r's input lands in the r-th chunk of
  // output's row-major order. The list form writes rank r's input into outputs[r].
  WorkPtr all_gather(const Tensor& output, const Tensor& input, const AllGatherOptions& opts = {});
  WorkPtr all_gather(std::vector<Tensor> outputs, const Tensor& input,
                     const AllGatherOptions& opts = {});
  // `input` has size() * output.numel() elements; rank r receives the reduction over ranks of
  // the r-th chunk of input (input is not modified). In place, as NCCL's and MPI's: `output` may
  // be input's chunk rank() (input.narrow(0, rank() * n, n) of a contiguous input), which then
  // holds the result and the other chunks are left alone; any other overlap is an error.
  WorkPtr reduce_scatter(const Tensor& output, const Tensor& input,
                         const ReduceScatterOptions& opts = {});
  WorkPtr barrier(const BarrierOptions& opts = {});

  // Host values (counts, a loss, a step number, hashes, a checkpoint's bytes) on any backend,
  // blocking, in place: each takes CPU tensors, and on a backend that moves device tensors only
  // (nccl) they travel through this rank's device and back, as PyTorch users copy such values
  // to the GPU before dist.all_reduce. The one way to put host data through a collective; the
  // tensor calls above take tensors on a device the backend moves.
  void all_reduce_host(const Tensor& values, const AllReduceOptions& opts = {});
  void broadcast_host(const Tensor& values, const BroadcastOptions& opts = {});
  // `output` has size() * input.numel() elements, as all_gather's.
  void all_gather_host(const Tensor& output, const Tensor& input,
                       const AllGatherOptions& opts = {});

  // Small byte strings (configuration, names, shapes), blocking. Every rank receives root's
  // `object` / every rank's `object`, in rank order.
  Bytes broadcast_object(const Bytes& object, int root = 0);
  std::vector<Bytes> all_gather_object(const Bytes& object);

  // Collectives issued so far.
  int64_t sequence_number() const { return seq_; }

  // The last collectives of this group, always recorded (Note [Collective trace] in
  // lockstep/distributed/trace.h); init_process_group exports the world group's to the file
  // `lockstep run` names.
  CollectiveTrace& trace() { return *trace_; }
  const CollectiveTrace& trace() const { return *trace_; }

 protected:
  // Arguments are checked, and every tensor is contiguous: several tensors (or a strided one)
  // were packed into one flat buffer here, and are unpacked by a Work::then step. A backend
  // finishes `work` (on any thread) once the collective is done; the timeout is resolved (never
  // 0). Sizes may be 0.
  virtual void do_all_reduce(Tensor tensor, ReduceOp op, std::chrono::milliseconds timeout,
                             const WorkPtr& work) = 0;
  virtual void do_broadcast(Tensor tensor, int root, std::chrono::milliseconds timeout,
                            const WorkPtr& work) = 0;
  virtual void do_all_gather(Tensor output, Tensor input, std::chrono::milliseconds timeout,
                             const WorkPtr& work) = 0;
  virtual void do_reduce_scatter(Tensor output, Tensor input, ReduceOp op,
                                 std::chrono::milliseconds timeout, const WorkPtr& work) = 0;
  virtual void do_barrier(std::chrono::milliseconds timeout, const WorkPtr& work) = 0;
  // Whether the backend can move tensors on `device`. A CPU backend handed cuda tensors stages
  // them through pinned host memory (Note [Staging device tensors] in process_group.cpp); any
  // other unsupported device makes the public calls fail naming the backend.
  virtual bool supports(Device device) const = 0;
  // Where broadcast_object and all_gather_object put their bytes: a device this backend moves.
  virtual Device object_device() const { return kCPU; }
  // The Work of each collective (a device backend's own kind, whose wait() orders streams).
  virtual WorkPtr create_work(std::string description, int64_t seq) {
    return std::make_shared<Work>(std::move(description), seq);
  }

  // "rank 1/4 (gloo)", the start of every error message about this group.
  std::string who() const;

  // A backend's side of Work (callers only wait): completes `work` (once; `error` null on
  // success), and installs the hook its wait() runs before blocking (Note [Caller runs] in
  // src/distributed/gloo/process_group_gloo.cpp).
  static void work_finish(Work& work, std::exception_ptr error = nullptr) { work.finish(error); }
  // Note [Poisoned group]: a collective that fails once data may have moved (a timeout, a lost
  // peer) leaves the group's connections or shared memory in a state nothing can trust, so the
  // backend keeps the first failure and every later collective fails at once naming it
  // (ARCHITECTURE.md, decision 7). A signature mismatch found before any data moved does not
  // poison. Each backend keeps `first_failure` under its own threading rule (gloo's
  // communication thread, shm's caller, hier's and nccl's mutex); this finishes `work` with the
  // one message they all give: "<who>: <collective> was not run: this group failed earlier
  // (<first_failure>); build a new group to continue".
  static void work_refuse(Work& work, const std::string& who, const std::string& first_failure);
  static void work_set_wait_hook(Work& work, std::function<void(const Work&)> hook) {
    work.set_wait_hook(std::move(hook));
  }
  static std::vector<std::function<void()>> work_take_steps(Work& work) {
    return work.take_steps();
  }
  // The backend starts moving `work`'s data (the trace's "started"; optional).
  static void work_start(const Work& work) {
    if (work.trace_) work.trace_->record_start(work.seq_);
  }
  // The public calls' buffers are staged for this device (cuda tensors on a CPU backend).
  bool stages(Device device) const {
    return !supports(device) && device.is_cuda() && supports(kCPU);
  }

 private:
  // Numbers the collective, records it in the trace (kind: detail::CallKind; op: ReduceOp or 0)
  // and builds its Work.
  WorkPtr make_work(std::string_view name, std::string detail, uint32_t kind, DType dtype,
                    uint32_t op, int root, int64_t numel);
  std::chrono::milliseconds effective(std::chrono::milliseconds timeout) const;
  void check_tensors(std::string_view op, const std::vector<Tensor>& tensors, bool reduction) const;
  void check_host(std::string_view op, const Tensor& t) const;
  // Note [Staging device tensors]: what do_* moves in place of `t` (t itself, or a pinned host
  // copy holding t's values when `copy_in`), and the step that copies it back to t.
  Tensor stage_in(const Tensor& t, bool copy_in) const;
  static void stage_back(const WorkPtr& work, const Tensor& t, const Tensor& staged);

  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  int64_t seq_ = 0;
  std::shared_ptr<CollectiveTrace> trace_ = std::make_shared<CollectiveTrace>();
  bool trace_identity_set_ = false;  // backend() is virtual: named at the first collective
};
using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

// The group of one process: every collective completes at once, without a network, so a
// single-process run takes the same code path as a distributed one. Tensors on any device, or,
// given `only` (the world of one of the nccl backend, on the rank's GPU), on that device only, as
// the backend of a larger world would take them: a host tensor that NCCL would refuse is refused
// here too. The copies it makes (all_gather, reduce_scatter) are queued on the current stream.
class WorldOfOneGroup : public ProcessGroup {
 public:
  explicit WorldOfOneGroup(std::chrono::milliseconds timeout = kDefaultCollectiveTimeout,
                           std::optional<Device> only = std::nullopt)
      : ProcessGroup(0, 1, timeout), only_(only) {}
  std::string_view backend() const override { return "local"; }

 protected:
  void do_all_reduce(Tensor tensor, ReduceOp op, std::chrono::milliseconds timeout,
                     const WorkPtr& work) override;
  void do_broadcast(Tensor tensor, int root, std::chrono::milliseconds timeout,
                    const WorkPtr& work) override;
  void do_all_gather(Tensor output, Tensor input, std::chrono::milliseconds timeout,
                     const WorkPtr& work) override;
  void do_reduce_scatter(Tensor output, Tensor input, ReduceOp op,
                         std::chrono::milliseconds timeout, const WorkPtr& work) override;
  void do_barrier(std::chrono::milliseconds timeout, const WorkPtr& work) override;
  bool supports(Device device) const override { return !only_ || device == *only_; }
  Device object_device() const override { return only_.value_or(kCPU); }

 private:
  const std::optional<Device> only_;
};

// ---- Backends by name ----

// What a backend needs to build a group: the store to rendezvous through (already namespaced
// for this group), this process's rank and the group's size, the default timeout, and where the
// transport binds. connect_world() computes the bind address once (from LOCKSTEP_SOCKET_IFNAME,
// else the local address that routes to MASTER_ADDR) and hands the same value to every group it
// builds; with neither field set a backend binds loopback (ranks on one machine, as in tests).
struct BackendConfig {
  std::shared_ptr<Store> store;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
  std::string bind_address;    // a local address ("10.1.2.3"), or
  std::string bind_interface;  // an interface ("eth0") whose address the transport takes
};
using BackendFactory = std::function<ProcessGroupPtr(const BackendConfig&)>;

// The registry knows backends by name and factory only. The built-in ones ("gloo") register
// themselves on the registry's first use (src/distributed/builtin_backends.cpp names them).
// Registering a name again replaces its factory.
void register_backend(const std::string& name, BackendFactory factory);
bool has_backend(const std::string& name);
std::vector<std::string> backend_names();
// A group of config.size ranks through the named backend; a size of 1 gives a WorldOfOneGroup
// (no store needed). An unknown name is an Error listing the registered ones.
ProcessGroupPtr create_process_group(const std::string& backend, const BackendConfig& config);

}  // namespace lockstep::dist
