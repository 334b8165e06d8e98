// errno's text and the owning file descriptor (include/lockstep/base/syscall.h).
#include "lockstep/base/syscall.h"

#include <string.h>
#include <unistd.h>

namespace lockstep {

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns the message (possibly not in buf).
  const char* msg = strerror_r(err, buf, sizeof buf);
  return std::string(msg) + " (errno " + std::to_string(err) + ")";
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

}  // namespace lockstep
