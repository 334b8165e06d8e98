// The shared-memory segment of one shm process group: its layout, how the ranks create, map and
// unlink it, and the per-rank sequence counters through which they synchronise.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distributed/call_signature.h"
#include "lockstep/base/syscall.h"
#include "lockstep/distributed/store/store.h"

namespace lockstep::dist::shm {

using Clock = std::chrono::steady_clock;

// What every rank writes before a collective's first phase and every rank reads after it, so
// that ranks that disagree (sizes, dtypes, ops, roots) fail together before they diverge.
using CallHeader = dist::detail::CallSignature;

// Names begin with this (after the '/'); tests look for it in /dev/shm.
inline constexpr const char* kSegmentPrefix = "lockstep-shm-";

struct SegmentOptions {
  std::shared_ptr<Store> store;  // namespaced for the group
  int rank = 0;
  int size = 1;
  int64_t slot_bytes = 0;
  std::chrono::milliseconds timeout{0};  // for the rendezvous through the store
  std::string who;                       // "rank 1/4 (shm)", the start of error messages
};

// Thrown (by Segment::wait_all) when a peer died, timed out or failed: the group cannot go on.
class PeerFailure : public Error {
 public:
  using Error::Error;
};

class Segment {
 public:
  // Checks that every rank is on this machine, then rank 0 creates the segment and the others
  // map it; it is unlinked once every rank has mapped it (Note [Segment lifetime]).
  explicit Segment(const SegmentOptions& options);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  // Rank r's data slot (slot_bytes(), page-aligned) and call header.
  uint8_t* slot(int r) const;
  CallHeader& header(int r) const;

  // Note [Phases]: this rank finished the current phase of a collective.
  void arrive();
  // Blocks until every rank has arrived as often as this one. Throws PeerFailure when a peer
  // died, when another rank poisoned the segment, or at `deadline` (`what` names the collective
  // in the timeout's message).
  void wait_all(Clock::time_point deadline, std::chrono::milliseconds timeout);
  // Throws PeerFailure when another rank poisoned the segment (one atomic load).
  void check_poisoned() const;
  // Marks the segment failed because of this rank (first failure wins) and wakes every waiter,
  // so that the others fail now rather than at their own timeouts.
  void poison();

 private:
  struct Control;
  struct Header;
  Control& control(int r) const;
  Header& seg_header() const;
  void wait_for(int peer, Clock::time_point deadline, std::chrono::milliseconds timeout);
  // Throws PeerFailure when a peer is dead or the segment was poisoned.
  void check_peers();
  [[noreturn]] void fail(uint32_t reason, int culprit, const std::string& message);
  std::string describe_abort(uint32_t word) const;
  void wake_all();
  void connect(const SegmentOptions& options);
  // Unmaps and, where still needed, unlinks; idempotent (the destructor and failed construction).
  void release();

  std::string who_;
  int rank_ = 0;
  int size_ = 1;
  int64_t slot_bytes_ = 0;
  int64_t slot_stride_ = 0;
  std::string name_;
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
  bool creator_ = false;
  bool unlinked_ = false;
  uint32_t seq_ = 0;                 // how often this rank arrived
  std::vector<int> pids_;            // every rank's process id
  std::vector<Fd> pidfds_;           // a pidfd per peer (invalid where unavailable)
  Clock::time_point next_liveness_;  // when wait_for next checks its peers
  Clock::duration spin_{};            // how long wait_for spins (Note [Spin, then futex])
};

}  // namespace lockstep::dist::shm
