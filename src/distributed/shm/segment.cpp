// The shm backend's segment: same-machine check, creation and mapping through the store, and
// the sequence counters (spin, then futex) with which ranks wait for each other.
#include "distributed/shm/segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string_view>

#include "distributed/machine.h"
#include "lockstep/distributed/shm/process_group_shm.h"
#include "lockstep/base/env_var.h"
#include "lockstep/base/error.h"
#include "lockstep/base/log.h"
#include "lockstep/base/worker_env.h"

namespace lockstep::dist::shm {

namespace {

constexpr uint64_t kMagic = 0x6c6b7374'73686d31ull;  // "lkstshm1"
constexpr size_t kPage = 4096;
// Two cache lines: adjacent-line prefetch must not make two ranks' counters share traffic.
constexpr size_t kLine = 128;

// Note [Spin, then futex]
// A peer usually arrives within microseconds, and a futex wake-up costs tens to hundreds of
// microseconds on a virtual machine, so a waiter first spins (with a pause instruction). After
// that it blocks in FUTEX_WAIT on the peer's counter: with more ranks than cores a spinning
// waiter would steal the very core its peer needs. How long to spin therefore depends on that:
// kSpinOwnCore when the machine's ranks fit on the cores this process may use (measured: a
// 4 KiB all_reduce of 2 ranks on 2 cores took 29 us with a 5 us spin, nearly all of it two
// futex round trips, where Open MPI, which only polls, takes 1.5 us), kSpin otherwise. A rank that arrives wakes its
// counter's futex only when someone sleeps on it (the sleepers count), so the fast path makes
// no system call. The futexes are shared (not FUTEX_PRIVATE): the word lives in memory mapped
// by several processes. Sleeps end every kHeartbeat to check that the peers are alive and
// whether the deadline passed; a fixed-time sleep is never the way to wait.
constexpr auto kSpin = std::chrono::microseconds(5);
constexpr auto kSpinOwnCore = std::chrono::microseconds(200);

// The CPUs this process may run on.
int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}
constexpr auto kHeartbeat = std::chrono::milliseconds(100);

static_assert(std::atomic_ref<uint32_t>::is_always_lock_free,
              "the shm backend needs lock-free 32-bit atomics (address-free across processes)");

// Why the segment was poisoned (Segment::Header::abort: reason << 16 | culprit + 1).
constexpr uint32_t kDied = 1;
constexpr uint32_t kFailed = 2;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

long futex(uint32_t* word, int op, uint32_t value, const timespec* timeout) {
  return ::syscall(SYS_futex, word, op, value, timeout, nullptr, 0);
}

// Whether `v` has reached `target` on a counter that may wrap around.
bool reached(uint32_t v, uint32_t target) { return static_cast<int32_t>(v - target) >= 0; }

std::string sanitized_run_id() {
  const std::string id = env_string(env::kRunId).value_or("");
  std::string out;
  for (const char c : id) {
    if (out.size() >= 32) break;
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_') {
      out += c;
    }
  }
  return out.empty() ? "norun" : out;
}

// The pid namespace this process lives in (the inode of /proc/self/ns/pid); 0 if unknown. A pid
// names a process only within its namespace.
uint64_t pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// Note [Segments of dead jobs]
// A segment's name is unlinked once every rank has mapped it (Note [Segment lifetime]); until
// then it is in /dev/shm, and a job stopped in that window (Ctrl-C, SIGTERM to the launcher, a
// rank killed) leaves it there, since a process killed by a signal cleans nothing up. So the name
// says who made it: "/lockstep-shm-<run>-<pid namespace>-<pid>-<nonce>" (the random nonce keeps
// two groups of one process apart). A segment whose creator, in this pid namespace, no longer
// runs is of no use to anyone: its group failed or never formed, since a group's segment loses
// its name before the group's first collective. remove_dead_shm_segments() unlinks those. The
// launcher calls it once its workers have exited (however the job ended), and rank 0 of every
// new shm group before it creates its segment (the next job on the machine, when the launcher
// itself was killed). A segment of another pid namespace (another container sharing /dev/shm) is
// never judged: its pid means nothing here.
std::string new_segment_name() {
  std::random_device rd;
  const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(nonce));
  return lockstep::detail::str_cat("/", kSegmentPrefix, sanitized_run_id(), "-", pid_namespace(),
                                   "-", ::getpid(), "-", hex);
}

