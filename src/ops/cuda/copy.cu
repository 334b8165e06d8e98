// CUDA copies (between devices, between a device and the host, with dtype conversion) and fill.
#include <cmath>
#include <cstring>

#include "ops/cpu/kernels.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/loops.cuh"

namespace lockstep::cuda_ops {

using namespace lockstep::cuda;

namespace {

// Note [CUDA copies]
// A copy moves bytes in the source's dtype and converts on the destination device, so the bus
// carries the narrower side only when the source is narrower; a strided source is made
// contiguous on its own device first.
// - Host to device: a pinned source (pin_memory()) goes straight to cudaMemcpyAsync on the
//   current stream and its block is fenced so it is not reused before the copy has read it; a
//   pageable source is first copied into a pinned staging block, so the host returns at once and
//   the copy runs asynchronously in either case. The staging block returns to its pool when the
//   stream has passed the copy (an event), never before.
// - Device to host: asynchronous into pinned memory, then the stream is synchronized, because
//   the caller reads the host tensor right after (as PyTorch's .cpu()).
// - Device to device: cudaMemcpyAsync when both are contiguous of one dtype, otherwise the
//   elementwise conversion kernel; across devices, cudaMemcpyPeerAsync after the source's
//   stream has passed its producer.

template <typename To, typename From>
struct ConvertOp {
  __device__ To operator()(From v) const { return convert<To>(v); }
};

template <typename T>
struct ConstantOp {
  T v;
  __device__ T operator()() const { return v; }
};

void convert_on_device(const Tensor& dst, const Tensor& src) {
  dispatch_all(dst.dtype(), "copy_", [&]<typename To>() {
    dispatch_all(src.dtype(), "copy_", [&]<typename From>() {
      map<To, From>("copy_", dst, ConvertOp<To, From>{}, src);
    });
  });
}

bool plain(const Tensor& dst, const Tensor& src) {
  return dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous();
}

void device_to_device(const Tensor& dst, const Tensor& src) {
  if (dst.device() == src.device()) {
    TensorDeviceGuard guard(dst);
    if (plain(dst, src)) {
      LS_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(),
                                    static_cast<size_t>(dst.nbytes()), cudaMemcpyDeviceToDevice,
                                    current_cuda_stream()));
      return;
    }
    convert_on_device(dst, src);
    return;
  }
  // Across devices: the source, contiguous in its dtype, travels to a buffer on dst's device.
  Tensor s = src.contiguous();
  Event ready;
  {
    DeviceGuard g(src.device().index);
    ready.record(current_stream());
  }
  Tensor target = plain(dst, s) ? dst : empty(s.shape(), TensorOptions(s.dtype()).with_device(
                                                             dst.device()));
  TensorDeviceGuard guard(dst);
  ready.wait(current_stream());
  LS_CUDA_CHECK(cudaMemcpyPeerAsync(target.data_ptr(), dst.device().index, s.data_ptr(),
                                    src.device().index, static_cast<size_t>(s.nbytes()),
                                    current_cuda_stream()));
  // The source's block belongs to another device's allocator, which cannot fence it on this
  // stream: wait for the copy (copies across devices are rare: DataParallel's scatter and
  // gather).
  LS_CUDA_CHECK(cudaStreamSynchronize(current_cuda_stream()));
  if (!target.is_same(dst)) convert_on_device(dst, target);
}

void host_to_device(const Tensor& dst, const Tensor& src) {
  Tensor s = src.contiguous();
  const size_t nbytes = static_cast<size_t>(s.nbytes());
  TensorDeviceGuard guard(dst);
  cudaStream_t stream = current_cuda_stream();
  Tensor target = plain(dst, s) ? dst : empty(s.shape(), TensorOptions(s.dtype()).with_device(
                                                             dst.device()));
  if (is_pinned(s.storage()->data())) {
    LS_CUDA_CHECK(cudaMemcpyAsync(target.data_ptr(), s.data_ptr(), nbytes,
                                  cudaMemcpyHostToDevice, stream));
    fence_pinned(s.storage()->data(), stream);
  } else {
    void* staging = alloc_pinned(nbytes);
    std::memcpy(staging, s.data_ptr(), nbytes);
    cudaError_t err = cudaMemcpyAsync(target.data_ptr(), staging, nbytes, cudaMemcpyHostToDevice,
                                      stream);
    free_pinned(staging, stream);
    LS_CUDA_CHECK(err);
  }
  if (!target.is_same(dst)) convert_on_device(dst, target);
}

void device_to_host(const Tensor& dst, const Tensor& src) {
  Tensor s = src.contiguous();
  const size_t nbytes = static_cast<size_t>(s.nbytes());
  TensorDeviceGuard guard(s);
  cudaStream_t stream = current_cuda_stream();
  if (plain(dst, s) && is_pinned(dst.storage()->data())) {
    LS_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), s.data_ptr(), nbytes, cudaMemcpyDeviceToHost,
                                  stream));
    LS_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  void* staging = alloc_pinned(nbytes);
  cudaError_t err =
      cudaMemcpyAsync(staging, s.data_ptr(), nbytes, cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    free_pinned(staging, stream);
    LS_CUDA_CHECK(err);
  }
  Tensor staged = borrow(staging, s.shape(), s.dtype(), kCPU);
  try {
    cpu::copy_kernel(dst, staged);
  } catch (...) {
    free_pinned(staging, stream);
    throw;
  }
  free_pinned(staging, stream);
}

void copy_kernel(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 0) return;
  const bool dst_cuda = dst.device().is_cuda();
  const bool src_cuda = src.device().is_cuda();
  if (dst_cuda && src_cuda) return device_to_device(dst, src);
  if (dst_cuda) return host_to_device(dst, src);
  if (src_cuda) return device_to_host(dst, src);
  cpu::copy_kernel(dst, src);
}

void fill_kernel(const Tensor& dst, double value) {
  if (dst.numel() == 0) return;
  TensorDeviceGuard guard(dst);
  if (value == 0.0 && !std::signbit(value) && dst.is_contiguous()) {
    LS_CUDA_CHECK(cudaMemsetAsync(dst.data_ptr(), 0, static_cast<size_t>(dst.nbytes()),
                                  current_cuda_stream()));
    return;
  }
  dispatch_all(dst.dtype(), "fill_", [&]<typename T>() {
    const T v = convert<T>(value);
    map<T>("fill_", dst, ConstantOp<T>{v});
  });
}

}  // namespace

void fill_tensor_kernels(Kernels& k) {
  k.copy = copy_kernel;
  k.fill = fill_kernel;
}

}  // namespace lockstep::cuda_ops
