// ProcessGroupShm: collectives on CPU tensors between ranks of one machine, through one POSIX
// shared-memory segment per group.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "lockstep/distributed/process_group.h"

namespace lockstep::dist {

// Bytes of each rank's slot in the segment: a collective of any size moves through it in pieces
// of this many bytes, so the segment stays size() x this whatever the tensors.
inline constexpr int64_t kDefaultShmSlotBytes = int64_t{4} << 20;
// The smallest slot: room for a few elements of every rank in a reduce_scatter piece.
inline constexpr int64_t kMinShmSlotBytes = 1024;

struct ShmOptions {
  int64_t slot_bytes = kDefaultShmSlotBytes;  // a multiple of 64, >= kMinShmSlotBytes
};

// Construction checks through config.store that every rank runs on this machine (an Error naming
// the first rank that does not, on every rank), then rank 0 creates the segment and every rank
// maps it; the segment's name is unlinked as soon as all have, so nothing is left in /dev/shm
// whatever way the processes end.
//
// Collectives run at once on the calling thread (Note [shm runs on the caller's thread] in
// src/distributed/shm/process_group_shm.cpp): every call returns a completed Work. They are
// bounded by their timeout; a peer that dies makes the others fail naming it. After a collective
// fails that way the group is poisoned: every later call fails at once, naming the first
// failure. Ranks that disagree on a collective's sizes, dtype, op or root fail together, naming
// both values; the group stays usable after that.
// Unlinks the segments in /dev/shm that shm groups of ended jobs left behind: those whose creating
// process (in this pid namespace) no longer runs (Note [Segments of dead jobs] in
// src/distributed/shm/segment.cpp). Returns how many it removed. The launcher calls it once its
// workers have exited; rank 0 of a new shm group calls it before creating its segment.
size_t remove_dead_shm_segments();

class ProcessGroupShm : public ProcessGroup {
 public:
  explicit ProcessGroupShm(const BackendConfig& config, const ShmOptions& options = {});
  ~ProcessGroupShm() override;

  std::string_view backend() const override { return "shm"; }
  // The segment's (already unlinked) name, "/lockstep-shm-<run id>-<pid namespace>-<pid>-<nonce>".
  const std::string& segment_name() const;

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
  bool supports(Device device) const override { return device.is_cpu(); }

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lockstep::dist
