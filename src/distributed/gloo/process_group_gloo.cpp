// ProcessGroupGloo: a queue of collectives drained by one communication thread that owns the
// Gloo context.
#include "lockstep/distributed/gloo/process_group_gloo.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include <gloo/allgather.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

#include "distributed/deadline.h"
#include "distributed/gloo/p2p.h"
#include "distributed/gloo/register.h"
#include "distributed/gloo/store_adapter.h"
#include "lockstep/base/env_var.h"
#include "lockstep/base/error.h"
#include "lockstep/base/log.h"
#include "lockstep/base/worker_env.h"
#include "lockstep/distributed/cost_model.h"

namespace lockstep::dist {

namespace {

// Where the transport listens when the caller named neither an address nor an interface: ranks
// on one machine (connect_world always names one; see BackendConfig).
constexpr const char* kLoopback = "127.0.0.1";

// Adds what a person needs to act on Gloo's terse messages.
std::string explain(const std::string& what, std::chrono::milliseconds timeout) {
  if (what.find("Timed out") != std::string::npos) {
    return lockstep::detail::str_cat(
        "timed out after ", timeout.count(), " ms (", what,
        "): a rank did not reach this collective or is far behind; every rank must issue the "
        "same collectives in the same order");
  }
  if (what.find("closed") != std::string::npos || what.find("reset") != std::string::npos ||
      what.find("Broken pipe") != std::string::npos) {
    return lockstep::detail::str_cat(
        "a peer closed its connection (", what,
        "): its process exited or crashed, or its own collective failed "
        "first; see the other ranks' errors");
  }
  return what;
}

// Gloo's TCP transport writes with writev(), which raises SIGPIPE when a peer is gone; that
// signal's default action kills the process before the error can be reported. The
// communication thread blocks it, and Gloo's event-loop thread, created from there, inherits the
// mask; writes then fail with EPIPE, which Gloo reports as an error.
void block_sigpipe_on_this_thread() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

// How long a queued collective is left for a waiting caller to run (Note [Caller runs]); an
// asynchronous collective starts at most this late.
constexpr std::chrono::microseconds kCallerGrace{50};

// Blocks SIGPIPE on a caller's thread while it runs collectives (Note [Caller runs]), then
// discards a SIGPIPE raised meanwhile before restoring the caller's mask.
class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~SigpipeBlocked() {
    if (sigismember(&old_, SIGPIPE)) return;  // blocked before: leave it as it was
    sigset_t pending;
    sigemptyset(&pending);
    if (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE)) {
      const timespec zero{0, 0};
      sigtimedwait(&pipe_, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeBlocked(const SigpipeBlocked&) = delete;
  SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

 private:
  sigset_t pipe_;
  sigset_t old_;
};

using Clock = std::chrono::steady_clock;

}  // namespace

class ProcessGroupGloo::Impl : public std::enable_shared_from_this<ProcessGroupGloo::Impl> {
 public:
  Impl(std::string who, int rank, int size)
      : who_(std::move(who)), rank_(rank), size_(size), thread_([this] { loop(); }) {}

  ~Impl() { shutdown(); }

  // Runs what is queued, then stops the communication thread. Idempotent. Called by
  // ~ProcessGroupGloo, so that destroying a group drains it even while a waiting caller's hook
  // still holds this Impl.
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (!thread_.joinable()) return;
    if (thread_.get_id() == std::this_thread::get_id()) {
      // The last owner went away inside a task (a Work::then step holding the group): the
      // thread cannot join itself; it exits once the queue is empty.
      thread_.detach();
      return;
    }
    thread_.join();
  }

