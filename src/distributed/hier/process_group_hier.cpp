// ProcessGroupHier: an shm group inside each machine composed with Gloo groups across machines.
#include "lockstep/distributed/hier/process_group_hier.h"

#include <algorithm>
#include <cstring>
#include <mutex>

#include "distributed/deadline.h"
#include "distributed/gloo/reduce.h"
#include "distributed/hier/register.h"
#include "distributed/machine.h"
#include "lockstep/base/error.h"
#include "lockstep/distributed/gloo/process_group_gloo.h"
#include "lockstep/distributed/shm/process_group_shm.h"
#include "lockstep/distributed/store/prefix_store.h"

namespace lockstep::dist {

namespace {

using Clock = std::chrono::steady_clock;
using lockstep::detail::str_cat;

// The layout `lockstep run` gives, or an Error saying what was found instead.
detail::MachineLayout checked_layout(const std::vector<std::string>& identity,
                                     const std::string& who) {
  const detail::MachineLayout l = detail::machine_layout(identity);
  if (!l.regular) {
    LS_THROW(who, ": the hier backend needs the same number of ranks on every machine, the ranks ",
             "of a machine contiguous (as `lockstep run` assigns them); found ", l.machines,
             " machines for ", identity.size(), " ranks: ", l.found,
             ". Start the job with `lockstep run`, or use the gloo backend");
  }
  return l;
}

Tensor flat(const Tensor& t) { return t.view({t.numel()}); }

// out[b * rows + a] = in[a * cols + b] for blocks of `block` bytes: the transpose of a
// rows x cols matrix of blocks.
void transpose_blocks(const Tensor& out, const Tensor& in, int rows, int cols, size_t block) {
  const auto* src = static_cast<const uint8_t*>(in.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  for (int a = 0; a < rows; ++a)
    for (int b = 0; b < cols; ++b)
      std::memcpy(dst + (static_cast<size_t>(b) * rows + a) * block,
                  src + (static_cast<size_t>(a) * cols + b) * block, block);
}

}  // namespace

void register_hier_backend() {
  register_backend("hier", [](const BackendConfig& config) -> ProcessGroupPtr {
    return std::make_shared<ProcessGroupHier>(config);
  });
}

class ProcessGroupHier::Impl {
 public:
  Impl(const BackendConfig& config, const HierOptions& options, const std::string& who)
      : who_(who) {
    const std::string mine = options.machine_identity_for_testing.empty()
                                 ? detail::machine_identity()
                                 : options.machine_identity_for_testing;
    layout_ = checked_layout(detail::exchange_machine_identities(
                                 *config.store, "hier/machine/", config.rank, config.size, mine,
                                 config.timeout, who_ + ": building the hier group"),
                             who_);
    machine_ = config.rank / layout_.local_size;
    local_rank_ = config.rank % layout_.local_size;

    // The machine's ranks first, then local rank i of every machine: each rank builds its shm
    // group before its Gloo one, and a Gloo group's members have all finished their own
    // machine's, so no rank waits on one that waits on it.
    local_ = make_group(config, "shm", str_cat("hier/local/", machine_, "/"), local_rank_,
                        layout_.local_size);
    cross_ = make_group(config, "gloo", str_cat("hier/cross/", local_rank_, "/"), machine_,
                        layout_.machines);
  }

  // Runs one collective: fails at once when the group is poisoned, and poisons it on failure
  // (Note [Poisoned group]).
  template <class Fn>
  void run(const WorkPtr& work, Fn&& fn) {
    std::string poisoned;
    {
      std::lock_guard<std::mutex> lock(mu_);
      poisoned = poisoned_;
    }
    if (!poisoned.empty()) return work_refuse(*work, who_, poisoned);
    std::exception_ptr error;
    try {
      work_start(*work);
      fn();
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu_);
      if (poisoned_.empty()) poisoned_ = e.what();
      error = std::make_exception_ptr(Error(
          str_cat(who_, ": ", work->description(), " failed: ", e.what()), __FILE__, __LINE__));
    }
    work_finish(*work, error);
  }

  void all_reduce(const Tensor& tensor, ReduceOp op, std::chrono::milliseconds timeout);
  void broadcast(const Tensor& tensor, int root, std::chrono::milliseconds timeout);
  void all_gather(const Tensor& output, const Tensor& input, std::chrono::milliseconds timeout);
  void reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op,
                      std::chrono::milliseconds timeout);
  void barrier(std::chrono::milliseconds timeout);
  void check_same_numel(int64_t n, Clock::time_point deadline);

  int machines() const { return layout_.machines; }
  int local_size() const { return layout_.local_size; }
  int world() const { return layout_.machines * layout_.local_size; }

