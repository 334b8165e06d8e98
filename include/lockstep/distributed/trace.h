// The collective trace: every process group records its last collectives (what, how big, in
// which state, since when) in a fixed ring, always on; the launcher reads it to say which rank
// is at fault (Note [Collective trace]).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lockstep::dist {

// Note [Collective trace]
// A hung job's first question is "which rank, which collective". Every ProcessGroup writes each
// collective it issues into a ring of kTraceCapacity slots: sequence number, kind, dtype, element
// count, root or reduce op, state (queued: issued by the caller; started: the backend is moving
// its data; finished or failed) and the wall-clock times of each change, plus the collective the
// calling thread is blocked on in wait(). Recording is a few relaxed atomic stores and a coarse
// clock read per change (bench/allreduce's "trace" rows measure it against a 4 KiB all_reduce);
// nothing is ever allocated or locked, so it stays on.
//
// The ring is plain memory of a fixed layout. Under `lockstep run` the world group's ring lives
// in a file the launcher names (LOCKSTEP_TRACE_FILE), mapped shared: the launcher reads it while
// the worker runs, when it is stopped (SIGSTOP), deadlocked or already dead, without asking the
// worker anything. That is what lets the launcher print one verdict line ("rank 1 never issued
// all_reduce #8 ...", tools/lockstep/verdict.h) at a timeout, a failure, a stall, or on SIGUSR1.
// A reader copies a slot and accepts it only if its sequence number was the same before and
// after (a slot overwritten meanwhile is skipped): diagnosis tolerates a missed slot, training
// must not pay for locks.
inline constexpr int kTraceCapacity = 256;

enum class TraceState : uint8_t { empty = 0, queued, started, finished, failed };
std::string_view trace_state_name(TraceState s);

// One collective as read back from a ring. kind, dtype and op are detail::CallKind, DType and
// ReduceOp as integers (op for all_reduce / reduce_scatter, root for broadcast); times are
// nanoseconds since the Unix epoch, 0 when the state was not reached.
struct TraceRecord {
  int64_t seq = 0;
  uint32_t kind = 0;
  uint32_t dtype = 0;
  uint32_t op = 0;
  int32_t root = 0;
  int64_t numel = 0;
  TraceState state = TraceState::empty;
  int64_t issued_ns = 0;
  int64_t started_ns = 0;
  int64_t finished_ns = 0;

  // "all_reduce #8 (sum, 1024 x float32)"
  std::string describe() const;
  // What the ranks must agree on: kind, dtype, op/root, element count.
  bool same_call(const TraceRecord& other) const;
};

// A ring as read back: who wrote it and its slots, oldest first.
struct TraceSnapshot {
  int rank = -1;
  int size = 0;
  int pid = 0;
  std::string backend;
  int64_t issued = 0;    // the highest sequence number issued
  int64_t finished = 0;  // the highest sequence number finished (successfully or not)
  int64_t wait_seq = 0;  // the collective the caller is blocked on in wait(); 0: none
  int64_t wait_since_ns = 0;
  std::vector<TraceRecord> records;

  // The record of `seq`, if the ring still holds it.
  const TraceRecord* find(int64_t seq) const;
  // The oldest collective issued but neither finished nor failed, if any.
  const TraceRecord* oldest_pending() const;
};

namespace detail {
struct TraceRegion;
}

class CollectiveTrace {
 public:
  // A ring in this process's memory.
  CollectiveTrace();
  ~CollectiveTrace();
  CollectiveTrace(const CollectiveTrace&) = delete;
  CollectiveTrace& operator=(const CollectiveTrace&) = delete;

  // Who writes this ring (kept in its header for readers in other processes).
  void set_identity(int rank, int size, std::string_view backend);
  // Moves the ring into a file at `path` (created or truncated, mapped shared) so that other
  // processes can read it, with what it recorded so far. Once per trace.
  void export_to(const std::string& path);

  // The caller issued collective `seq` (numbered from 1, in order).
  void record_issue(int64_t seq, uint32_t kind, uint32_t dtype, uint32_t op, int32_t root,
                    int64_t numel);
  void record_start(int64_t seq);
  void record_finish(int64_t seq, bool ok);
  // The calling thread blocks on `seq` in Work::wait(); 0: it stopped waiting.
  void record_wait(int64_t seq);

  TraceSnapshot snapshot() const;

 private:
  std::atomic<detail::TraceRegion*> region_;
  std::unique_ptr<detail::TraceRegion> owned_;  // the in-memory ring (kept after export_to)
  struct Mapping;
  std::unique_ptr<Mapping> mapping_;
};

// The ring in the file at `path` (what the launcher reads); nullopt with `why` set when the file
// is missing, too short, or not a trace of this version.
std::optional<TraceSnapshot> read_trace_file(const std::string& path, std::string* why = nullptr);

// The current time for trace records: the coarse real-time clock, in nanoseconds since the epoch.
int64_t trace_now_ns();

}  // namespace lockstep::dist