  // Creates the transport and connects to every rank, on the communication thread.
  void connect(const BackendConfig& config) {
    auto done = std::make_shared<std::promise<void>>();
    post([this, &config, done] {
      try {
        gloo::transport::tcp::attr attr;
        if (!config.bind_address.empty()) {
          attr.hostname = config.bind_address;
        } else if (!config.bind_interface.empty()) {
          attr.iface = config.bind_interface;
        } else {
          attr.hostname = kLoopback;
        }
        address_ = attr.iface.empty() ? attr.hostname : attr.iface;
        try {
          device_ = gloo::transport::tcp::CreateDevice(attr);
        } catch (const std::exception& e) {
          LS_THROW(who_, ": cannot listen on ", address_, " for Gloo's connections: ", e.what());
        }
        // Read (and checked) on every rank before connecting, so that a bad value fails this
        // rank's connect, which tells the others; rank 0's are the ones used, below.
        link_ = link_from_env();
        algorithm_ = algorithm_setting_from_env();
        calibrate_ = env_flag(env::kNetCalibrate).value_or(false);
        auto context = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
        context->setTimeout(config.timeout);
        detail::GlooStoreAdapter adapter(config.store, config.timeout);
        try {
          context->connectFullMesh(adapter, device_);
        } catch (const Error& e) {
          LS_THROW(who_, ": rendezvous with the other ", size_ - 1, " ranks failed: ", e.message());
        } catch (const std::exception& e) {
          LS_THROW(who_, ": connecting to the other ", size_ - 1, " ranks failed: ", e.what());
        }
        agree_on_cost_model(*config.store);
        if (calibrate_ && size_ > 2) calibrate(context, *config.store, config.timeout);
        context_ = std::move(context);
        done->set_value();
      } catch (...) {
        // Tell the other ranks, which are waiting for this rank's address (store_adapter.h).
        try {
          throw;
        } catch (const std::exception& e) {
          try {
            config.store->set(detail::GlooStoreAdapter::kAbortKey, std::string(e.what()));
          } catch (...) {
          }
        }
        done->set_exception(std::current_exception());
      }
    });
    done->get_future().get();
  }

