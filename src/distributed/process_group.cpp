// Work, the backend-independent half of ProcessGroup (argument checks, packing, numbering) and
// the world-of-one group.
#include "lockstep/distributed/process_group.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "distributed/call_signature.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/tensor/cuda.h"

namespace lockstep::dist {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::min:
      return "min";
    case ReduceOp::max:
      return "max";
    case ReduceOp::product:
      return "product";
  }
  return "?";
}

// ---- Work ----

Work::Work(std::string description, int64_t seq)
    : description_(std::move(description)), seq_(seq) {}

bool Work::is_completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_;
}

bool Work::is_success() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_ && !error_;
}

std::exception_ptr Work::exception() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

namespace {

// Yields until `ready` is true or kSpinBeforeSleep passed; Note [Spin before sleeping] in
// include/lockstep/distributed/process_group.h.
void spin_until(const std::atomic<bool>& ready) {
  const auto until = std::chrono::steady_clock::now() + kSpinBeforeSleep;
  while (!ready.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < until) {
    std::this_thread::yield();
  }
}

}  // namespace

void Work::wait() {
  if (completed_flag_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) std::rethrow_exception(error_);
    return;
  }
  if (trace_) trace_->record_wait(seq_);
  if (wait_hook_ && !completed_flag_.load(std::memory_order_acquire)) wait_hook_(*this);
  spin_until(completed_flag_);
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return completed_; });
  if (trace_) trace_->record_wait(0);
  if (error_) std::rethrow_exception(error_);
}

void Work::wait(std::chrono::milliseconds timeout) {
  if (timeout >= kSpinBeforeSleep) spin_until(completed_flag_);
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
    LS_THROW(description_, " did not complete within the ", timeout.count(),
             " ms given to wait(); it is still running (its own timeout bounds it)");
  }
  if (error_) std::rethrow_exception(error_);
}

void Work::synchronize() { Work::wait(); }

void Work::then(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  LS_CHECK(!finishing_ && !steps_taken_, "Work::then on ", description_,
           ", whose steps have already run");
  on_success_.push_back(std::move(fn));
}

std::vector<std::function<void()>> Work::take_steps() {
  std::lock_guard<std::mutex> lock(mu_);
  steps_taken_ = true;
  return std::move(on_success_);
}

