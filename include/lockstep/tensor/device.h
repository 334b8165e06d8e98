// Device: where a tensor's storage lives (cpu, or cuda:N when built with CUDA).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace lockstep {

enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  constexpr Device() = default;
  constexpr Device(DeviceType t, int i = 0) : type(t), index(i) {}
  // "cpu", "cuda", "cuda:1"; throws lockstep::Error on anything else.
  static Device parse(std::string_view s);

  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  std::string str() const;
  friend bool operator==(const Device& a, const Device& b) {
    return a.type == b.type && (a.type == DeviceType::cpu || a.index == b.index);
  }
};

inline constexpr Device kCPU{DeviceType::cpu, 0};
inline Device cuda_device(int index = 0) { return Device{DeviceType::cuda, index}; }

// True when lockstep was compiled with CUDA support and a device is present.
bool cuda_available();
int cuda_device_count();

}  // namespace lockstep
