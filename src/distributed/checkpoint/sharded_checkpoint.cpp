// Sharded checkpoints across ranks: the collective save, the background saver whose commit goes
// through the file system, rank 0's choice of what to resume, the collective load.
#include "lockstep/distributed/sharded_checkpoint.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <filesystem>
#include <thread>

#include "distributed/checkpoint/agree.h"
#include "distributed/checkpoint/resume_choice.h"
#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/log.h"

namespace lockstep::dist {

namespace {

// Note [Background save priority]
// The writer runs at SCHED_IDLE (else at nice 19): it takes a core only when training leaves one
// idle. Writing a shard is CPU work too (the SHA-256, the copies into the page cache), and on a
// machine whose cores the ranks' compute fills (measured on the 2-core VM: bench/sharded_save)
// a writer at the training's priority took that time out of the steps; idle, it fills the gaps
// (data loading, communication waits) and the save takes longer instead. Best effort: a failure
// to lower it leaves the writer as it was.
void yield_to_training() {
  sched_param param{};
  param.sched_priority = 0;
  if (::pthread_setschedparam(::pthread_self(), SCHED_IDLE, &param) == 0) return;
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
}

}  // namespace

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

void remove_quietly(const std::string& dir) {
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// Rank 0's steps 2 and 3 of Note [Sharded checkpoint], and the pruning.
void index_and_commit(const std::string& tmp, const std::string& dir, int world,
                      const io::TrainingCheckpoint& meta, int64_t keep,
                      const std::vector<std::string>& spare) {
  io::write_sharded_index(tmp, world, meta);
  io::commit_sharded_checkpoint(tmp, dir);
  io::prune_sharded_checkpoints(dir, keep, spare);
}

// A copy of the slices that training can no longer change: host memory of the saver's own.
std::vector<io::TensorSlice> snapshot(const std::vector<io::TensorSlice>& slices) {
  autograd::NoGradGuard no_grad;
  std::vector<io::TensorSlice> out;
  out.reserve(slices.size());
  for (const io::TensorSlice& s : slices) {
    LS_CHECK(s.data.defined(), "AsyncShardedSaver: the slice of '", s.name, "' at ", s.start,
             " has no data");
    Tensor copy;
    if (s.data.device().is_cpu()) {
      copy = empty(s.data.shape(), s.data.dtype());
      copy.copy_(s.data);
    } else {
      copy = s.data.to(kCPU).contiguous();  // a new host tensor already
    }
    out.push_back({s.name, s.shape, s.start, std::move(copy)});
  }
  return out;
}

}  // namespace

void save_sharded_checkpoint(ProcessGroup& pg, const std::string& dir,
                             const std::vector<io::TensorSlice>& slices,
                             const io::TrainingCheckpoint& meta, int64_t keep,
                             const std::vector<std::string>& spare) {
  const int rank = pg.rank(), world = pg.size();
  const std::string token = broadcast_text(pg, rank == 0 ? io::new_sharded_token() : "");
  const std::string tmp = io::sharded_temp_dir(dir, token);
  const std::string what = "save_sharded_checkpoint " + dir;
  // Step 1 on every rank; the all-gather of errors is the barrier before rank 0's index.
  const std::string error =
      failure_of([&] { io::write_checkpoint_shard(tmp, rank, world, slices); });
  const std::vector<std::string> all = all_gather_text(pg, error);
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    if (rank == 0) remove_quietly(tmp);
    LS_THROW(what, " failed on rank ", r, ": ", all[r]);
  }
  std::string status;
  if (rank == 0) {
    status = failure_of([&] { index_and_commit(tmp, dir, world, meta, keep, spare); });
    if (!status.empty()) remove_quietly(tmp);
  }
  // The broadcast is the end of the save: every rank returns once `dir` is committed.
  status = broadcast_text(pg, status);
  LS_CHECK(status.empty(), what, " failed on rank 0: ", status);
}

struct AsyncShardedSaver::State {
  std::thread worker;
  std::atomic<bool> running{false};
  std::string error;     // written by the worker, read after joining it
  std::string last_dir;  // of the save in flight, for messages
};