  // Queues `body` to run with the context on the communication thread, then finish `work`.
  void run(const WorkPtr& work, std::chrono::milliseconds timeout,
           std::function<void(const std::shared_ptr<gloo::Context>&)> body) {
    work_set_wait_hook(*work, [self = weak_from_this()](const Work& w) {
      if (auto impl = self.lock()) impl->help(w);
    });
    post([this, work, timeout, body = std::move(body)] {
      if (!context_) return work_refuse(*work, who_, broken_);  // Note [Poisoned group]
      try {
        work_start(*work);
        body(context_);
      } catch (const detail::CallMismatch& e) {
        // Every rank saw the same signatures and none sent data: the group goes on
        // (Note [Gloo signature check]).
        work_finish(*work, std::make_exception_ptr(
                               Error(lockstep::detail::str_cat(who_, ": ", work->description(),
                                                               " failed: ", e.message()),
                                     __FILE__, __LINE__)));
        return;
      } catch (...) {
        std::string what = "unknown exception";
        try {
          throw;
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        const std::string reason = explain(what, timeout);
        broken_ = work->description() + ": " + reason;
        // Closing every connection makes the peers' collectives fail now rather than at their
        // own timeouts, and no later collective can run on a stream in an unknown state.
        context_.reset();
        work_finish(
            *work,
            std::make_exception_ptr(Error(
                lockstep::detail::str_cat(who_, ": ", work->description(), " failed: ", reason),
                __FILE__, __LINE__)));
        return;
      }
      work_finish(*work);
    });
  }

  const std::string& address() const { return address_; }

  const LinkModel& link() const { return link_; }

  // The cost model's choice (Note [Cost model] in src/distributed/cost_model.cpp) or the
  // setting's, from rank 0's link and setting: every rank chooses alike.
  AllReduceAlgorithm all_reduce_algorithm(int64_t bytes) const {
    return gloo_all_reduce_algorithm(bytes, size_, link_, algorithm_);
  }

  // Counts an all_reduce that ran with `a`; read from any thread.
  void count_all_reduce(AllReduceAlgorithm a) {
    (a == AllReduceAlgorithm::kWhole ? whole_calls_ : direct_calls_)
        .fetch_add(1, std::memory_order_relaxed);
  }
  ProcessGroupGloo::AllReduceCounts all_reduce_counts() const {
    return {whole_calls_.load(std::memory_order_relaxed),
            direct_calls_.load(std::memory_order_relaxed)};
  }

  // What a rank-order collective receives into (Note [Gloo rank-order reduction]); used by
  // whichever thread holds exec_mu_, as the context is.
  std::vector<uint8_t>& scratch() { return scratch_; }

 private:
  // Every rank must choose the same algorithm for a call, or their messages would not match:
  // all take rank 0's link model and settings (calibration included: every rank must take part
  // in it or none), published through the group's store.
  void agree_on_cost_model(Store& store) {
    static const std::string kKey = "lockstep/cost_model";
    if (rank_ == 0) {
      char text[96];
      std::snprintf(text, sizeof(text), "%.17g %.17g %d %d", link_.alpha, link_.beta,
                    static_cast<int>(algorithm_), calibrate_ ? 1 : 0);
      store.set(kKey, std::string_view(text));
      return;
    }
    const std::string text = store.get_string(kKey);
    int algorithm = 0, calibrate = 0;
    LS_CHECK(std::sscanf(text.c_str(), "%lf %lf %d %d", &link_.alpha, &link_.beta, &algorithm,
                         &calibrate) == 4,
             who_, ": rank 0's cost model settings are unreadable: '", text,
             "'; expected alpha, beta, algorithm and calibration");
    algorithm_ = static_cast<AlgorithmSetting>(algorithm);
    calibrate_ = calibrate != 0;
  }

  // Note [Link calibration]
  // The link settings (LOCKSTEP_NET_ALPHA_US, LOCKSTEP_NET_GBPS) are guesses unless someone ran
  // bench/net_allreduce. With LOCKSTEP_NET_CALIBRATE=1 a group measures instead, once, right
  // after it connects: direct all_reduces of 4 KiB and of 1 MiB, each with its signature
  // exchange as a real call has, so that the fit counts the rounds the model counts (Note [Cost
  // model] in src/distributed/cost_model.cpp). Each size's time is the median of
  // kCalibrationReps calls, the slowest rank's (a collective waits for it), so every rank holds
  // the same numbers and takes the same steps.
  // Where a round costs milliseconds (a loaded machine's wake-ups), 1 MiB can take no longer
  // than 4 KiB and beta would fit to 0: the large size then grows fourfold, up to 64 MiB, until
  // it takes kCalibrationSpread times the small one. On a real network 1 MiB already suffices;
  // on the loopback of a loaded two-core machine the whole calibration took 0.15 to 0.5 s.
  // fit_link fits the two medians. Rank 0's fit is published through the store and every rank
  // takes it, so that the ranks never choose apart. A fit that is not positive and finite is
  // dropped with a warning and the settings' link kept. Two ranks skip all of this: they always
  // send whole tensors, so no link would change their choice.
  static constexpr int64_t kCalibrationSmall = 4 << 10;
  static constexpr int64_t kCalibrationLarge = 1 << 20;
  static constexpr int64_t kCalibrationLargest = 64 << 20;
  static constexpr double kCalibrationSpread = 2;
  static constexpr int kCalibrationWarmups = 1;
  static constexpr int kCalibrationReps = 5;
  // Tags of the calibration's calls: far above any sequence number a group reaches.
  static constexpr uint32_t kCalibrationTag = 0xFFFF0000u;

  // The median time of kCalibrationReps direct all_reduces of `bytes`, the slowest rank's.
  double time_all_reduce(const std::shared_ptr<gloo::Context>& ctx, int64_t bytes, uint32_t& tag,
                         std::chrono::milliseconds timeout) {
    Tensor t = zeros({bytes / 4});  // (bytes / 4) f32
    const auto sig = detail::signature(detail::CallKind::all_reduce, &t, ReduceOp::sum);
    std::vector<double> seconds;
    for (int i = 0; i < kCalibrationWarmups + kCalibrationReps; ++i, ++tag) {
      const auto t0 = Clock::now();
      detail::check_signatures(ctx, sig, tag, timeout);
      detail::rank_order_all_reduce(ctx, t.data_ptr(), static_cast<size_t>(t.numel()), t.dtype(),
                                    ReduceOp::sum, /*whole=*/false, tag, timeout, scratch_);
      if (i >= kCalibrationWarmups) {
        seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
    }
    std::sort(seconds.begin(), seconds.end());
    double median = seconds[seconds.size() / 2];
    detail::rank_order_all_reduce(ctx, &median, 1, kFloat64, ReduceOp::max, /*whole=*/true, tag++,
                                  timeout, scratch_);
    return median;
  }

  void calibrate(const std::shared_ptr<gloo::Context>& ctx, Store& store,
                 std::chrono::milliseconds timeout) {
    const auto started = Clock::now();
    uint32_t tag = kCalibrationTag;
    const LinkSample small{kCalibrationSmall, time_all_reduce(ctx, kCalibrationSmall, tag, timeout),
                           AllReduceAlgorithm::kDirect};
    LinkSample large{kCalibrationLarge, time_all_reduce(ctx, kCalibrationLarge, tag, timeout),
                     AllReduceAlgorithm::kDirect};
    while (large.seconds < kCalibrationSpread * small.seconds &&
           large.bytes < kCalibrationLargest) {
      large.bytes *= 4;
      large.seconds = time_all_reduce(ctx, large.bytes, tag, timeout);
    }
    const std::vector<LinkSample> samples = {small, large};
    static const std::string kKey = "lockstep/cost_model/calibrated";
    if (rank_ != 0) {
      const std::string text = store.get_string(kKey);
      LS_CHECK(std::sscanf(text.c_str(), "%lf %lf", &link_.alpha, &link_.beta) == 2, who_,
               ": rank 0's calibrated link is unreadable: '", text, "'; expected alpha and beta");
      return;
    }
    const LinkModel fit = fit_link(size_, samples);
    const bool usable =
        std::isfinite(fit.alpha) && std::isfinite(fit.beta) && fit.alpha > 0 && fit.beta > 0;
    const std::string measured = lockstep::detail::str_cat(
        "all_reduce of ", samples[0].bytes, " bytes took ", samples[0].seconds * 1e6, " us, of ",
        samples[1].bytes, " bytes ", samples[1].seconds * 1e6, " us (direct, the median of ",
        kCalibrationReps, " calls on the slowest rank; ",
        std::chrono::duration<double>(Clock::now() - started).count() * 1e3, " ms in all)");
    if (usable) {
      link_ = fit;
      log_info(who_, ": ", env::kNetCalibrate, "=1: ", measured, "; the cost model uses alpha ",
               fit.alpha * 1e6, " us, ", 8 / fit.beta / 1e9, " Gbit/s");
    } else {
      log_warning(who_, ": ", env::kNetCalibrate, "=1: ", measured, "; the fit (alpha ",
                  fit.alpha * 1e6, " us, beta ", fit.beta * 1e9,
                  " ns/byte) is not positive, so the cost model keeps alpha ", link_.alpha * 1e6,
                  " us, ", 8 / link_.beta / 1e9, " Gbit/s");
    }
    char text[64];
    std::snprintf(text, sizeof(text), "%.17g %.17g", link_.alpha, link_.beta);
    store.set(kKey, std::string_view(text));
  }

  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({std::move(task), std::chrono::steady_clock::now()});
    }
    cv_.notify_one();
  }

