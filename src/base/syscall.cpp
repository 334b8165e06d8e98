// errno's text and the owning file descriptor (include/lockstep/base/syscall.h).
#include "lockstep/base/syscall.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <string.h>
#include <unistd.h>

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