void Work::finish(std::exception_ptr error) {
  std::vector<std::function<void()>> steps;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finishing_) return;
    finishing_ = true;
    steps.swap(on_success_);
  }
  if (!error) {
    try {
      for (auto& step : steps) step();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (trace_) trace_->record_finish(seq_, error == nullptr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    completed_ = true;
    error_ = error;
    completed_flag_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

// ---- ProcessGroup ----

namespace {

std::string format_bytes(int64_t n) {
  char buf[32];
  if (n < 1024) {
    std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(n));
  } else if (n < 1024 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.1f KiB", static_cast<double>(n) / 1024);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(n) / (1024 * 1024));
  }
  return buf;
}

std::string describe(const std::vector<Tensor>& tensors) {
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.nbytes();
  return lockstep::detail::str_cat(tensors.size(), tensors.size() == 1 ? " tensor, " : " tensors, ",
                                   format_bytes(bytes), " of ", dtype_name(tensors[0].dtype()));
}

bool is_reducible(DType t) {
  switch (t) {
    case DType::f32:
    case DType::f64:
    case DType::bf16:
    case DType::f16:
    case DType::i32:
    case DType::i64:
      return true;
    default:
      return false;
  }
}

// Copies `src` into `dst` (same number of elements, same dtype), whatever their strides and
// devices; a copy that involves a device is queued on the current stream. Collectives write into
// parameters that require grad; the copy is not part of any graph.
void copy_elements(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 0) return;
  if (dst.is_contiguous() && src.is_contiguous() && dst.data_ptr() == src.data_ptr() &&
      dst.device() == src.device())
    return;  // the same elements (a world of one's reduce_scatter in place)
  if (dst.device().is_cpu() && src.device().is_cpu() && dst.is_contiguous() &&
      src.is_contiguous()) {
    std::memcpy(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(dst.nbytes()));
    return;
  }
  autograd::NoGradGuard no_grad;
  // Row-major order on both sides: src reshaped to dst's shape (a view when src is contiguous).
  dst.detach().copy_(src.detach().reshape(dst.shape()));
}

// One contiguous buffer holding every tensor's elements in order.
Tensor pack(const std::vector<Tensor>& tensors, bool copy_values) {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  Tensor flat = empty({total}, TensorOptions(tensors[0].dtype()).with_device(tensors[0].device()));
  if (!copy_values) return flat;
  int64_t offset = 0;
  for (const auto& t : tensors) {
    copy_elements(flat.narrow(0, offset, t.numel()), t);
    offset += t.numel();
  }
  return flat;
}

void unpack(const Tensor& flat, const std::vector<Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    copy_elements(t, flat.narrow(0, offset, t.numel()));
    offset += t.numel();
  }
}

// Where a collective writes dst: dst itself, or for a non-contiguous view a contiguous stand-in
// that a then() step copies back when the collective succeeds.
Tensor writable_contiguous(const Tensor& dst) {
  return dst.is_contiguous()
             ? dst
             : empty({dst.numel()}, TensorOptions(dst.dtype()).with_device(dst.device()));
}

// A CPU tensor of t's elements (flat) and dtype in page-locked memory, which the device copies
// to and from directly and asynchronously (pageable memory would go through a staging block).
Tensor pinned_empty_like(const Tensor& t) {
  if (t.numel() == 0) return empty({0}, t.dtype());  // nothing to copy either way
  return empty_pinned({t.numel()}, t.dtype());
}

}  // namespace

ProcessGroup::ProcessGroup(int rank, int size, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), timeout_(timeout) {
  LS_CHECK(size >= 1, "process group: expected a size >= 1, got ", size);
  LS_CHECK(rank >= 0 && rank < size, "process group: rank ", rank, " is outside [0, ", size, ")");
  LS_CHECK(timeout.count() > 0, "process group: expected a timeout > 0 ms, got ", timeout.count(),
           " ms");
}

void ProcessGroup::work_refuse(Work& work, const std::string& who,
                               const std::string& first_failure) {
  work.finish(std::make_exception_ptr(
      Error(lockstep::detail::str_cat(who, ": ", work.description(),
                                      " was not run: this group failed earlier (", first_failure,
                                      "); build a new group to continue"),
            __FILE__, __LINE__)));
}

std::string ProcessGroup::who() const {
  return lockstep::detail::str_cat("rank ", rank_, "/", size_, " (", backend(), ")");
}

WorkPtr ProcessGroup::make_work(std::string_view name, std::string detail, uint32_t kind,
                                DType dtype, uint32_t op, int root, int64_t numel) {
  const int64_t seq = ++seq_;
  WorkPtr work = create_work(lockstep::detail::str_cat(name, " #", seq, " (", detail, ")"), seq);
  if (!trace_identity_set_) {
    trace_->set_identity(rank_, size_, backend());
    trace_identity_set_ = true;
  }
  trace_->record_issue(seq, kind, static_cast<uint32_t>(dtype), op, root, numel);
  work->trace_ = trace_;
  return work;
}

// Note [Staging device tensors]
// One GPU cannot host two NCCL ranks, and a job may want the CPU backends on GPUs anyway (no
// NCCL, a debugging run). So a CPU backend (supports(kCPU), not supports(cuda)) takes cuda
// tensors too: each public call copies the buffer it hands to do_* into pinned host memory
// (the copy waits for the caller's current stream, so it sees every kernel queued before the
// call, and blocks the host until done), runs the collective on the host copy, and a then()
// step copies the result back to the device on the stream that was current at the call, before
// the Work completes. Kernels queued on that stream after wait() therefore see the result; the
// host copy returns to the pinned pool only once the copy back has read it (its fence). Staging
// happens here, once, so that every CPU backend behaves alike; a backend that moves cuda
// tensors itself (nccl) is never staged.
Tensor ProcessGroup::stage_in(const Tensor& t, bool copy_in) const {
  if (!stages(t.device())) return t;
  Tensor host = pinned_empty_like(t);
  if (copy_in) copy_elements(host, t);  // device to pinned host: waits for the copy
  return host;
}