  void loop() {
    block_sigpipe_on_this_thread();
    for (;;) {
      {
        // While a waiting caller runs the queue itself, stay asleep: waking only to block on
        // exec_mu_ would cost two wake-ups per collective on a busy machine.
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
          if (queue_.empty()) {
            if (stop_) break;
            cv_.wait(lock);
          } else if (caller_running_ && !stop_) {
            cv_.wait(lock);
          } else if (const auto due = queue_.front().posted + kCallerGrace;
                     !stop_ && std::chrono::steady_clock::now() < due) {
            cv_.wait_until(lock, due);
          } else {
            break;
          }
        }
        if (queue_.empty()) break;  // stop_ and nothing left to run
      }
      std::lock_guard<std::mutex> exec(exec_mu_);
      if (auto task = pop()) task();  // a waiting caller may have run it already
    }
    // Gloo's objects are created and destroyed on this thread only.
    std::lock_guard<std::mutex> exec(exec_mu_);
    context_.reset();
    device_.reset();
  }

  void set_caller_running(bool running) {
    bool more = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      caller_running_ = running;
      more = !queue_.empty();
    }
    if (!running && more) cv_.notify_one();  // what the caller left is the thread's again
  }

  // The next queued task, or an empty function. Callers hold exec_mu_, so that tasks start in
  // queue order whichever thread runs them.
  std::function<void()> pop() {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.empty()) return {};
    std::function<void()> task = std::move(queue_.front().fn);
    queue_.pop_front();
    return task;
  }

 public:
  // Note [Caller runs]
  // all_reduce(x)->wait() would cost two thread hand-offs per collective (to the communication
  // thread and back), each a wake-up that takes hundreds of microseconds on a virtual machine.
  // When a caller waits and the communication thread is not running a collective, the caller
  // runs the queued collectives itself, in queue order, until its own has completed; Gloo then
  // wakes the caller directly, as it would with raw Gloo calls. exec_mu_ makes one thread at a
  // time use the context. The communication thread leaves a new collective alone for
  // kCallerGrace, the window in which a caller that waits at once claims it; without that window
  // the thread, woken by the previous collective, keeps winning the race for the next one.
  void help(const Work& work) {
    std::unique_lock<std::mutex> exec(exec_mu_, std::try_to_lock);
    if (!exec.owns_lock()) return;  // the communication thread is busy: let it finish
    struct CallerRunning {
      Impl& impl;
      explicit CallerRunning(Impl& i) : impl(i) { impl.set_caller_running(true); }
      ~CallerRunning() { impl.set_caller_running(false); }
    } running(*this);
    SigpipeBlocked no_sigpipe;
    while (!work.is_completed()) {
      auto task = pop();
      if (!task) break;
      task();
    }
  }

 private:
  const std::string who_;
  const int rank_;
  const int size_;
  // Used by whichever thread holds exec_mu_.
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  std::string broken_;
  std::string address_;
  std::vector<uint8_t> scratch_;
  LinkModel link_;
  AlgorithmSetting algorithm_ = AlgorithmSetting::kAuto;
  bool calibrate_ = false;  // LOCKSTEP_NET_CALIBRATE, rank 0's (Note [Link calibration])
  std::atomic<int64_t> whole_calls_{0};
  std::atomic<int64_t> direct_calls_{0};

  std::mutex exec_mu_;  // held while a task runs (Note [Caller runs])
  std::mutex mu_;       // guards the queue
  std::condition_variable cv_;
  struct Task {
    std::function<void()> fn;
    std::chrono::steady_clock::time_point posted;
  };
  std::deque<Task> queue_;
  bool stop_ = false;
  bool caller_running_ = false;  // a waiting caller runs the queue (Note [Caller runs])
  std::thread thread_;           // last: starts once everything above exists
};

