// The collective trace's ring: its fixed layout (in memory or in a file mapped shared), the
// writers' records and the readers' copies (Note [Collective trace] in
// include/lockstep/distributed/trace.h).
#include "lockstep/distributed/trace.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <ctime>

#include "distributed/call_signature.h"
#include "lockstep/base/error.h"
#include "lockstep/base/syscall.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/tensor/dtype.h"

namespace lockstep::dist {

namespace detail {

inline constexpr char kTraceMagic[8] = {'L', 'S', 'T', 'R', 'A', 'C', 'E', 0};
inline constexpr uint32_t kTraceVersion = 1;

// One collective. Every field is a lock-free 64-bit atomic so that a reader in another process
// (the launcher, through the shared mapping) never sees a torn value; `seq` is written last on
// issue (release) and re-read by readers to reject a slot overwritten while they copied it.
struct alignas(64) TraceSlot {
  std::atomic<int64_t> seq;
  std::atomic<int64_t> call;  // kind | dtype << 8 | op << 16 | (root + 1) << 32
  std::atomic<int64_t> numel;
  std::atomic<int64_t> state;
  std::atomic<int64_t> issued_ns;
  std::atomic<int64_t> started_ns;
  std::atomic<int64_t> finished_ns;
};
static_assert(sizeof(TraceSlot) == 64);
static_assert(std::atomic<int64_t>::is_always_lock_free);

struct TraceHeader {
  char magic[8];
  uint32_t version;
  uint32_t capacity;
  std::atomic<int64_t> identity;  // rank | size << 24 (written once, before readers care)
  std::atomic<int64_t> pid;
  char backend[16];
  std::atomic<int64_t> issued;
  std::atomic<int64_t> finished;
  std::atomic<int64_t> wait_seq;
  std::atomic<int64_t> wait_since_ns;
};

// What a ring is in memory and in the file: the header, then kTraceCapacity slots.
struct TraceRegion {
  alignas(64) TraceHeader header;
  TraceSlot slots[kTraceCapacity];
};
static_assert(std::is_standard_layout_v<TraceRegion>);

}  // namespace detail

using detail::TraceRegion;
using detail::TraceSlot;
using lockstep::detail::str_cat;

namespace {

void init_region(TraceRegion& r) {
  std::memcpy(r.header.magic, detail::kTraceMagic, sizeof(r.header.magic));
  r.header.version = detail::kTraceVersion;
  r.header.capacity = kTraceCapacity;
  r.header.pid.store(::getpid(), std::memory_order_relaxed);
}

std::string dtype_text(uint32_t dtype) {
  return dtype <= static_cast<uint32_t>(DType::b8)
             ? std::string(dtype_name(static_cast<DType>(dtype)))
             : str_cat("dtype ", dtype);
}

std::string op_text(uint32_t op) {
  return op <= static_cast<uint32_t>(ReduceOp::product)
             ? std::string(reduce_op_name(static_cast<ReduceOp>(op)))
             : str_cat("op ", op);
}

}  // namespace

std::string_view trace_state_name(TraceState s) {
  switch (s) {
    case TraceState::empty:
      return "empty";
    case TraceState::queued:
      return "queued";
    case TraceState::started:
      return "started";
    case TraceState::finished:
      return "finished";
    case TraceState::failed:
      return "failed";
  }
  return "?";
}

int64_t trace_now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME_COARSE, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

std::string TraceRecord::describe() const {
  const auto k = static_cast<detail::CallKind>(kind);
  std::string what;
  if (k == detail::CallKind::barrier) {
    what = "";
  } else if (k == detail::CallKind::broadcast) {
    what = str_cat("root ", root, ", ", numel, " x ", dtype_text(dtype));
  } else if (k == detail::CallKind::all_reduce || k == detail::CallKind::reduce_scatter) {
    what = str_cat(op_text(op), ", ", numel, " x ", dtype_text(dtype));
  } else {
    what = str_cat(numel, " x ", dtype_text(dtype));
  }
  return str_cat(detail::call_kind_name(kind), " #", seq, what.empty() ? "" : " (" + what + ")");
}

bool TraceRecord::same_call(const TraceRecord& o) const {
  return kind == o.kind && dtype == o.dtype && op == o.op && root == o.root && numel == o.numel;
}

const TraceRecord* TraceSnapshot::find(int64_t seq) const {
  for (const auto& r : records)
    if (r.seq == seq) return &r;
  return nullptr;
}

const TraceRecord* TraceSnapshot::oldest_pending() const {
  for (const auto& r : records) {
    if (r.state == TraceState::queued || r.state == TraceState::started) return &r;
  }
  return nullptr;
}

// ---- CollectiveTrace ----

struct CollectiveTrace::Mapping {
  void* addr = nullptr;
  ~Mapping() {
    if (addr != nullptr) ::munmap(addr, sizeof(TraceRegion));
  }
};

CollectiveTrace::CollectiveTrace() : owned_(std::make_unique<TraceRegion>()) {
  init_region(*owned_);
  region_.store(owned_.get(), std::memory_order_release);
}

CollectiveTrace::~CollectiveTrace() = default;

void CollectiveTrace::set_identity(int rank, int size, std::string_view backend) {
  TraceRegion* r = region_.load(std::memory_order_acquire);
  r->header.identity.store(static_cast<int64_t>(rank) | (static_cast<int64_t>(size) << 24),
                           std::memory_order_relaxed);
  std::memset(r->header.backend, 0, sizeof(r->header.backend));
  std::memcpy(r->header.backend, backend.data(),
              std::min(backend.size(), sizeof(r->header.backend) - 1));
}

void CollectiveTrace::export_to(const std::string& path) {
  LS_CHECK(!mapping_, "collective trace: already exported; export_to(", path, ") is called once");
  Fd fd(LS_SYSCHECK_MSG(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600),
                        "cannot create the collective trace file ", path));
  LS_SYSCHECK_MSG(::ftruncate(fd.get(), sizeof(TraceRegion)),
                  "cannot size the collective trace file ", path);
  void* addr =
      ::mmap(nullptr, sizeof(TraceRegion), PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  LS_CHECK(addr != MAP_FAILED, "cannot map the collective trace file ", path, ": ",
           errno_text(errno));
  auto mapping = std::make_unique<Mapping>();
  mapping->addr = addr;
  // The file holds zeros: copy what was recorded so far (no collective runs during init).
  TraceRegion* from = region_.load(std::memory_order_acquire);
  std::memcpy(addr, static_cast<const void*>(from), sizeof(TraceRegion));
  mapping_ = std::move(mapping);
  region_.store(static_cast<TraceRegion*>(addr), std::memory_order_release);
}

void CollectiveTrace::record_issue(int64_t seq, uint32_t kind, uint32_t dtype, uint32_t op,
                                   int32_t root, int64_t numel) {
  TraceRegion* r = region_.load(std::memory_order_acquire);
  TraceSlot& s = r->slots[seq % kTraceCapacity];
  constexpr auto relaxed = std::memory_order_relaxed;
  s.seq.store(0, relaxed);  // a reader copying the old collective rejects it from here on
  std::atomic_thread_fence(std::memory_order_release);
  s.call.store(static_cast<int64_t>(kind) | (static_cast<int64_t>(dtype) << 8) |
                   (static_cast<int64_t>(op) << 16) | (static_cast<int64_t>(root + 1) << 32),
               relaxed);
  s.numel.store(numel, relaxed);
  s.state.store(static_cast<int64_t>(TraceState::queued), relaxed);
  s.issued_ns.store(trace_now_ns(), relaxed);
  s.started_ns.store(0, relaxed);
  s.finished_ns.store(0, relaxed);
  s.seq.store(seq, std::memory_order_release);
  r->header.issued.store(seq, std::memory_order_release);
}

void CollectiveTrace::record_start(int64_t seq) {
  TraceRegion* r = region_.load(std::memory_order_acquire);
  TraceSlot& s = r->slots[seq % kTraceCapacity];
  if (s.seq.load(std::memory_order_relaxed) != seq) return;  // overwritten: 256 newer ones
  s.started_ns.store(trace_now_ns(), std::memory_order_relaxed);
  s.state.store(static_cast<int64_t>(TraceState::started), std::memory_order_release);
}

void CollectiveTrace::record_finish(int64_t seq, bool ok) {
  TraceRegion* r = region_.load(std::memory_order_acquire);
  TraceSlot& s = r->slots[seq % kTraceCapacity];
  if (s.seq.load(std::memory_order_relaxed) == seq) {
    s.finished_ns.store(trace_now_ns(), std::memory_order_relaxed);
    s.state.store(static_cast<int64_t>(ok ? TraceState::finished : TraceState::failed),
                  std::memory_order_release);
  }
  // Collectives finish in order on every backend (one thread finishes them); the check keeps a
  // late one from going back, without the cost of a read-modify-write.
  if (r->header.finished.load(std::memory_order_relaxed) < seq) {
    r->header.finished.store(seq, std::memory_order_release);
  }
}

void CollectiveTrace::record_wait(int64_t seq) {
  TraceRegion* r = region_.load(std::memory_order_acquire);
  if (seq != 0) r->header.wait_since_ns.store(trace_now_ns(), std::memory_order_relaxed);
  r->header.wait_seq.store(seq, std::memory_order_release);
}

namespace {

TraceSnapshot read_region(const TraceRegion& r) {
  TraceSnapshot out;
  const int64_t id = r.header.identity.load(std::memory_order_acquire);
  out.rank = static_cast<int>(id & 0xffffff);
  out.size = static_cast<int>(id >> 24);
  out.pid = static_cast<int>(r.header.pid.load(std::memory_order_relaxed));
  out.backend.assign(r.header.backend, strnlen(r.header.backend, sizeof(r.header.backend)));
  out.issued = r.header.issued.load(std::memory_order_acquire);
  out.finished = r.header.finished.load(std::memory_order_acquire);
  out.wait_seq = r.header.wait_seq.load(std::memory_order_acquire);
  out.wait_since_ns = r.header.wait_since_ns.load(std::memory_order_relaxed);
  // Oldest first: the slots after the newest one's, around the ring.
  const int64_t newest = out.issued;
  for (int64_t seq = std::max<int64_t>(1, newest - kTraceCapacity + 1); seq <= newest; ++seq) {
    const TraceSlot& s = r.slots[seq % kTraceCapacity];
    const int64_t before = s.seq.load(std::memory_order_acquire);
    if (before != seq) continue;
    TraceRecord rec;
    rec.seq = seq;
    const int64_t call = s.call.load(std::memory_order_relaxed);
    rec.kind = static_cast<uint32_t>(call & 0xff);
    rec.dtype = static_cast<uint32_t>((call >> 8) & 0xff);
    rec.op = static_cast<uint32_t>((call >> 16) & 0xff);
    rec.root = static_cast<int32_t>(call >> 32) - 1;
    rec.numel = s.numel.load(std::memory_order_relaxed);
    const int64_t state = s.state.load(std::memory_order_acquire);
    rec.state = state >= 0 && state <= static_cast<int64_t>(TraceState::failed)
                    ? static_cast<TraceState>(state)
                    : TraceState::empty;
    rec.issued_ns = s.issued_ns.load(std::memory_order_relaxed);
    rec.started_ns = s.started_ns.load(std::memory_order_relaxed);
    rec.finished_ns = s.finished_ns.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.seq.load(std::memory_order_relaxed) != seq) continue;  // overwritten while copied
    out.records.push_back(rec);
  }
  return out;
}

}  // namespace