void ProcessGroup::stage_back(const WorkPtr& work, const Tensor& t, const Tensor& staged) {
  if (staged.is_same(t)) return;
  const cuda::Stream stream = cuda::current_stream(t.device().index);
  work->then([t, staged, stream] {
    // On the thread that finishes the Work: queue the copy on the caller's stream.
    cuda::DeviceGuard device(stream.device());
    cuda::StreamGuard on(stream);
    copy_elements(t, staged);
  });
}

std::chrono::milliseconds ProcessGroup::effective(std::chrono::milliseconds timeout) const {
  LS_CHECK(timeout.count() >= 0, who(), ": expected a collective timeout >= 0 ms (0: the group's ",
           timeout_.count(), " ms), got ", timeout.count(), " ms");
  return timeout.count() == 0 ? timeout_ : timeout;
}

void ProcessGroup::check_tensors(std::string_view op, const std::vector<Tensor>& tensors,
                                 bool reduction) const {
  LS_CHECK(!tensors.empty(), who(), ": ", op, " needs at least one tensor, got none");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    LS_CHECK(t.defined(), who(), ": ", op, ": tensor ", i, " is undefined");
    LS_CHECK(supports(t.device()) || stages(t.device()), who(), ": ", op, ": the ", backend(),
             " backend cannot move tensors on ", t.device().str(), " (tensor ", i, ")",
             supports(kCPU) ? std::string()
                            : lockstep::detail::str_cat(
                                  "; it moves tensors on this rank's ", object_device().str(),
                                  " only: copy the tensor there (.to(", object_device().str(),
                                  ")); host values go through all_reduce_host, broadcast_host "
                                  "or all_gather_host"));
    LS_CHECK(t.dtype() == tensors[0].dtype(), who(), ": ", op,
             ": every tensor of one call must have one dtype; tensor 0 is ",
             dtype_name(tensors[0].dtype()), ", tensor ", i, " is ", dtype_name(t.dtype()));
    LS_CHECK(t.device() == tensors[0].device(), who(), ": ", op,
             ": every tensor of one call must be on one device; tensor 0 is on ",
             tensors[0].device().str(), ", tensor ", i, " on ", t.device().str());
    LS_CHECK(!reduction || is_reducible(t.dtype()), who(), ": ", op, " cannot reduce ",
             dtype_name(t.dtype()),
             " tensors; expected f32, f64, bf16, f16, "
             "i32 or i64");
  }
}

WorkPtr ProcessGroup::all_reduce(const Tensor& tensor, const AllReduceOptions& opts) {
  return all_reduce(std::vector<Tensor>{tensor}, opts);
}

WorkPtr ProcessGroup::all_reduce(std::vector<Tensor> tensors, const AllReduceOptions& opts) {
  check_tensors("all_reduce", tensors, true);
  LS_CHECK(opts.op != ReduceOp::avg || is_floating(tensors[0].dtype()), who(),
           ": all_reduce with avg needs floating-point tensors, got ",
           dtype_name(tensors[0].dtype()), "; use sum and divide as you see fit");
  const auto timeout = effective(opts.timeout);
  // Buffers first: a failure here must not consume a sequence number (ranks would disagree).
  const bool packed = !(tensors.size() == 1 && tensors[0].is_contiguous());
  Tensor flat = packed ? pack(tensors, true) : tensors[0];
  Tensor wire = stage_in(flat, true);
  WorkPtr work = make_work(
      "all_reduce", lockstep::detail::str_cat(reduce_op_name(opts.op), ", ", describe(tensors)),
      static_cast<uint32_t>(detail::CallKind::all_reduce), flat.dtype(),
      static_cast<uint32_t>(opts.op), 0, flat.numel());
  stage_back(work, flat, wire);  // steps run in order: the staged copy back, then the unpacking
  if (packed) work->then([flat, tensors] { unpack(flat, tensors); });
  do_all_reduce(wire, opts.op, timeout, work);
  return work;
}

