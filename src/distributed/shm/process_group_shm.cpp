// ProcessGroupShm: every collective as phases over the segment's per-rank slots, run on the
// caller's thread.
#include "lockstep/distributed/shm/process_group_shm.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "distributed/call_signature.h"
#include "distributed/shm/reduce.h"
#include "distributed/shm/register.h"
#include "distributed/shm/segment.h"
#include "lockstep/base/error.h"

namespace lockstep::dist {

namespace {

using shm::CallHeader;
using shm::Clock;
using shm::Segment;

using Kind = dist::detail::CallKind;

// Ranks disagree about a collective's arguments: every rank fails alike; the group stays usable.
class Mismatch : public Error {
 public:
  using Error::Error;
};

// Chunks of a piece start on cache-line boundaries, so two ranks never write one line.
constexpr size_t kChunkAlignBytes = 64;
// An all_reduce piece whose bytes over all ranks are at most this is reduced whole by every rank
// (the same rank order, so the same bits): two phases instead of three, for latency.
constexpr size_t kDirectReduceBytes = 32 * 1024;

// Note [Two ranks reduce whole pieces]
// Per element of a piece, the reduce-scatter way costs each rank 5 + 1/n memory passes (copy in:
// read + write; reduce its 1/n: read n/n, write 1/n; copy every chunk out: read + write) and
// three phases; reducing the whole piece straight into the tensor costs 3 + n passes and two
// phases. With two ranks that is 5 passes against 5.5 and one wait per piece fewer (a wait for
// a descheduled peer is what large all_reduces lose most time to on a busy machine), so two
// ranks always reduce whole pieces; from three ranks on, the reduce-scatter way moves less.
bool reduce_whole_piece(size_t piece_bytes, int ranks) {
  return ranks <= 2 || piece_bytes * static_cast<size_t>(ranks) <= kDirectReduceBytes;
}

struct Range {
  size_t begin = 0;
  size_t end = 0;
  size_t size() const { return end - begin; }
};

// Rank r's share of `len` elements split over `ranks` (the last shares may be short or empty).
Range share(size_t len, int ranks, int r, size_t align) {
  size_t per = (len + static_cast<size_t>(ranks) - 1) / static_cast<size_t>(ranks);
  per = (per + align - 1) / align * align;
  const size_t begin = std::min(per * static_cast<size_t>(r), len);
  return {begin, std::min(begin + per, len)};
}

// memcpy that allows zero bytes from or to a null pointer (an empty tensor's data).
void copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

// "" when every rank's header matches rank 0's; otherwise the same message on every rank.
std::string mismatch(const Segment& seg) {
  std::vector<CallHeader> headers;
  headers.reserve(static_cast<size_t>(seg.size()));
  for (int r = 0; r < seg.size(); ++r) headers.push_back(seg.header(r));
  return dist::detail::call_mismatch(headers);
}

}  // namespace

// Note [Phases]
// A collective is a sequence of phases; in each, a rank touches only what the phase allows
// (writes its own slot, or reads the slots that earlier phases filled), then arrives (bumps its
// sequence counter). A phase starts once every rank arrived from the previous one, so no slot is
// read while being written; the counters' release/acquire order makes the slot data visible. The
// last phase of a collective ends without waiting: the next collective's first phase does that.
// Every collective's first phase writes the rank's CallHeader and its second checks them all, so
// ranks that disagree (and would run different numbers of phases) stop together.
//   all_reduce, per slot-sized piece: copy in | reduce own chunk of every slot (rank order) into
//              own slot | copy every rank's reduced chunk out; a small piece, or any piece of
//              two ranks: copy in | reduce all of it, every rank alike, straight into the tensor
//   broadcast: root copies in | the others copy out of root's slot
//   all_gather: copy in | copy every slot out
//   reduce_scatter: copy each destination's part into its sub-slot | reduce own sub-slot of every
//              slot straight into the output
//   barrier: header | check
class ProcessGroupShm::Impl {
 public:
  Impl(const BackendConfig& c, const ShmOptions& o, const std::string& who)
      : who_(who),
        seg_(shm::SegmentOptions{.store = c.store,
                                 .rank = c.rank,
                                 .size = c.size,
                                 .slot_bytes = checked_slot_bytes(o, c.size, who),
                                 .timeout = c.timeout,
                                 .who = who}) {}