 private:
  static ProcessGroupPtr make_group(const BackendConfig& config, const char* backend,
                                    const std::string& prefix, int rank, int size) {
    if (size == 1) return std::make_shared<WorldOfOneGroup>(config.timeout);
    BackendConfig c = config;
    c.store = std::make_shared<PrefixStore>(prefix, config.store);
    c.rank = rank;
    c.size = size;
    if (std::string(backend) == "shm") return std::make_shared<ProcessGroupShm>(c);
    return std::make_shared<ProcessGroupGloo>(c);
  }

  const std::string who_;
  detail::MachineLayout layout_;
  int machine_ = 0;
  int local_rank_ = 0;
  ProcessGroupPtr local_;  // this machine's ranks (shm)
  ProcessGroupPtr cross_;  // local rank local_rank_ of every machine (gloo)
  std::mutex mu_;
  std::string poisoned_;  // the first failure
};

// Note [Hierarchical all_reduce]
// With L ranks per machine the tensor is cut into L shards of ceil(n / L) elements (padded with
// zeros when L does not divide n; the padding is reduced along and dropped). The shm
// reduce_scatter leaves local rank i the machine's reduction of shard i; local rank i of every
// machine then all-reduces that shard over Gloo, so each byte crosses the network once per
// machine rather than once per rank; the shm all_gather gives every rank every shard. avg runs as
// sum on both levels and is divided once by the world size at the end, in the dtype's
// arithmetic, as the Gloo backend divides. The sum's order differs from a flat Gloo group's, so
// floating-point sums agree with it within rounding (exactly when the partial sums are exact),
// and are identical on every rank since every rank receives the same shards.
void ProcessGroupHier::Impl::all_reduce(const Tensor& tensor, ReduceOp op,
                                        std::chrono::milliseconds timeout) {
  const int64_t n = tensor.numel();
  if (n == 0) return;
  const auto deadline = Clock::now() + timeout;
  const ReduceOp level_op = op == ReduceOp::avg ? ReduceOp::sum : op;
  const int64_t L = local_size();
  const int64_t shard = (n + L - 1) / L;
  Tensor whole = flat(tensor);
  if (shard * L != n) {
    check_same_numel(n, deadline);
    whole = zeros({shard * L}, tensor.dtype());
    std::memcpy(whole.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.nbytes()));
  }
  Tensor mine = empty({shard}, tensor.dtype());
  local_->reduce_scatter(mine, whole, {.op = level_op, .timeout = detail::time_left(deadline)})
      ->wait();
  cross_->all_reduce(mine, {.op = level_op, .timeout = detail::time_left(deadline)})->wait();
  local_->all_gather(whole, mine, {.timeout = detail::time_left(deadline)})->wait();
  if (whole.data_ptr() != tensor.data_ptr()) {
    std::memcpy(tensor.data_ptr(), whole.data_ptr(), static_cast<size_t>(tensor.nbytes()));
  }
  if (op == ReduceOp::avg) {
    dist::detail::divide_in_place(tensor.data_ptr(), tensor.dtype(), static_cast<size_t>(n),
                                  world());
  }
}

// Padding hides a size mismatch from the sub-groups' own checks (7 and 8 elements both make
// shards of 4 on 2 local ranks), so a padded all_reduce first compares the sizes, through
// collectives of 2 elements that never pad.
void ProcessGroupHier::Impl::check_same_numel(int64_t n, Clock::time_point deadline) {
  Tensor range = from_vector(std::vector<int64_t>{n, -n}, {2});
  local_->all_reduce(range, {.op = ReduceOp::max, .timeout = detail::time_left(deadline)})->wait();
  cross_->all_reduce(range, {.op = ReduceOp::max, .timeout = detail::time_left(deadline)})->wait();
  const auto v = range.to_vector<int64_t>();
  LS_CHECK(v[0] == n && -v[1] == n, who_, ": all_reduce of ", n,
           " elements here, but the ranks' sizes range from ", -v[1], " to ", v[0],
           "; every rank must pass the same number of elements");
}

// Root's peers of the same local rank receive it across machines, then every machine spreads
// it from that local rank.
void ProcessGroupHier::Impl::broadcast(const Tensor& tensor, int root,
                                       std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  const int root_machine = root / local_size();
  const int root_local = root % local_size();
  if (local_rank_ == root_local) {
    cross_->broadcast(tensor, {.root = root_machine, .timeout = detail::time_left(deadline)})
        ->wait();
  }
  local_->broadcast(tensor, {.root = root_local, .timeout = detail::time_left(deadline)})->wait();
}