WorkPtr ProcessGroup::broadcast(const Tensor& tensor, const BroadcastOptions& opts) {
  return broadcast(std::vector<Tensor>{tensor}, opts);
}

WorkPtr ProcessGroup::broadcast(std::vector<Tensor> tensors, const BroadcastOptions& opts) {
  check_tensors("broadcast", tensors, false);
  LS_CHECK(opts.root >= 0 && opts.root < size_, who(), ": broadcast: root ", opts.root,
           " is outside [0, ", size_, ")");
  const auto timeout = effective(opts.timeout);
  const bool packed = !(tensors.size() == 1 && tensors[0].is_contiguous());
  const bool root = rank_ == opts.root;
  Tensor flat = packed ? pack(tensors, root) : tensors[0];
  Tensor wire = stage_in(flat, root);
  WorkPtr work = make_work(
      "broadcast", lockstep::detail::str_cat("root ", opts.root, ", ", describe(tensors)),
      static_cast<uint32_t>(detail::CallKind::broadcast), flat.dtype(), 0, opts.root, flat.numel());
  if (!root) stage_back(work, flat, wire);
  if (packed && !root) work->then([flat, tensors] { unpack(flat, tensors); });
  do_broadcast(wire, opts.root, timeout, work);
  return work;
}

WorkPtr ProcessGroup::all_gather(const Tensor& output, const Tensor& input,
                                 const AllGatherOptions& opts) {
  check_tensors("all_gather", {output, input}, false);
  LS_CHECK(output.numel() == size_ * input.numel(), who(), ": all_gather: the output needs ", size_,
           " x ", input.numel(), " = ", size_ * input.numel(),
           " elements (world size x input), got ", output.numel(), " (shape ", output.shape().str(),
           ")");
  const auto timeout = effective(opts.timeout);
  Tensor out = writable_contiguous(output);
  Tensor wire_out = stage_in(out, false);
  Tensor wire_in = stage_in(input.contiguous(), true);
  WorkPtr work = make_work("all_gather", describe({input}),
                           static_cast<uint32_t>(detail::CallKind::all_gather), input.dtype(), 0, 0,
                           input.numel());
  stage_back(work, out, wire_out);
  if (!output.is_contiguous()) work->then([output, out] { copy_elements(output, out); });
  do_all_gather(wire_out, wire_in, timeout, work);
  return work;
}

WorkPtr ProcessGroup::all_gather(std::vector<Tensor> outputs, const Tensor& input,
                                 const AllGatherOptions& opts) {
  LS_CHECK(static_cast<int>(outputs.size()) == size_, who(), ": all_gather: expected ", size_,
           " output tensors (one per rank), got ", outputs.size());
  std::vector<Tensor> all = outputs;
  all.push_back(input);
  check_tensors("all_gather", all, false);
  for (size_t r = 0; r < outputs.size(); ++r) {
    LS_CHECK(outputs[r].numel() == input.numel(), who(), ": all_gather: output ", r, " has ",
             outputs[r].numel(), " elements (shape ", outputs[r].shape().str(),
             "), expected the input's ", input.numel());
  }
  const auto timeout = effective(opts.timeout);
  Tensor flat = pack(outputs, false);
  Tensor wire_out = stage_in(flat, false);
  Tensor wire_in = stage_in(input.contiguous(), true);
  WorkPtr work = make_work("all_gather", describe({input}),
                           static_cast<uint32_t>(detail::CallKind::all_gather), input.dtype(), 0, 0,
                           input.numel());
  stage_back(work, flat, wire_out);
  work->then([flat, outputs] { unpack(flat, outputs); });
  do_all_gather(wire_out, wire_in, timeout, work);
  return work;
}

