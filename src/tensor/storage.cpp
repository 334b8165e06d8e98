// StorageImpl: owned (allocator) or borrowed memory.
#include "lockstep/tensor/storage.h"

#include "lockstep/base/error.h"

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

void StorageImpl::reset(size_t nbytes) {
  LS_CHECK(alloc_ != nullptr, "StorageImpl::reset: only owned storage can be reset");
  if (data_) alloc_->deallocate(data_, nbytes_);
  data_ = nullptr;
  nbytes_ = 0;
  if (nbytes > 0) data_ = alloc_->allocate(nbytes);
  nbytes_ = nbytes;
}

StorageImpl::~StorageImpl() {
  if (alloc_) alloc_->deallocate(data_, nbytes_);
}

}  // namespace lockstep