TraceSnapshot CollectiveTrace::snapshot() const {
  return read_region(*region_.load(std::memory_order_acquire));
}

std::optional<TraceSnapshot> read_trace_file(const std::string& path, std::string* why) {
  auto fail = [&](std::string w) -> std::optional<TraceSnapshot> {
    if (why != nullptr) *why = std::move(w);
    return std::nullopt;
  };
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return fail(str_cat("cannot open ", path, ": ", errno_text(errno)));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return fail(str_cat("cannot stat ", path));
  if (static_cast<size_t>(st.st_size) < sizeof(TraceRegion)) {
    return fail(
        str_cat(path, " holds ", st.st_size, " bytes, a trace needs ", sizeof(TraceRegion)));
  }
  // Mapped, not read: the writer may be updating it while we copy (each field is atomic).
  void* addr = ::mmap(nullptr, sizeof(TraceRegion), PROT_READ, MAP_SHARED, fd.get(), 0);
  if (addr == MAP_FAILED) return fail(str_cat("cannot map ", path, ": ", errno_text(errno)));
  const auto& r = *static_cast<const TraceRegion*>(addr);
  std::optional<TraceSnapshot> out;
  if (std::memcmp(r.header.magic, detail::kTraceMagic, sizeof(r.header.magic)) != 0) {
    fail(str_cat(path, " is not a collective trace (bad magic)"));
  } else if (r.header.version != detail::kTraceVersion || r.header.capacity != kTraceCapacity) {
    fail(str_cat(path, " is a trace of version ", r.header.version, " with ", r.header.capacity,
                 " slots; expected version ", detail::kTraceVersion, " with ", kTraceCapacity));
  } else {
    out = read_region(r);
  }
  ::munmap(addr, sizeof(TraceRegion));
  return out;
}

}  // namespace lockstep::dist