// The pid namespace and pid in a segment's name (without '/'), or nullopt for a name of another
// form (an older lockstep's, or not a segment).
std::optional<std::pair<uint64_t, pid_t>> segment_creator(std::string_view name) {
  if (!name.starts_with(kSegmentPrefix)) return std::nullopt;
  name.remove_prefix(std::strlen(kSegmentPrefix));
  std::vector<std::string_view> fields;
  for (size_t at = 0;;) {
    const size_t dash = name.find('-', at);
    fields.push_back(name.substr(at, dash - at));
    if (dash == std::string_view::npos) break;
    at = dash + 1;
  }
  if (fields.size() != 4) return std::nullopt;  // run, pid namespace, pid, nonce
  auto number = [](std::string_view f) -> std::optional<uint64_t> {
    if (f.empty() || f.size() > 19) return std::nullopt;
    uint64_t v = 0;
    for (char c : f) {
      if (c < '0' || c > '9') return std::nullopt;
      v = v * 10 + static_cast<uint64_t>(c - '0');
    }
    return v;
  };
  const auto ns = number(fields[1]);
  const auto pid = number(fields[2]);
  if (!ns || !pid || *pid == 0 || *pid > INT_MAX) return std::nullopt;
  return std::make_pair(*ns, static_cast<pid_t>(*pid));
}

// "/dev/shm has 1.0 MiB free of 1.0 MiB", or what could not be learnt.
std::string dev_shm_space() {
  struct statvfs vfs {};
  if (::statvfs("/dev/shm", &vfs) != 0) return "/dev/shm cannot be examined (" + errno_text(errno) + ")";
  const double mib = 1024.0 * 1024.0;
  char text[128];
  std::snprintf(text, sizeof(text), "/dev/shm has %.1f MiB free of %.1f MiB",
                static_cast<double>(vfs.f_bavail) * static_cast<double>(vfs.f_frsize) / mib,
                static_cast<double>(vfs.f_blocks) * static_cast<double>(vfs.f_frsize) / mib);
  return text;
}

// store.wait, with what was being waited for in the error.
void wait_keys(Store& store, const std::vector<std::string>& keys,
               std::chrono::milliseconds timeout, const std::string& who, const char* what) {
  try {
    store.wait(keys, timeout);
  } catch (const Error& e) {
    LS_THROW(who, ": building the shm group, waiting for ", what,
             " through the store: ", e.message());
  }
}

std::string key(const char* what, int r) { return lockstep::detail::str_cat("shm/", what, "/", r); }

}  // namespace

struct Segment::Header {
  uint64_t magic;
  uint64_t slot_bytes;
  uint64_t total_bytes;
  int32_t size;
  alignas(kLine) uint32_t abort;  // 0, or reason << 16 | culprit + 1 (atomic_ref)
};

struct Segment::Control {
  alignas(kLine) uint32_t seq;  // how often this rank arrived (atomic_ref; the futex word)
  uint32_t sleepers;            // waiters blocked on seq (atomic_ref)
  alignas(kLine) CallHeader call;
};

// Note [Segment lifetime]
// Every rank first publishes its machine's identity; unless all agree, every rank fails with the
// same message. Rank 0 then creates the segment (O_EXCL, mode 0600) and publishes its name, or
// "!" and why it could not. Each rank maps it and publishes its pid (or "!" and its error); once
// all have, every rank unlinks the name (all try, so that one dying rank cannot leave it behind),
// and from then on nothing in /dev/shm outlives the processes, however they end. The mapping
// itself lives until the last rank unmaps it.
Segment::Segment(const SegmentOptions& o)
    : who_(o.who), rank_(o.rank), size_(o.size), slot_bytes_(o.slot_bytes) {
  try {
    connect(o);
  } catch (...) {
    release();  // the destructor does not run for a throwing constructor
    throw;
  }
}