void register_gloo_backend() {
  register_backend("gloo", [](const BackendConfig& config) -> ProcessGroupPtr {
    return std::make_shared<ProcessGroupGloo>(config);
  });
}

ProcessGroupGloo::ProcessGroupGloo(const BackendConfig& config)
    : ProcessGroup(config.rank, config.size, config.timeout) {
  LS_CHECK(config.store != nullptr, who(), ": a store to rendezvous through is required");
  impl_ = std::make_shared<Impl>(who(), rank(), size());
  impl_->connect(config);
}

ProcessGroupGloo::~ProcessGroupGloo() {
  if (impl_) impl_->shutdown();
}

const std::string& ProcessGroupGloo::address() const { return impl_->address(); }

const LinkModel& ProcessGroupGloo::link() const { return impl_->link(); }

AllReduceAlgorithm ProcessGroupGloo::all_reduce_algorithm(int64_t bytes) const {
  return impl_->all_reduce_algorithm(bytes);
}

ProcessGroupGloo::AllReduceCounts ProcessGroupGloo::all_reduce_counts() const {
  return impl_->all_reduce_counts();
}

void ProcessGroupGloo::do_all_reduce(Tensor tensor, ReduceOp op, std::chrono::milliseconds timeout,
                                     const WorkPtr& work) {
  const auto tag = static_cast<uint32_t>(work->seq());
  Impl* impl = impl_.get();  // outlives the task: ~Impl runs the queue before it ends
  const AllReduceAlgorithm algorithm = impl->all_reduce_algorithm(tensor.nbytes());
  impl->run(work, timeout,
            [tensor, op, timeout, tag, impl, algorithm](const std::shared_ptr<gloo::Context>& ctx) {
              const auto deadline = Clock::now() + timeout;
              detail::check_signatures(
                  ctx, detail::signature(detail::CallKind::all_reduce, &tensor, op), tag, timeout);
              // Rank order, as the shm backend and this backend's reduce_scatter add (Note [Gloo
              // rank-order reduction]); avg divides inside.
              detail::rank_order_all_reduce(ctx, tensor.data_ptr(),
                                            static_cast<size_t>(tensor.numel()), tensor.dtype(), op,
                                            algorithm == AllReduceAlgorithm::kWhole, tag,
                                            detail::time_left(deadline), impl->scratch());
              impl->count_all_reduce(algorithm);
            });
}