// Across machines first (each rank's input crosses the network once), then inside the machine;
// the result arrives grouped by local rank ([L][M] blocks) and is reordered into rank order
// ([M][L]).
void ProcessGroupHier::Impl::all_gather(const Tensor& output, const Tensor& input,
                                        std::chrono::milliseconds timeout) {
  const int64_t n = input.numel();
  if (n == 0) return;
  const auto deadline = Clock::now() + timeout;
  const int M = machines();
  const int L = local_size();
  Tensor across = empty({M * n}, input.dtype());
  cross_->all_gather(across, flat(input), {.timeout = detail::time_left(deadline)})->wait();
  const bool reorder = M > 1 && L > 1;
  Tensor gathered = reorder ? empty({world() * n}, input.dtype()) : flat(output);
  local_->all_gather(gathered, across, {.timeout = detail::time_left(deadline)})->wait();
  if (reorder) {
    transpose_blocks(flat(output), gathered, L, M, static_cast<size_t>(input.nbytes()));
  }
}

// Chunk m * L + i ends on rank (m, i). The input is reordered so that local rank i's part of the
// shm reduce_scatter holds the chunks of every machine's rank i ([L][M] blocks); the machine's
// reduction of them is then reduce-scattered across machines by the Gloo backend's direct
// reduce-scatter (Note [Gloo rank-order reduction]): a real reduce-scatter on both levels.
void ProcessGroupHier::Impl::reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op,
                                            std::chrono::milliseconds timeout) {
  const int64_t n = output.numel();
  if (n == 0) return;
  const auto deadline = Clock::now() + timeout;
  const ReduceOp level_op = op == ReduceOp::avg ? ReduceOp::sum : op;
  const int M = machines();
  const int L = local_size();
  Tensor arranged = flat(input);
  if (M > 1 && L > 1) {
    arranged = empty({world() * n}, input.dtype());
    transpose_blocks(arranged, flat(input), M, L, static_cast<size_t>(output.nbytes()));
  }
  Tensor machine_sum = empty({M * n}, input.dtype());
  local_
      ->reduce_scatter(machine_sum, arranged,
                       {.op = level_op, .timeout = detail::time_left(deadline)})
      ->wait();
  cross_
      ->reduce_scatter(flat(output), machine_sum,
                       {.op = level_op, .timeout = detail::time_left(deadline)})
      ->wait();
  if (op == ReduceOp::avg) {
    dist::detail::divide_in_place(output.data_ptr(), output.dtype(), static_cast<size_t>(n),
                                  world());
  }
}

// Once the machine's ranks all arrived, local rank i meets local rank i of every machine: after
// that every rank knows that every rank arrived.
void ProcessGroupHier::Impl::barrier(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  local_->barrier({.timeout = detail::time_left(deadline)})->wait();
  cross_->barrier({.timeout = detail::time_left(deadline)})->wait();
}

ProcessGroupHier::ProcessGroupHier(const BackendConfig& config, const HierOptions& options)
    : ProcessGroup(config.rank, config.size, config.timeout) {
  LS_CHECK(config.store != nullptr, who(), ": a store to rendezvous through is required");
  impl_ = std::make_unique<Impl>(config, options, who());
}

ProcessGroupHier::~ProcessGroupHier() = default;

int ProcessGroupHier::num_machines() const { return impl_->machines(); }
int ProcessGroupHier::local_size() const { return impl_->local_size(); }

void ProcessGroupHier::do_all_reduce(Tensor tensor, ReduceOp op, std::chrono::milliseconds timeout,
                                     const WorkPtr& work) {
  impl_->run(work, [&] { impl_->all_reduce(tensor, op, timeout); });
}
void ProcessGroupHier::do_broadcast(Tensor tensor, int root, std::chrono::milliseconds timeout,
                                    const WorkPtr& work) {
  impl_->run(work, [&] { impl_->broadcast(tensor, root, timeout); });
}
void ProcessGroupHier::do_all_gather(Tensor output, Tensor input, std::chrono::milliseconds timeout,
                                     const WorkPtr& work) {
  impl_->run(work, [&] { impl_->all_gather(output, input, timeout); });
}
void ProcessGroupHier::do_reduce_scatter(Tensor output, Tensor input, ReduceOp op,
                                         std::chrono::milliseconds timeout, const WorkPtr& work) {
  impl_->run(work, [&] { impl_->reduce_scatter(output, input, op, timeout); });
}
void ProcessGroupHier::do_barrier(std::chrono::milliseconds timeout, const WorkPtr& work) {
  impl_->run(work, [&] { impl_->barrier(timeout); });
}

}  // namespace lockstep::dist
