// System calls: LS_SYSCHECK (the one check for calls that fail with -1 and errno), errno's text,
// Fd, the one owning file descriptor, and the durable write's pieces (write_all, fsync_directory).
#pragma once

#include <cerrno>
#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>

#include "lockstep/base/error.h"

struct stat;  // <sys/stat.h>, for open_regular_file

namespace lockstep {

// "Connection refused (errno 111)".
std::string errno_text(int err);

namespace detail {
inline bool errno_in(int err, std::initializer_list<int> allowed) {
  for (int a : allowed)
    if (err == a) return true;
  return false;
}
}  // namespace detail

// Calls f() again while it fails with EINTR (a signal arrived during a blocking call); returns
// its last result with errno intact, for LS_SYSCHECK_MSG to check.
template <typename F>
auto retry_on_eintr(const F& f) {
  for (;;) {
    auto r = f();
    if (r != -1 || errno != EINTR) return r;
  }
}

// Writes all of `s` to `fd`, going on after short writes and EINTR. Output to a terminal or a
// pipe is best effort: a descriptor that fails (a closed terminal, a reader gone) ends the write
// and returns false, and never throws, so losing the screen never stops a training run.
bool write_best_effort(int fd, std::string_view s);

// Writes all n bytes at `data` to `fd`, going on after short writes and EINTR. A failure throws
// "<what>: <errno text>", where `what` says what was being written ("save_safetensors: writing
// x.tmp"); a write that makes no progress throws "<what> wrote nothing".
void write_all(int fd, const void* data, size_t n, const std::string& what);

// Fsyncs the directory `dir`: a file created or renamed there is durable only once the directory
// entry is on disk too. `who` begins the message of a failure ("save_safetensors").
void fsync_directory(const std::string& dir, const std::string& who);
// The directory that holds `path` ("." for a bare file name), for fsync_directory.
std::string parent_directory(const std::string& path);

// Owns one file descriptor; closes it on destruction (errors from close are ignored there: a
// destructor never throws). close() reports them for callers that must know (a file written
// through the descriptor).
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  explicit operator bool() const { return valid(); }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  // Closes now, ignoring errors.
  void reset();
  // Closes now and returns close()'s result (-1 with errno set on failure).
  int close();

 private:
  int fd_ = -1;
};

// A file written whole or not at all: the bytes go to a temporary file beside `path` (named with
// the pid and a counter, so concurrent writers, from other processes or threads, never share
// one), and commit() fsyncs and closes it, renames it to `path` and fsyncs the directory, so that
// `path` is either the old file or the whole new one, even across a crash. Destroyed without
// commit() (an exception on the way), it removes the temporary file. `who` begins every message
// ("save_safetensors: writing x.tmp.12.0: No space left on device (errno 28)").
class AtomicFile {
 public:
  AtomicFile(std::string path, std::string who);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t n);
  void commit();

 private:
  std::string path_, who_, tmp_;
  Fd fd_;
  bool committed_ = false;
};

// Opens `path` for reading and returns it only when it is a regular file; else throws
// "<context>cannot open <what>: <errno>" or "<context><what>: expected a regular file, found a
// FIFO" (or a directory, a device), where `what` names the file ("token file x.tokens"); a
// socket fails at the open ("No such device or address").
// The open does not block: a FIFO with no writer would otherwise hang the reader before any
// check could run (O_NONBLOCK at open, cleared again on the regular file). `st` receives the
// file's fstat when given.
Fd open_regular_file(const std::string& path, const std::string& what,
                     const std::string& context = "", struct stat* st = nullptr);
// "a FIFO", "a directory", ... for a message about a file that is not what was expected.
std::string file_type_text(unsigned mode);

}  // namespace lockstep

// LS_SYSCHECK(call, ALLOWED_ERRNO...): evaluates a system call that reports failure as -1 plus
// errno, throws lockstep::Error naming the call and errno's text, and returns its result. A
// failure with one of the allowed errno values (EAGAIN, EINTR, ...) is returned as -1 with errno
// intact, for the caller to handle.
#define LS_SYSCHECK(call, ...)                                                           \
  [&]() {                                                                                \
    auto ls_result_ = (call);                                                            \
    const int ls_errno_ = errno;                                                         \
    LS_CHECK(ls_result_ != -1 || ::lockstep::detail::errno_in(ls_errno_, {__VA_ARGS__}), \
             #call " failed: ", ::lockstep::errno_text(ls_errno_));                      \
    errno = ls_errno_;                                                                   \
    return ls_result_;                                                                   \
  }()

// LS_SYSCHECK_MSG(call, message...): as LS_SYSCHECK, with the caller's words (what was being done,
// to which file) before errno's text: "cannot open data/x.idx: No such file or directory (errno
// 2)".
#define LS_SYSCHECK_MSG(call, ...)                                                    \
  [&]() {                                                                             \
    auto ls_result_ = (call);                                                         \
    const int ls_errno_ = errno;                                                      \
    LS_CHECK(ls_result_ != -1, __VA_ARGS__, ": ", ::lockstep::errno_text(ls_errno_)); \
    errno = ls_errno_;                                                                \
    return ls_result_;                                                                \
  }()