  // Note [shm runs on the caller's thread]
  // A collective here is memory copies paced by the slowest rank, so it runs at once on the
  // thread that issued it and returns a completed Work; a communication thread would add two
  // thread hand-offs (each a wake-up of tens to hundreds of microseconds) and would compete for
  // a core with the backward pass, since a machine running one rank per core has none to spare.
  // DDP's reducer launches a bucket's all_reduce from the backward hook of its last gradient
  // (src/distributed/data_parallel/reducer.cpp), so backward pauses for that bucket's copy and for
  // ranks behind it; ranks run the same backward on equal shards, so that wait is short, and the
  // copy itself runs at memory bandwidth. A machine with idle cores could overlap more with a
  // thread (measure before adding one).
  void run(const WorkPtr& work, std::chrono::milliseconds timeout,
           const std::function<void(Clock::time_point, std::chrono::milliseconds)>& body) {
    if (!broken_.empty()) return work_refuse(*work, who_, broken_);  // Note [Poisoned group]
    try {
      // A rank whose collectives never wait long (its peers are always ahead) learns here that
      // another rank failed.
      seg_.check_poisoned();
      // No work_start(): the collective runs now, on the thread that issued it, so its trace
      // record's issue time is its start (Note [Collective trace]: a clock read saved).
      body(Clock::now() + timeout, timeout);
    } catch (const Mismatch& e) {
      return fail(*work, " failed: " + e.message());
    } catch (const Error& e) {
      poison(*work, e.message());
      return;
    } catch (const std::exception& e) {
      poison(*work, e.what());
      return;
    }
    work_finish(*work);
  }

  void phase_begin(Clock::time_point deadline, std::chrono::milliseconds timeout) {
    seg_.wait_all(deadline, timeout);
  }
  void phase_end() { seg_.arrive(); }

  void write_header(Kind kind, DType dtype, ReduceOp op, int root, int64_t numel) {
    CallHeader& h = seg_.header(seg_.rank());
    h.kind = static_cast<uint32_t>(kind);
    h.dtype = static_cast<uint32_t>(dtype);
    h.op = static_cast<uint32_t>(op);
    h.root = root;
    h.numel = numel;
  }
  // At the start of the second phase; on a mismatch this rank arrives (it is done reading the
  // headers) and every rank throws the same Mismatch.
  void check_headers() {
    const std::string m = mismatch(seg_);
    if (m.empty()) return;
    phase_end();
    throw Mismatch(m, __FILE__, __LINE__);
  }

  Segment& seg() { return seg_; }
  const std::string& who() const { return who_; }

 private:
  static int64_t checked_slot_bytes(const ShmOptions& o, int size, const std::string& who) {
    LS_CHECK(o.slot_bytes >= kMinShmSlotBytes && o.slot_bytes % 64 == 0 &&
                 o.slot_bytes >= int64_t{8} * size,
             who, ": ShmOptions::slot_bytes must be a multiple of 64, at least ", kMinShmSlotBytes,
             " and at least 8 x the group size; got ", o.slot_bytes);
    return o.slot_bytes;
  }

  void fail(Work& work, const std::string& what) {
    work_finish(work, std::make_exception_ptr(
                          Error(who_ + ": " + work.description() + what, __FILE__, __LINE__)));
  }
  void poison(Work& work, const std::string& reason) {
    seg_.poison();
    broken_ = work.description() + ": " + reason;
    fail(work, " failed: " + reason);
  }

