// errno's text, the owning file descriptor and the durable write's pieces
// (include/lockstep/base/syscall.h).
#include "lockstep/base/syscall.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <utility>

namespace lockstep {

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns the message (possibly not in buf).
  const char* msg = strerror_r(err, buf, sizeof buf);
  return std::string(msg) + " (errno " + std::to_string(err) + ")";
}

bool write_best_effort(int fd, std::string_view s) {
  while (!s.empty()) {
    const ssize_t n = ::write(fd, s.data(), s.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    s.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

void write_all(int fd, const void* data, size_t n, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = LS_SYSCHECK_MSG(retry_on_eintr([&] { return ::write(fd, p, n); }), what);
    LS_CHECK(w > 0, what, " wrote nothing");
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void fsync_directory(const std::string& dir, const std::string& who) {
  Fd d(LS_SYSCHECK_MSG(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC), who,
                       ": cannot open the directory ", dir, " to fsync it"));
  LS_SYSCHECK_MSG(::fsync(d.get()), who, ": fsync of the directory ", dir, " failed");
}

std::string parent_directory(const std::string& path) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return dir.empty() ? "." : dir;
}

AtomicFile::AtomicFile(std::string path, std::string who)
    : path_(std::move(path)), who_(std::move(who)) {
  static std::atomic<uint64_t> counter{0};
  tmp_ = path_ + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  fd_ = Fd(LS_SYSCHECK_MSG(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644),
                           who_, ": cannot create ", tmp_));
}

AtomicFile::~AtomicFile() {
  if (committed_) return;
  fd_.reset();
  ::unlink(tmp_.c_str());
}

void AtomicFile::write(const void* data, size_t n) {
  write_all(fd_.get(), data, n, who_ + ": writing " + tmp_);
}

void AtomicFile::commit() {
  LS_CHECK(!committed_, who_, ": ", path_, " is already written");
  LS_SYSCHECK_MSG(::fsync(fd_.get()), who_, ": fsync of ", tmp_, " failed");
  LS_SYSCHECK_MSG(fd_.close(), who_, ": closing ", tmp_, " failed");
  LS_SYSCHECK_MSG(::rename(tmp_.c_str(), path_.c_str()), who_, ": renaming ", tmp_, " to ", path_,
                  " failed");
  committed_ = true;
  fsync_directory(parent_directory(path_), who_);  // the rename is durable only now
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

int Fd::close() {
  if (fd_ < 0) return 0;
  const int rc = ::close(fd_);
  fd_ = -1;
  return rc;
}

std::string file_type_text(unsigned mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "something else";
}

Fd open_regular_file(const std::string& path, const std::string& what, const std::string& context,
                     struct stat* st) {
  Fd fd(LS_SYSCHECK_MSG(retry_on_eintr([&] {
                          return ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
                        }),
                        context, "cannot open ", what));
  struct stat local {};
  struct stat& s = st != nullptr ? *st : local;
  LS_SYSCHECK_MSG(::fstat(fd.get(), &s), context, "cannot stat ", what);
  LS_CHECK(S_ISREG(s.st_mode), context, what, ": expected a regular file, found ",
           file_type_text(s.st_mode));
  const int flags = LS_SYSCHECK(::fcntl(fd.get(), F_GETFL));
  LS_SYSCHECK(::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK));
  return fd;
}

}  // namespace lockstep
