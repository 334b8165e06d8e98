// Storage: a block of memory shared by a tensor and all of its views.
#pragma once

#include <cstddef>
#include <memory>

#include "lockstep/tensor/allocator.h"
#include "lockstep/tensor/device.h"

namespace lockstep {

class StorageImpl {
 public:
  // Owned memory from `alloc`.
  StorageImpl(size_t nbytes, Allocator* alloc);
  // Borrowed memory: the caller keeps it alive as long as any tensor uses it.
  StorageImpl(void* data, size_t nbytes, Device device);
  // Borrowed memory kept alive by `owner` (another storage whose memory this one names).
  StorageImpl(void* data, size_t nbytes, Device device, std::shared_ptr<const void> owner);
  ~StorageImpl();
  StorageImpl(const StorageImpl&) = delete;
  StorageImpl& operator=(const StorageImpl&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  bool owned() const { return alloc_ != nullptr; }
  // Owned storage only: frees the memory and takes a fresh block of `nbytes` (contents not kept;
  // 0 leaves none, data() null). Every tensor and view on this storage sees the new block: what
  // FSDP does to a unit's parameters between uses (Note [FSDP] in
  // src/distributed/sharding/fsdp.cpp).
  void reset(size_t nbytes);

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Allocator* alloc_ = nullptr;
  Device device_;
  std::shared_ptr<const void> owner_;
};

using Storage = std::shared_ptr<StorageImpl>;

}  // namespace lockstep