AsyncShardedSaver::AsyncShardedSaver(ProcessGroup& pg, AsyncSaveOptions opts)
    : pg_(pg), opts_(std::move(opts)), state_(std::make_unique<State>()) {}

AsyncShardedSaver::~AsyncShardedSaver() {
  try {
    const std::string error = join();
    if (!error.empty())
      log_error("AsyncShardedSaver: the save of ", state_->last_dir, " failed: ", error);
  } catch (...) {
    // A destructor never throws.
  }
}

std::string AsyncShardedSaver::join() {
  if (state_->worker.joinable()) state_->worker.join();
  return std::exchange(state_->error, "");
}

bool AsyncShardedSaver::busy() const { return state_->running.load(); }

void AsyncShardedSaver::save(const std::string& dir, const std::vector<io::TensorSlice>& slices,
                             const io::TrainingCheckpoint& meta) {
  const int rank = pg_.rank(), world = pg_.size();
  // One all-gather: every rank's verdict on the previous save and rank 0's token for this one.
  json mine = {{"error", join()}, {"token", rank == 0 ? io::new_sharded_token() : ""}};
  const std::vector<std::string> all = all_gather_text(pg_, mine.dump());
  std::string token;
  for (size_t r = 0; r < all.size(); ++r) {
    const json theirs = json::parse(all[r]);
    if (r == 0) token = theirs.at("token").get<std::string>();
    LS_CHECK(theirs.at("error").get<std::string>().empty(), "AsyncShardedSaver: the save of ",
             state_->last_dir, " failed on rank ", r, ": ", theirs.at("error").get<std::string>());
  }
  state_->last_dir = dir;
  const std::string tmp = io::sharded_temp_dir(dir, token);
  std::vector<io::TensorSlice> copy;
  try {
    copy = snapshot(slices);
  } catch (const std::exception& e) {
    io::write_checkpoint_shard_failure(tmp, rank, world, e.what());  // rank 0 fails at once
    throw;
  }
  state_->running = true;
  state_->worker = std::thread([this, tmp, dir, rank, world, meta, copy = std::move(copy)] {
    yield_to_training();
    // Note [Sharded checkpoint]: nothing here touches the process group.
    state_->error = failure_of([&] {
      try {
        io::write_checkpoint_shard(tmp, rank, world, copy);
      } catch (const std::exception& e) {
        io::write_checkpoint_shard_failure(tmp, rank, world, e.what());
        throw;
      }
      if (rank == 0) {
        io::wait_for_checkpoint_shards(tmp, world, opts_.commit_timeout);
        index_and_commit(tmp, dir, world, meta, opts_.keep, opts_.spare);
      }
    });
    state_->running = false;
  });
}

void AsyncShardedSaver::wait() {
  agree(pg_, "AsyncShardedSaver: the save of " + state_->last_dir, join());
}

io::CheckpointChoice resolve_sharded_resume(ProcessGroup& pg, const std::string& resume,
                                            const std::string& base) {
  ResumeSearch search;
  search.what = "sharded checkpoint";
  search.latest_valid = io::latest_valid_sharded_checkpoint;
  search.explicit_problem = [](const std::string& path) -> std::string {
    return io::is_sharded_checkpoint(path)
               ? ""
               : "no such sharded checkpoint (expected a directory holding index.json)";
  };
  return resolve_resume_with(pg, resume, base, search);
}

ShardedLoad load_sharded_checkpoint(ProcessGroup& pg, const std::string& dir,
                                    const std::vector<io::SliceRequest>& wanted) {
  ShardedLoad out;
  const std::string error = failure_of([&] {
    const io::ShardedCheckpointReader reader(dir);
    out.meta = reader.checkpoint();
    out.slices.reserve(wanted.size());
    for (const io::SliceRequest& w : wanted) out.slices.push_back(reader.read(w));
  });
  agree(pg, "load_sharded_checkpoint " + dir, error);
  return out;
}

}  // namespace lockstep::dist
