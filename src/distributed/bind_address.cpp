// Choosing what the transport binds to: which local address reaches a host, which network
// interfaces exist.
#include "distributed/bind_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/socket.h>

#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "lockstep/base/error.h"
#include "lockstep/base/log.h"
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

namespace {

// 127.0.0.0/8, ::1, or ::ffff:127.x.y.z.
bool is_loopback(const sockaddr* a) {
  if (a->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr) >> 24) == 127;
  }
  if (a->sa_family != AF_INET6) return false;
  const in6_addr& v6 = reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr;
  return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
}

// The first address `host` resolves to when every one is a loopback address, else ""; nullopt
// when it does not resolve.
std::optional<std::string> loopback_only(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return std::nullopt;
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owner(found, &::freeaddrinfo);
  std::string first;
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    if (!is_loopback(ai->ai_addr)) return "";
    if (!first.empty()) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const void* addr =
        ai->ai_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(ai->ai_addr)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(ai->ai_addr)->sin6_addr);
    if (::inet_ntop(ai->ai_family, addr, text, sizeof(text)) != nullptr) first = text;
  }
  return first;
}

}  // namespace

std::string store_listen_address(const DistEnv& env) {
  const std::optional<std::string> loopback = loopback_only(env.master_addr);
  if (loopback && !loopback->empty()) return *loopback;
  // A rank that cannot resolve MASTER_ADDR fails connecting, naming that cause; rank 0 hosts the
  // store whatever the name, so it judges it as another machine's.
  if (!loopback && env.rank != 0) return "";
  if (env.store_token && !env.store_token->empty()) return "";
  if (env.store_insecure) {
    if (env.rank == 0) {
      log_warning(env::kStoreInsecure, "=1: rank 0's store listens on every interface of this "
                  "machine without a token (", env::kMasterAddr, "=", env.master_addr, ", port ",
                  env.master_port, "); whoever reaches that port can read the job's keys and stop "
                  "it. Use this only on a network you trust.");
    }
    return "";
  }
  LS_THROW("rank ", env.rank, ": rank 0 would host the rendezvous store on every interface (",
           env::kMasterAddr, "=", env.master_addr, " is not a loopback address) with no token, and "
           "whoever reaches port ", env.master_port, " could read the job's keys and stop it. Give "
           "every rank the same secret: on a cluster, once, `head -c 32 /dev/urandom | base64 > "
           "~/.lockstep-token && chmod 600 ~/.lockstep-token` (a file on the shared file system), "
           "then `export ", env::kStoreTokenFile, "=~/.lockstep-token` before srun or mpirun; or "
           "export ", env::kStoreToken, "=<secret>, which they pass on; or start the job with "
           "`lockstep run`, which makes one. On a network you trust, ", env::kStoreInsecure,
           "=1 runs without a token");
}

}  // namespace detail
}  // namespace lockstep::dist
