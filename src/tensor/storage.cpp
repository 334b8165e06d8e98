// StorageImpl: owned (allocator) or borrowed memory.
#include "lockstep/tensor/storage.h"

namespace lockstep {

StorageImpl::StorageImpl(size_t nbytes, Allocator* alloc)
    : nbytes_(nbytes), alloc_(alloc), device_(alloc->device()) {
  data_ = alloc->allocate(nbytes);
}

StorageImpl::StorageImpl(void* data, size_t nbytes, Device device)
    : data_(data), nbytes_(nbytes), device_(device) {}

StorageImpl::StorageImpl(void* data, size_t nbytes, Device device,
                         std::shared_ptr<const void> owner)
    : data_(data), nbytes_(nbytes), device_(device), owner_(std::move(owner)) {}

StorageImpl::~StorageImpl() {
  if (alloc_) alloc_->deallocate(data_, nbytes_);
}

}  // namespace lockstep
