// Network interface helpers for choosing what the transport binds to.
#pragma once

#include <string>
#include <vector>

namespace lockstep::dist::detail {

// "10.0.0.5" or "fe80::1" (not a host name).
bool is_ip_address(const std::string& s);
std::vector<std::string> interface_names();
// Throws, listing the machine's interfaces, when `name` is not one of them.
void check_interface(const std::string& name);

}  // namespace lockstep::dist::detail