WorkPtr ProcessGroup::reduce_scatter(const Tensor& output, const Tensor& input,
                                     const ReduceScatterOptions& opts) {
  check_tensors("reduce_scatter", {output, input}, true);
  LS_CHECK(input.numel() == size_ * output.numel(), who(), ": reduce_scatter: the input needs ",
           size_, " x ", output.numel(), " = ", size_ * output.numel(),
           " elements (world size x output), got ", input.numel(), " (shape ", input.shape().str(),
           ")");
  LS_CHECK(opts.op != ReduceOp::avg || is_floating(input.dtype()), who(),
           ": reduce_scatter with avg needs floating-point tensors, got ",
           dtype_name(input.dtype()));
  if (output.numel() > 0 && output.is_contiguous() && input.is_contiguous() &&
      output.device() == input.device()) {
    const auto* o = static_cast<const uint8_t*>(output.data_ptr());
    const auto* i = static_cast<const uint8_t*>(input.data_ptr());
    const bool overlap = o < i + input.nbytes() && i < o + output.nbytes();
    LS_CHECK(!overlap || o == i + rank_ * output.nbytes(), who(),
             ": reduce_scatter: the output overlaps the input other than as its chunk ", rank_,
             " (in place); it starts ", (o - i) / output.element_size(),
             " elements into the input, expected ", rank_ * output.numel(), " or no overlap");
  }
  const auto timeout = effective(opts.timeout);
  Tensor out = writable_contiguous(output);
  Tensor wire_out = stage_in(out, false);
  Tensor wire_in = stage_in(input.contiguous(), true);
  WorkPtr work = make_work(
      "reduce_scatter", lockstep::detail::str_cat(reduce_op_name(opts.op), ", ", describe({input})),
      static_cast<uint32_t>(detail::CallKind::reduce_scatter), input.dtype(),
      static_cast<uint32_t>(opts.op), 0, output.numel());
  stage_back(work, out, wire_out);
  if (!output.is_contiguous()) work->then([output, out] { copy_elements(output, out); });
  do_reduce_scatter(wire_out, wire_in, opts.op, timeout, work);
  return work;
}

WorkPtr ProcessGroup::barrier(const BarrierOptions& opts) {
  const auto timeout = effective(opts.timeout);
  WorkPtr work = make_work("barrier", lockstep::detail::str_cat(size_, " ranks"),
                           static_cast<uint32_t>(detail::CallKind::barrier), DType::u8, 0, 0, 0);
  do_barrier(timeout, work);
  return work;
}

namespace {

// The bytes of `host` (a CPU tensor) on `device`, and back: object collectives travel on a
// device the backend moves (object_device()).
Tensor on_device(const Tensor& host, Device device) {
  return device.is_cpu() ? host : host.to(device);
}
Tensor on_host(const Tensor& t) { return t.device().is_cpu() ? t : t.to(kCPU); }

}  // namespace

void ProcessGroup::check_host(std::string_view op, const Tensor& t) const {
  LS_CHECK(t.defined() && t.device().is_cpu(), who(), ": ", op, ": expected a CPU tensor, got ",
           t.defined() ? t.device().str() : std::string("an undefined tensor"),
           "; device tensors go through ", op.substr(0, op.size() - 5));
}

void ProcessGroup::all_reduce_host(const Tensor& values, const AllReduceOptions& opts) {
  check_host("all_reduce_host", values);
  const Device dev = object_device();
  if (dev.is_cpu()) return all_reduce(values, opts)->synchronize();
  const Tensor wire = values.to(dev);
  all_reduce(wire, opts)->wait();
  copy_elements(values, on_host(wire));  // to(kCPU) waits for the collective
}

