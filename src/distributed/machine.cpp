// Which machine this process runs on: host name and the kernel's boot id.
#include "distributed/machine.h"

#include <unistd.h>

#include <fstream>

#include "lockstep/base/error.h"

namespace lockstep::dist::detail {

std::string machine_identity() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string boot;
  std::getline(in, boot);
  return lockstep::detail::str_cat(host, " (boot ", boot, ")");
}

}  // namespace lockstep::dist::detail