void Segment::connect(const SegmentOptions& o) {
  LS_CHECK(o.store != nullptr, who_, ": a store to rendezvous through is required");
  Store& store = *o.store;

  std::vector<std::string> host_keys;
  for (int r = 0; r < size_; ++r) host_keys.push_back(key("host", r));
  store.set(host_keys[rank_], dist::detail::machine_identity());
  wait_keys(store, host_keys, o.timeout, who_, "every rank's machine identity");
  const std::string host0 = store.get_string(host_keys[0]);
  for (int r = 1; r < size_; ++r) {
    const std::string host = store.get_string(host_keys[r]);
    LS_CHECK(host == host0, who_, ": shm needs every rank on one machine: rank ", r, " is on host ",
             host, ", rank 0 on host ", host0,
             "; use the gloo backend for groups that span machines");
  }

  spin_ = size_ <= usable_cpus() ? kSpinOwnCore : kSpin;  // Note [Spin, then futex]
  slot_stride_ = static_cast<int64_t>(round_up(static_cast<size_t>(slot_bytes_), kPage));
  const size_t controls = round_up(sizeof(Header), kLine);
  const size_t slots = round_up(controls + sizeof(Control) * static_cast<size_t>(size_), kPage);
  bytes_ = slots + static_cast<size_t>(slot_stride_) * static_cast<size_t>(size_);

  const std::string name_key = "shm/segment";
  auto map = [&](const Fd& fd) {
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    LS_CHECK(p != MAP_FAILED, who_, ": cannot map ", name_, " (", bytes_,
             " bytes): ", errno_text(errno));
    base_ = static_cast<uint8_t*>(p);
  };
  std::string map_error;
  if (rank_ == 0) {
    // The header is complete before the name is published: the others check it once mapped.
    try {
      if (const size_t n = remove_dead_shm_segments(); n > 0) {
        log_warning(who_, ": removed ", n, " shared-memory segment", n == 1 ? "" : "s",
                    " that jobs which have ended left in /dev/shm");
      }
      name_ = new_segment_name();
      Fd fd(LS_SYSCHECK_MSG(::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600), who_,
                            ": cannot create the shared-memory segment ", name_));
      creator_ = true;
      LS_SYSCHECK_MSG(::ftruncate(fd.get(), static_cast<off_t>(bytes_)), who_, ": cannot size ",
                      name_, " to ", bytes_, " bytes");
      // Note [Pages reserved at creation]
      // ftruncate on tmpfs reserves nothing: a /dev/shm too small for the segment (Docker gives a
      // container 64 MiB) would show as SIGBUS in whichever rank first touches a page past the
      // end, in the middle of a collective. posix_fallocate takes every page now, so a shortage
      // is this error, on every rank (they read it through the store), before any collective.
      if (const int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes_)); err != 0) {
        const double mib = static_cast<double>(bytes_) / (1024.0 * 1024.0);
        char need[64];
        std::snprintf(need, sizeof(need), "%.1f MiB", mib);
        LS_THROW(who_, ": cannot reserve the shared-memory segment: ", dev_shm_space(),
                 " and this group of ", size_, " ranks needs ", need, " (", size_, " slots of ",
                 slot_bytes_ >> 10, " KiB) [", errno_text(err),
                 "]. Give /dev/shm more room (docker run --shm-size=1g; Kubernetes: an emptyDir "
                 "with medium: Memory mounted at /dev/shm), or use the gloo backend "
                 "(LOCKSTEP_BACKEND=gloo), which needs no shared memory");
      }
      map(fd);
      Header& h = seg_header();
      h.slot_bytes = static_cast<uint64_t>(slot_bytes_);
      h.total_bytes = bytes_;
      h.size = size_;
      h.magic = kMagic;
    } catch (const Error& e) {
      store.set(name_key, std::string("!") + e.what());
      throw;  // release() unlinks what was created
    }
    store.set(name_key, name_);
  } else {
    wait_keys(store, {name_key}, o.timeout, who_, "rank 0 to create the segment");
    name_ = store.get_string(name_key);
    LS_CHECK(name_.empty() || name_[0] != '!', who_,
             ": rank 0 could not create the group's shared-memory segment: ", name_.substr(1));
    try {
      Fd fd(LS_SYSCHECK_MSG(::shm_open(name_.c_str(), O_RDWR, 0), who_, ": cannot open ", name_));
      struct stat st {};
      LS_SYSCHECK_MSG(::fstat(fd.get(), &st), who_, ": fstat ", name_);
      LS_CHECK(static_cast<size_t>(st.st_size) == bytes_, who_, ": the segment ", name_, " has ",
               st.st_size, " bytes, this rank expected ", bytes_,
               " (every rank must use one slot size and group size)");
      map(fd);
      const Header& h = seg_header();
      LS_CHECK(h.magic == kMagic && h.size == size_ && h.slot_bytes == uint64_t(slot_bytes_), who_,
               ": the segment ", name_, " was made for ", h.size, " ranks with ", h.slot_bytes,
               "-byte slots, this rank expected ", size_, " with ", slot_bytes_);
    } catch (const Error& e) {
      map_error = e.what();
    }
  }
  store.set(key("mapped", rank_), map_error.empty() ? std::to_string(::getpid()) : "!" + map_error);

  std::vector<std::string> mapped_keys;
  for (int r = 0; r < size_; ++r) mapped_keys.push_back(key("mapped", r));
  wait_keys(store, mapped_keys, o.timeout, who_, "every rank to map the segment");
  if (::shm_unlink(name_.c_str()) == 0 || errno == ENOENT) unlinked_ = true;

  std::string first_error = map_error;
  for (int r = 0; r < size_; ++r) {
    const std::string v = store.get_string(mapped_keys[r]);
    if (!v.empty() && v[0] == '!') {
      if (first_error.empty())
        first_error = lockstep::detail::str_cat("rank ", r, ": ", v.substr(1));
      pids_.push_back(0);
    } else {
      pids_.push_back(std::atoi(v.c_str()));
    }
  }
  if (!first_error.empty()) {
    LS_THROW(who_, ": not every rank could map the shared-memory segment (", first_error, ")");
  }
  for (int r = 0; r < size_; ++r) {
    const long pidfd = r == rank_ ? -1 : ::syscall(SYS_pidfd_open, pids_[r], 0);
    pidfds_.emplace_back(static_cast<int>(pidfd));
  }
  next_liveness_ = Clock::now() + kHeartbeat;
}

