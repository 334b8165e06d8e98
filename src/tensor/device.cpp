// Device parsing (cuda_available() and cuda_device_count() live with the runtime).
#include "lockstep/tensor/device.h"

#include <string>

#include "lockstep/base/error.h"

namespace lockstep {

Device Device::parse(std::string_view s) {
  if (s == "cpu") return kCPU;
  if (s == "cuda") return Device(DeviceType::cuda, 0);
  if (s.substr(0, 5) == "cuda:" && s.size() > 5) {
    int idx = 0;
    for (char c : s.substr(5)) {
      LS_CHECK(c >= '0' && c <= '9', "invalid device '", std::string(s),
               "': expected cpu, cuda or cuda:N");
      idx = idx * 10 + (c - '0');
    }
    return Device(DeviceType::cuda, idx);
  }
  LS_THROW("invalid device '", std::string(s), "': expected cpu, cuda or cuda:N");
}

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}


}  // namespace lockstep