void ProcessGroup::broadcast_host(const Tensor& values, const BroadcastOptions& opts) {
  check_host("broadcast_host", values);
  const Device dev = object_device();
  if (dev.is_cpu()) return broadcast(values, opts)->synchronize();
  const Tensor wire = values.to(dev);
  broadcast(wire, opts)->wait();
  copy_elements(values, on_host(wire));
}

void ProcessGroup::all_gather_host(const Tensor& output, const Tensor& input,
                                   const AllGatherOptions& opts) {
  check_host("all_gather_host", output);
  check_host("all_gather_host", input);
  const Device dev = object_device();
  if (dev.is_cpu()) return all_gather(output, input, opts)->synchronize();
  const Tensor wire = empty({output.numel()}, TensorOptions(output.dtype()).with_device(dev));
  all_gather(wire, input.to(dev), opts)->wait();
  copy_elements(output, on_host(wire));
}

// Two broadcasts: the length (so receivers can size their buffer), then the bytes.
Bytes ProcessGroup::broadcast_object(const Bytes& object, int root) {
  const Device dev = object_device();
  Tensor length =
      on_device(full({1}, rank_ == root ? static_cast<double>(object.size()) : 0.0, kInt64), dev);
  broadcast(length, {.root = root})->wait();
  const int64_t n = on_host(length).data<int64_t>()[0];
  Tensor data = empty({n}, kUInt8);
  if (rank_ == root && n > 0) std::memcpy(data.data_ptr(), object.data(), object.size());
  data = on_device(data, dev);
  broadcast(data, {.root = root})->wait();
  data = on_host(data);
  const auto* p = static_cast<const uint8_t*>(data.data_ptr());
  return Bytes(p, p + n);
}

// Two all_gathers: every length, then every object padded to the longest.
std::vector<Bytes> ProcessGroup::all_gather_object(const Bytes& object) {
  const Device dev = object_device();
  Tensor mine = on_device(full({1}, static_cast<double>(object.size()), kInt64), dev);
  Tensor lengths = empty({size_}, TensorOptions(kInt64).with_device(dev));
  all_gather(lengths, mine)->wait();
  lengths = on_host(lengths);
  const auto* len = lengths.data<int64_t>();
  const int64_t longest = *std::max_element(len, len + size_);
  Tensor padded = zeros({longest}, kUInt8);
  if (!object.empty()) std::memcpy(padded.data_ptr(), object.data(), object.size());
  padded = on_device(padded, dev);
  Tensor all = empty({size_ * longest}, TensorOptions(kUInt8).with_device(dev));
  all_gather(all, padded)->wait();
  all = on_host(all);
  std::vector<Bytes> out(static_cast<size_t>(size_));
  const auto* p = static_cast<const uint8_t*>(all.data_ptr());
  for (int r = 0; r < size_; ++r) out[r].assign(p + r * longest, p + r * longest + len[r]);
  return out;
}

// ---- WorldOfOneGroup: with one rank every collective is the identity ----

void WorldOfOneGroup::do_all_reduce(Tensor, ReduceOp, std::chrono::milliseconds,
                                    const WorkPtr& work) {
  work_finish(*work);
}

void WorldOfOneGroup::do_broadcast(Tensor, int, std::chrono::milliseconds, const WorkPtr& work) {
  work_finish(*work);
}

void WorldOfOneGroup::do_all_gather(Tensor output, Tensor input, std::chrono::milliseconds,
                                    const WorkPtr& work) {
  copy_elements(output, input);
  work_finish(*work);
}

void WorldOfOneGroup::do_reduce_scatter(Tensor output, Tensor input, ReduceOp,
                                        std::chrono::milliseconds, const WorkPtr& work) {
  copy_elements(output, input);
  work_finish(*work);
}

void WorldOfOneGroup::do_barrier(std::chrono::milliseconds, const WorkPtr& work) {
  work_finish(*work);
}

}  // namespace lockstep::dist