Segment::~Segment() { release(); }

void Segment::release() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
  base_ = nullptr;
  // A group that failed to form leaves nothing: every rank that learnt the name unlinks it.
  if (!unlinked_ && (creator_ || rank_ != 0) && !name_.empty() && name_[0] == '/')
    ::shm_unlink(name_.c_str());
  unlinked_ = true;
  pidfds_.clear();
}

}  // namespace lockstep::dist::shm

namespace lockstep::dist {

size_t remove_dead_shm_segments() {
  using shm::pid_namespace;
  using shm::segment_creator;
  const uint64_t own_ns = pid_namespace();
  if (own_ns == 0) return 0;  // no /proc: pids cannot be judged
  std::error_code ec;
  std::filesystem::directory_iterator it("/dev/shm", ec);
  if (ec) return 0;
  size_t removed = 0;
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const auto creator = segment_creator(name);
    if (!creator || creator->first != own_ns) continue;
    if (::kill(creator->second, 0) == 0 || errno != ESRCH) continue;  // running (or not ours)
    if (::shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  return removed;
}

}  // namespace lockstep::dist

namespace lockstep::dist::shm {

Segment::Header& Segment::seg_header() const { return *reinterpret_cast<Header*>(base_); }

Segment::Control& Segment::control(int r) const {
  const size_t controls = round_up(sizeof(Header), kLine);
  return reinterpret_cast<Control*>(base_ + controls)[r];
}

uint8_t* Segment::slot(int r) const {
  const size_t controls = round_up(sizeof(Header), kLine);
  const size_t slots = round_up(controls + sizeof(Control) * static_cast<size_t>(size_), kPage);
  return base_ + slots + static_cast<size_t>(slot_stride_) * static_cast<size_t>(r);
}

CallHeader& Segment::header(int r) const { return control(r).call; }

void Segment::arrive() {
  Control& c = control(rank_);
  ++seq_;
  // seq_cst store, then seq_cst load of sleepers: with the waiter's increment of sleepers before
  // its FUTEX_WAIT (which rechecks seq), either this rank sees the sleeper or the sleeper sees the
  // new value (Note [Spin, then futex]).
  std::atomic_ref<uint32_t>(c.seq).store(seq_, std::memory_order_seq_cst);
  if (std::atomic_ref<uint32_t>(c.sleepers).load(std::memory_order_seq_cst) != 0) {
    futex(&c.seq, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

void Segment::wait_all(Clock::time_point deadline, std::chrono::milliseconds timeout) {
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) wait_for(r, deadline, timeout);
  }
}

void Segment::wait_for(int peer, Clock::time_point deadline, std::chrono::milliseconds timeout) {
  Control& c = control(peer);
  std::atomic_ref<uint32_t> seq(c.seq);
  if (reached(seq.load(std::memory_order_acquire), seq_)) return;
  const auto spin_end = Clock::now() + spin_;
  for (int i = 1;; ++i) {
    cpu_relax();
    if (reached(seq.load(std::memory_order_acquire), seq_)) return;
    if ((i & 31) == 0 && Clock::now() >= spin_end) break;
  }
  std::atomic_ref<uint32_t> sleepers(c.sleepers);
  std::atomic_ref<uint32_t> abort(seg_header().abort);
  for (;;) {
    const uint32_t v = seq.load(std::memory_order_acquire);
    if (reached(v, seq_)) return;
    const auto now = Clock::now();
    if (now >= next_liveness_ || abort.load(std::memory_order_acquire) != 0) {
      check_peers();
      next_liveness_ = now + kHeartbeat;
    }
    if (now >= deadline) {
      fail(kFailed, rank_,
           lockstep::detail::str_cat(
               "timed out after ", timeout.count(), " ms waiting for rank ", peer,
               ": a rank did not reach this collective or is far behind; every rank must issue "
               "the same collectives in the same order"));
    }
    const auto left = std::min<Clock::duration>(kHeartbeat, deadline - now);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    const timespec ts{static_cast<time_t>(ns / 1'000'000'000),
                      static_cast<long>(ns % 1'000'000'000)};
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    futex(&c.seq, FUTEX_WAIT, v, &ts);  // EAGAIN (moved on), EINTR, ETIMEDOUT: look again
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void Segment::check_peers() {
  int dead = -1;
  for (int r = 0; r < size_ && dead < 0; ++r) {
    if (r == rank_) continue;
    if (pidfds_[r]) {
      // A pidfd becomes readable when its process ends (zombies included, reused pids excluded).
      pollfd p{pidfds_[r].get(), POLLIN, 0};
      if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP)) != 0) dead = r;
    } else if (::kill(pids_[r], 0) == -1 && errno == ESRCH) {
      dead = r;
    }
  }
  // After the scan: a rank that failed records the culprit before it exits, so a rank found
  // gone may just have been the first to give up; the record names who really died or failed.
  check_poisoned();
  if (dead >= 0) {
    fail(kDied, dead,
         lockstep::detail::str_cat("rank ", dead, " (pid ", pids_[dead],
                                   ") died while this rank waited for it: its process exited or "
                                   "crashed; see its own error or exit status"));
  }
}

void Segment::check_poisoned() const {
  const uint32_t word =
      std::atomic_ref<uint32_t>(seg_header().abort).load(std::memory_order_acquire);
  if (word != 0) throw PeerFailure(describe_abort(word), __FILE__, __LINE__);
}

std::string Segment::describe_abort(uint32_t word) const {
  const int culprit = static_cast<int>(word & 0xffff) - 1;
  if ((word >> 16) == kDied) {
    return lockstep::detail::str_cat("rank ", culprit, " (pid ", pids_[culprit],
                                     ") died: its process exited or crashed; see its own error or "
                                     "exit status");
  }
  return lockstep::detail::str_cat("rank ", culprit,
                                   " failed first (its own error says why), so this group cannot "
                                   "go on");
}

void Segment::fail(uint32_t reason, int culprit, const std::string& message) {
  uint32_t expected = 0;
  std::atomic_ref<uint32_t>(seg_header().abort)
      .compare_exchange_strong(expected, reason << 16 | static_cast<uint32_t>(culprit + 1));
  wake_all();
  throw PeerFailure(message, __FILE__, __LINE__);
}

void Segment::poison() {
  if (base_ == nullptr) return;
  uint32_t expected = 0;
  std::atomic_ref<uint32_t>(seg_header().abort)
      .compare_exchange_strong(expected, kFailed << 16 | static_cast<uint32_t>(rank_ + 1));
  wake_all();
}

void Segment::wake_all() {
  for (int r = 0; r < size_; ++r) futex(&control(r).seq, FUTEX_WAKE, INT_MAX, nullptr);
}

}  // namespace lockstep::dist::shm