void ProcessGroupGloo::do_broadcast(Tensor tensor, int root, std::chrono::milliseconds timeout,
                                    const WorkPtr& work) {
  const auto tag = static_cast<uint32_t>(work->seq());
  impl_->run(
      work, timeout, [tensor, root, timeout, tag](const std::shared_ptr<gloo::Context>& ctx) {
        const auto deadline = Clock::now() + timeout;
        detail::check_signatures(
            ctx, detail::signature(detail::CallKind::broadcast, &tensor, ReduceOp::sum, root), tag,
            timeout);
        if (tensor.numel() == 0) return;
        gloo::BroadcastOptions o(ctx);
        o.setOutput(static_cast<uint8_t*>(tensor.data_ptr()), static_cast<size_t>(tensor.nbytes()));
        o.setRoot(root);
        o.setTag(tag);
        o.setTimeout(detail::time_left(deadline));
        gloo::broadcast(o);
      });
}

void ProcessGroupGloo::do_all_gather(Tensor output, Tensor input, std::chrono::milliseconds timeout,
                                     const WorkPtr& work) {
  const auto tag = static_cast<uint32_t>(work->seq());
  impl_->run(
      work, timeout, [output, input, timeout, tag](const std::shared_ptr<gloo::Context>& ctx) {
        const auto deadline = Clock::now() + timeout;
        detail::check_signatures(ctx, detail::signature(detail::CallKind::all_gather, &input), tag,
                                 timeout);
        if (input.numel() == 0) return;
        gloo::AllgatherOptions o(ctx);
        o.setInput(static_cast<uint8_t*>(input.data_ptr()), static_cast<size_t>(input.nbytes()));
        o.setOutput(static_cast<uint8_t*>(output.data_ptr()), static_cast<size_t>(output.nbytes()));
        o.setTag(tag);
        o.setTimeout(detail::time_left(deadline));
        gloo::allgather(o);
      });
}

// Direct, in rank order, over Gloo's point-to-point transport (Note [Gloo rank-order reduction]
// in p2p.cpp): each rank sends and receives size - 1 chunks, half the bytes of an all_reduce.
void ProcessGroupGloo::do_reduce_scatter(Tensor output, Tensor input, ReduceOp op,
                                         std::chrono::milliseconds timeout, const WorkPtr& work) {
  const auto tag = static_cast<uint32_t>(work->seq());
  auto* scratch = &impl_->scratch();
  impl_->run(
      work, timeout,
      [output, input, op, timeout, tag, scratch](const std::shared_ptr<gloo::Context>& ctx) {
        const auto deadline = Clock::now() + timeout;
        detail::check_signatures(
            ctx, detail::signature(detail::CallKind::reduce_scatter, &output, op), tag, timeout);
        detail::rank_order_reduce_scatter(ctx, output.data_ptr(), input.data_ptr(),
                                          static_cast<size_t>(output.numel()), output.dtype(), op,
                                          tag, detail::time_left(deadline), *scratch);
      });
}

// The signature exchange is a barrier already: each rank hears from every other rank before it
// returns (Note [Gloo signature check]).
void ProcessGroupGloo::do_barrier(std::chrono::milliseconds timeout, const WorkPtr& work) {
  const auto tag = static_cast<uint32_t>(work->seq());
  impl_->run(work, timeout, [timeout, tag](const std::shared_ptr<gloo::Context>& ctx) {
    detail::check_signatures(ctx, detail::signature(detail::CallKind::barrier, nullptr), tag,
                             timeout);
  });
}

}  // namespace lockstep::dist
