// Choosing what the transport binds to: which local address reaches a host, which network
// interfaces exist.
#include "distributed/bind_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/socket.h>

#include <memory>
#include <set>
#include <vector>

#include "lockstep/base/error.h"
#include "lockstep/base/syscall.h"
#include "lockstep/base/worker_env.h"

namespace lockstep::dist {

// connect() on a UDP socket sends nothing; it only asks the kernel's routing table for the
// source address, which getsockname() then reports.
std::string local_address_toward(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
  LS_CHECK(rc == 0, "cannot resolve '", host, "': ", ::gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owner(found, &::freeaddrinfo);
  std::string last_error;
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd.valid() || ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      last_error = errno_text(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0) {
      last_error = errno_text(errno);
      continue;
    }
    char text[INET6_ADDRSTRLEN] = {};
    const void* addr =
        local.ss_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
    if (::inet_ntop(local.ss_family, addr, text, sizeof(text)) != nullptr) return text;
  }
  LS_THROW("no local address routes to ", host, ":", port, " (", last_error, "); set ",
           env::kSocketIfname, " to an interface or address that reaches it");
}

namespace detail {

namespace {

// "10.0.0.5" or "fe80::1" (not a host name).
bool is_ip_address(const std::string& s) {
  in6_addr buf{};
  return ::inet_pton(AF_INET, s.c_str(), &buf) == 1 || ::inet_pton(AF_INET6, s.c_str(), &buf) == 1;
}

// For an error message only: empty when the list cannot be read.
std::vector<std::string> interface_names() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::unique_ptr<ifaddrs, decltype(&::freeifaddrs)> owner(list, &::freeifaddrs);
  std::set<std::string> names;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) names.insert(i->ifa_name);
  return {names.begin(), names.end()};
}

// Throws, listing the machine's interfaces, when `name` is not one of them.
void check_interface(const std::string& name) {
  if (::if_nametoindex(name.c_str()) != 0) return;
  std::string known;
  for (const auto& n : interface_names()) known += (known.empty() ? "" : ", ") + n;
  LS_THROW(env::kSocketIfname, "=", name,
           ": no such network interface on this machine; it has: ", known);
}

}  // namespace

BindChoice choose_bind(const DistEnv& env) {
  if (env.socket_ifname.empty()) {
    return {local_address_toward(env.master_addr, env.master_port), ""};
  }
  if (is_ip_address(env.socket_ifname)) return {env.socket_ifname, ""};
  check_interface(env.socket_ifname);
  return {"", env.socket_ifname};
}

}  // namespace detail
}  // namespace lockstep::dist