  const std::string who_;
  Segment seg_;
  std::string broken_;  // the first failure; set once the group is poisoned (Note [Poisoned group])
};

void register_shm_backend() {
  register_backend("shm", [](const BackendConfig& config) -> ProcessGroupPtr {
    return std::make_shared<ProcessGroupShm>(config);
  });
}

ProcessGroupShm::ProcessGroupShm(const BackendConfig& config, const ShmOptions& options)
    : ProcessGroup(config.rank, config.size, config.timeout) {
  LS_CHECK(config.store != nullptr, who(), ": a store to rendezvous through is required");
  impl_ = std::make_unique<Impl>(config, options, who());
}

ProcessGroupShm::~ProcessGroupShm() = default;

const std::string& ProcessGroupShm::segment_name() const { return impl_->seg().name(); }

void ProcessGroupShm::do_all_reduce(Tensor tensor, ReduceOp op, std::chrono::milliseconds timeout,
                                    const WorkPtr& work) {
  Impl& im = *impl_;
  impl_->run(work, timeout, [&](Clock::time_point deadline, std::chrono::milliseconds t) {
    Segment& seg = im.seg();
    const int me = seg.rank(), ranks = seg.size();
    const DType dt = tensor.dtype();
    const auto es = static_cast<size_t>(tensor.element_size());
    const auto n = static_cast<size_t>(tensor.numel());
    auto* data = static_cast<uint8_t*>(tensor.data_ptr());
    const size_t piece = static_cast<size_t>(seg.slot_bytes()) / es;
    const size_t align = std::max<size_t>(1, kChunkAlignBytes / es);
    std::vector<const void*> srcs(static_cast<size_t>(ranks));
    size_t off = 0;
    do {
      const size_t len = std::min(piece, n - off);
      im.phase_begin(deadline, t);
      if (off == 0) im.write_header(Kind::all_reduce, dt, op, 0, tensor.numel());
      copy(seg.slot(me), data + off * es, len * es);
      im.phase_end();

      im.phase_begin(deadline, t);
      if (off == 0) im.check_headers();
      if (reduce_whole_piece(len * es, ranks)) {
        // Small, or two ranks: every rank reduces the whole piece itself, saving the third
        // phase's wait (Note [Two ranks reduce whole pieces]).
        for (int r = 0; r < ranks; ++r) srcs[r] = seg.slot(r);
        shm::reduce(dt, op, data + off * es, srcs.data(), ranks, len);
        im.phase_end();
        off += len;
        continue;
      }
      const Range mine = share(len, ranks, me, align);
      for (int r = 0; r < ranks; ++r) srcs[r] = seg.slot(r) + mine.begin * es;
      shm::reduce(dt, op, seg.slot(me) + mine.begin * es, srcs.data(), ranks, mine.size());
      im.phase_end();

      im.phase_begin(deadline, t);
      for (int r = 0; r < ranks; ++r) {
        const Range c = share(len, ranks, r, align);
        copy(data + (off + c.begin) * es, seg.slot(r) + c.begin * es, c.size() * es);
      }
      im.phase_end();
      off += len;
    } while (off < n);
  });
}

void ProcessGroupShm::do_broadcast(Tensor tensor, int root, std::chrono::milliseconds timeout,
                                   const WorkPtr& work) {
  Impl& im = *impl_;
  impl_->run(work, timeout, [&](Clock::time_point deadline, std::chrono::milliseconds t) {
    Segment& seg = im.seg();
    const int me = seg.rank();
    const auto total = static_cast<size_t>(tensor.nbytes());
    auto* data = static_cast<uint8_t*>(tensor.data_ptr());
    const auto piece = static_cast<size_t>(seg.slot_bytes());
    size_t off = 0;
    do {
      const size_t len = std::min(piece, total - off);
      im.phase_begin(deadline, t);
      if (off == 0)
        im.write_header(Kind::broadcast, tensor.dtype(), ReduceOp::sum, root, tensor.numel());
      if (me == root) copy(seg.slot(me), data + off, len);
      im.phase_end();

      im.phase_begin(deadline, t);
      if (off == 0) im.check_headers();
      if (me != root) copy(data + off, seg.slot(root), len);
      im.phase_end();
      off += len;
    } while (off < total);
  });
}

void ProcessGroupShm::do_all_gather(Tensor output, Tensor input, std::chrono::milliseconds timeout,
                                    const WorkPtr& work) {
  Impl& im = *impl_;
  impl_->run(work, timeout, [&](Clock::time_point deadline, std::chrono::milliseconds t) {
    Segment& seg = im.seg();
    const int me = seg.rank(), ranks = seg.size();
    const auto es = static_cast<size_t>(input.element_size());
    const auto m = static_cast<size_t>(input.numel());
    const auto* in = static_cast<const uint8_t*>(input.data_ptr());
    auto* out = static_cast<uint8_t*>(output.data_ptr());
    const size_t piece = static_cast<size_t>(seg.slot_bytes()) / es;
    size_t off = 0;
    do {
      const size_t len = std::min(piece, m - off);
      im.phase_begin(deadline, t);
      if (off == 0)
        im.write_header(Kind::all_gather, input.dtype(), ReduceOp::sum, 0, input.numel());
      copy(seg.slot(me), in + off * es, len * es);
      im.phase_end();

      im.phase_begin(deadline, t);
      if (off == 0) im.check_headers();
      for (int r = 0; r < ranks; ++r) copy(out + (r * m + off) * es, seg.slot(r), len * es);
      im.phase_end();
      off += len;
    } while (off < m);
  });
}

void ProcessGroupShm::do_reduce_scatter(Tensor output, Tensor input, ReduceOp op,
                                        std::chrono::milliseconds timeout, const WorkPtr& work) {
  Impl& im = *impl_;
  impl_->run(work, timeout, [&](Clock::time_point deadline, std::chrono::milliseconds t) {
    Segment& seg = im.seg();
    const int me = seg.rank(), ranks = seg.size();
    const DType dt = input.dtype();
    const auto es = static_cast<size_t>(input.element_size());
    const auto m = static_cast<size_t>(output.numel());
    const auto* in = static_cast<const uint8_t*>(input.data_ptr());
    auto* out = static_cast<uint8_t*>(output.data_ptr());
    // Each slot holds one sub-slot per destination rank.
    const size_t align = std::max<size_t>(1, kChunkAlignBytes / es);
    size_t sub = static_cast<size_t>(seg.slot_bytes()) / static_cast<size_t>(ranks) / es;
    if (sub >= align) sub = sub / align * align;
    std::vector<const void*> srcs(static_cast<size_t>(ranks));
    size_t off = 0;
    do {
      const size_t len = std::min(sub, m - off);
      im.phase_begin(deadline, t);
      if (off == 0) im.write_header(Kind::reduce_scatter, dt, op, 0, output.numel());
      for (int r = 0; r < ranks; ++r) {
        copy(seg.slot(me) + r * sub * es, in + (r * m + off) * es, len * es);
      }
      im.phase_end();

      im.phase_begin(deadline, t);
      if (off == 0) im.check_headers();
      for (int q = 0; q < ranks; ++q) srcs[q] = seg.slot(q) + me * sub * es;
      if (len > 0) shm::reduce(dt, op, out + off * es, srcs.data(), ranks, len);
      im.phase_end();
      off += len;
    } while (off < m);
  });
}

void ProcessGroupShm::do_barrier(std::chrono::milliseconds timeout, const WorkPtr& work) {
  Impl& im = *impl_;
  impl_->run(work, timeout, [&](Clock::time_point deadline, std::chrono::milliseconds t) {
    im.phase_begin(deadline, t);
    im.write_header(Kind::barrier, DType::u8, ReduceOp::sum, 0, 0);
    im.phase_end();
    im.phase_begin(deadline, t);
    im.check_headers();
    im.phase_end();
  });
}

}  // namespace lockstep::dist
