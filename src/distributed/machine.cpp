// Which machine this process runs on: host name and the kernel's boot id; and where a group's
// ranks run.
#include "distributed/machine.h"

#include <unistd.h>

#include <fstream>
#include <map>

#include "lockstep/base/error.h"

namespace lockstep::dist::detail {

using lockstep::detail::str_cat;

std::string machine_identity() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string boot;
  std::getline(in, boot);
  return str_cat(host, " (boot ", boot, ")");
}

std::vector<std::string> exchange_machine_identities(Store& store, const std::string& prefix,
                                                     int rank, int size, const std::string& mine,
                                                     std::chrono::milliseconds timeout,
                                                     const std::string& who) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(str_cat(prefix, r));
  store.set(keys[static_cast<size_t>(rank)], mine);
  try {
    store.wait(keys, timeout);
  } catch (const Error& e) {
    LS_THROW(who, ": waiting for every rank's machine identity through the store: ", e.message());
  }
  std::vector<std::string> identity;
  for (const auto& k : keys) identity.push_back(store.get_string(k));
  return identity;
}

MachineLayout machine_layout(const std::vector<std::string>& identity) {
  const int world = static_cast<int>(identity.size());
  std::vector<std::string> order;  // machines by their first rank
  std::map<std::string, std::vector<int>> ranks;
  for (int r = 0; r < world; ++r) {
    if (ranks.count(identity[r]) == 0) order.push_back(identity[r]);
    ranks[identity[r]].push_back(r);
  }
  MachineLayout l;
  l.machines = std::max<int>(1, static_cast<int>(order.size()));
  l.local_size = world / l.machines;
  l.regular = world % l.machines == 0;
  for (int r = 0; l.regular && r < world; ++r) l.regular = identity[r] == order[r / l.local_size];
  for (const auto& m : order) {
    std::string list;
    for (int r : ranks[m]) list += str_cat(list.empty() ? "" : ",", r);
    l.found += str_cat(l.found.empty() ? "" : "; ", m, ": ranks ", list);
  }
  return l;
}

}  // namespace lockstep::dist::detail
