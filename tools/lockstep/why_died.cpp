// Note [Out-of-memory evidence] in why_died.h.
#include "why_died.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "lockstep/base/syscall.h"

namespace lockstep::launch {

namespace {

bool readable(const std::string& path) { return ::access(path.c_str(), R_OK) == 0; }

// The value after `key ` on a line of `path` ("oom_kill 3"), or nullopt.
std::optional<int64_t> keyed_value(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key + " ", 0) != 0) continue;
    try {
      return std::stoll(line.substr(key.size() + 1));
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<OomCounter> find_oom_counter() {
  std::ifstream in("/proc/self/cgroup");
  std::string v2_path, v1_path;
  bool has_v1 = false;
  // "0::/path" (v2) or "4:memory:/path" (v1; the controllers are a comma-separated list).
  for (std::string line; std::getline(in, line);) {
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty()) v2_path = path;
    std::stringstream list(controllers);
    for (std::string c; std::getline(list, c, ',');) {
      if (c == "memory") {
        v1_path = path;
        has_v1 = true;
      }
    }
  }
  std::vector<std::string> candidates;
  if (has_v1) candidates.push_back("/sys/fs/cgroup/memory" + v1_path + "/memory.oom_control");
  if (!v2_path.empty()) {
    // The unified hierarchy at /sys/fs/cgroup, or beside the v1 ones (a "hybrid" layout).
    candidates.push_back("/sys/fs/cgroup" + v2_path + "/memory.events");
    candidates.push_back("/sys/fs/cgroup/unified" + v2_path + "/memory.events");
  }
  for (auto& c : candidates) {
    // "//memory.events" for the root cgroup: harmless, but said plainly.
    for (auto p = c.find("//"); p != std::string::npos; p = c.find("//")) c.erase(p, 1);
    if (readable(c) && keyed_value(c, "oom_kill")) return OomCounter{c};
  }
  return std::nullopt;
}

std::optional<int64_t> read_oom_kills(const OomCounter& c) {
  return keyed_value(c.file, "oom_kill");
}

std::string kernel_log_oom_line(pid_t pid) {
  // Each read of /dev/kmsg returns one record; O_NONBLOCK ends the walk at the newest one.
  const int fd = ::open("/dev/kmsg", O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return "";
  const Fd guard(fd);
  const std::string needle = "Killed process " + std::to_string(pid) + " ";
  std::string found;
  char buf[8192];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EPIPE) continue;  // a record was overwritten while we read: go on
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    const std::string rec(buf, static_cast<size_t>(n));
    if (rec.find(needle) == std::string::npos) continue;
    // "6,1234,5678,-;Out of memory: Killed process ...": the text after ';', first line only.
    const auto semi = rec.find(';');
    found = rec.substr(semi == std::string::npos ? 0 : semi + 1);
    found = found.substr(0, found.find('\n'));
  }
  return found;
}

std::optional<int64_t> mem_available_kib() { return keyed_value("/proc/meminfo", "MemAvailable:"); }

std::string format_kib(int64_t kib) {
  char buf[32];
  if (kib < 1024) {
    std::snprintf(buf, sizeof buf, "%lld KiB", static_cast<long long>(kib));
  } else if (kib < 1024 * 1024) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", kib / 1024.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", kib / (1024.0 * 1024.0));
  }
  return buf;
}

}  // namespace lockstep::launch
