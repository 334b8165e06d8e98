// The CUDA device as a user meets it: the caching allocator's statistics over a steady loop,
// empty_cache and the peaks; streams, events and the guards; to(device) both ways, from pageable
// and from pinned host memory; and the errors of ops whose tensors sit on different devices.
#include <vector>

#include "gpu.h"
#include "testing.h"

#ifdef LOCKSTEP_WITH_CUDA
#include "tensor/cuda/runtime.h"
#endif

using namespace lockstep;
using lockstep::testing::expect_error;
using lockstep::testing::gpu;

namespace {

TensorOptions on_gpu(DType dt = kFloat32) { return TensorOptions(dt).with_device(gpu()); }

// One training-like step: forward, loss, backward, an update. Everything it allocates is freed
// by the end of the step, so a second step finds every block it needs in the cache.
void step(Tensor& w, const Tensor& x) {
  Tensor loss = mean(relu(matmul(x, w)) * 0.5);
  loss.backward();
  {
    autograd::NoGradGuard no_grad;
    w.add_(w.grad(), -0.1);
  }
  w.set_grad(Tensor());
}

TEST(CudaAllocator, SteadyLoopCallsCudaMallocOnlyInItsFirstStep) {
  LS_REQUIRE_GPU();
  Generator gen(1);
  Tensor w = randn({256, 128}, gen, on_gpu()).requires_grad_();
  const Tensor x = randn({64, 256}, gen, on_gpu());
  step(w, x);
  cuda::synchronize();
  const cuda::MemoryStats after_first = cuda::memory_stats();
  for (int i = 0; i < 10; ++i) step(w, x);
  cuda::synchronize();
  const cuda::MemoryStats after = cuda::memory_stats();
  EXPECT_EQ(after.cuda_mallocs, after_first.cuda_mallocs)
      << "a steady step must reuse cached blocks";
  EXPECT_GT(after.allocations, after_first.allocations);
  EXPECT_EQ(after.allocated_bytes, after_first.allocated_bytes) << "a step leaks device memory";
}

TEST(CudaAllocator, EmptyCacheReturnsCachedBlocks) {
  LS_REQUIRE_GPU();
  cuda::synchronize();
  const int64_t before = cuda::memory_stats().allocated_bytes;
  {
    std::vector<Tensor> big;
    for (int i = 0; i < 4; ++i) big.push_back(zeros({8 << 20}, on_gpu()));  // 32 MiB each
    cuda::synchronize();
    const cuda::MemoryStats s = cuda::memory_stats();
    EXPECT_GE(s.allocated_bytes - before, int64_t{128} << 20);
    EXPECT_GE(s.reserved_bytes, s.allocated_bytes);
  }
  cuda::synchronize();
  const cuda::MemoryStats freed = cuda::memory_stats();
  EXPECT_EQ(freed.allocated_bytes, before) << "freed tensors still count as allocated";
  EXPECT_GE(freed.reserved_bytes - freed.allocated_bytes, int64_t{128} << 20)
      << "freed blocks stay cached (reserved) until empty_cache()";
  const int64_t frees = freed.cuda_frees;
  cuda::empty_cache();
  const cuda::MemoryStats emptied = cuda::memory_stats();
  EXPECT_LE(emptied.reserved_bytes, freed.reserved_bytes - (int64_t{128} << 20));
  EXPECT_GT(emptied.cuda_frees, frees);
  EXPECT_EQ(emptied.allocated_bytes, before);
}

TEST(CudaAllocator, PeakStatsFollowTheLargestFootprint) {
  LS_REQUIRE_GPU();
  cuda::synchronize();
  cuda::reset_peak_stats();
  const cuda::MemoryStats start = cuda::memory_stats();
  EXPECT_EQ(start.peak_allocated_bytes, start.allocated_bytes);
  {
    Tensor a = empty({16 << 20}, on_gpu());  // 64 MiB
    const cuda::MemoryStats s = cuda::memory_stats();
    EXPECT_GE(s.peak_allocated_bytes, start.allocated_bytes + (int64_t{64} << 20));
    EXPECT_GE(s.peak_reserved_bytes, s.reserved_bytes);
  }
  const cuda::MemoryStats after = cuda::memory_stats();
  EXPECT_EQ(after.allocated_bytes, start.allocated_bytes);
  EXPECT_GE(after.peak_allocated_bytes, start.allocated_bytes + (int64_t{64} << 20))
      << "the peak stays after the tensor is freed";
  cuda::reset_peak_stats();
  EXPECT_EQ(cuda::memory_stats().peak_allocated_bytes, after.allocated_bytes);
}

TEST(CudaStreams, StreamGuardMakesAStreamCurrentAndRestoresThePrevious) {
  LS_REQUIRE_GPU();
  const cuda::Stream before = cuda::current_stream();
  const cuda::Stream s = cuda::Stream::create();
  EXPECT_FALSE(s.is_default());
  EXPECT_EQ(s.device(), 0);
  EXPECT_NE(s.handle(), cuda::Stream::default_stream().handle());
  {
    cuda::StreamGuard guard(s);
    EXPECT_TRUE(cuda::current_stream() == s);
    // Work queued here runs on s.
    Tensor x = full({1 << 20}, 2.0, on_gpu());
    Tensor y = x * 3.0;
    s.synchronize();
    EXPECT_TRUE(s.query());
    EXPECT_EQ(sum(y).to(kCPU).item(), 6.0 * (1 << 20));
  }
  EXPECT_TRUE(cuda::current_stream() == before);
}

TEST(CudaStreams, EventOrdersTwoStreamsWithoutBlockingTheHost) {
  LS_REQUIRE_GPU();
  const cuda::Stream producer = cuda::Stream::create();
  const cuda::Stream consumer = cuda::Stream::create();
  Tensor x;
  cuda::Event ready;
  {
    cuda::StreamGuard g(producer);
    x = zeros({4 << 20}, on_gpu());
    for (int i = 0; i < 20; ++i) x.add_(1.0);  // a queue of work for the consumer to wait on
    ready.record(producer);
  }
  Tensor y;
  {
    cuda::StreamGuard g(consumer);
    ready.wait(consumer);
    cuda::record_stream(x, consumer);  // x is read on consumer too
    y = x * 2.0;
  }
  consumer.synchronize();
  EXPECT_TRUE(ready.query());
  EXPECT_EQ(lockstep::max(y).to(kCPU).item(), 40.0);
  EXPECT_EQ(lockstep::min(y).to(kCPU).item(), 40.0);
}

TEST(CudaStreams, TimingEventsMeasureElapsedTime) {
  LS_REQUIRE_GPU();
  cuda::Event start(true), stop(true);
  Tensor a = ones({1024, 1024}, on_gpu());
  start.record();
  for (int i = 0; i < 5; ++i) a = matmul(a, a) * (1.0 / 1024);
  stop.record();
  stop.synchronize();
  EXPECT_TRUE(stop.query());
  EXPECT_GT(stop.elapsed_ms(start), 0.0f);
  cuda::Event moved = std::move(stop);
  EXPECT_TRUE(moved.query());
}

TEST(CudaDevice, DeviceGuardAndSetDevice) {
  LS_REQUIRE_GPU();
  EXPECT_GE(cuda::device_count(), 1);
  EXPECT_TRUE(cuda_available());
  EXPECT_EQ(cuda_device_count(), cuda::device_count());
  const int n = cuda::device_count();
  {
    cuda::DeviceGuard g(n - 1);
    EXPECT_EQ(cuda::current_device(), n - 1);
    // A tensor on plain "cuda" goes to the current device.
    EXPECT_EQ(empty({2}, TensorOptions(Device::parse("cuda"))).device().index, n - 1);
  }
  EXPECT_EQ(cuda::current_device(), 0);
  expect_error([n] { cuda::set_device(n); }, {"set_device", std::to_string(n)});
  expect_error([] { (void)empty({2}, cuda_device(99)); }, {"cuda:99"});
}

TEST(CudaTransfers, ToDeviceAndBackKeepsValuesAndDtype) {
  LS_REQUIRE_GPU();
  Generator gen(3);
  for (DType dt : {kFloat32, kFloat64, DType::bf16, DType::f16, kInt64, DType::i32, DType::u8,
                   DType::b8}) {
    const Tensor host = randint(0, 100, {33, 17}, gen, kInt64).to(dt);
    const Tensor dev = host.to(gpu());
    EXPECT_TRUE(dev.device().is_cuda());
    EXPECT_EQ(dev.dtype(), dt);
    const Tensor back = dev.to(kCPU);
    EXPECT_TRUE(back.device().is_cpu());
    EXPECT_TRUE(equal(back, host)) << dtype_name(dt);
    // A non-contiguous source both ways.
    EXPECT_TRUE(equal(host.t().to(gpu()).to(kCPU), host.t())) << dtype_name(dt);
    EXPECT_TRUE(equal(dev.t().to(kCPU), host.t())) << dtype_name(dt);
  }
  // Large enough to take the asynchronous staged path.
  const Tensor big = randn({64 << 20}, gen);  // 256 MiB
  EXPECT_TRUE(equal(big.to(gpu()).to(kCPU), big));
}

#ifdef LOCKSTEP_WITH_CUDA
TEST(CudaTransfers, PinnedHostMemoryBothWays) {
  LS_REQUIRE_GPU();
  const int64_t n = 1 << 22;
  void* src_mem = cuda::alloc_pinned(n * sizeof(float));
  void* dst_mem = cuda::alloc_pinned(n * sizeof(float));
  ASSERT_TRUE(cuda::is_pinned(src_mem));
  {
    Tensor src = borrow(src_mem, {n}, kFloat32);
    Tensor dst = borrow(dst_mem, {n}, kFloat32);
    Generator gen(8);
    src.copy_(randn({n}, gen));
    const Tensor dev = src.to(gpu());
    dst.copy_(dev * 2.0);  // device to pinned host: complete when copy_ returns
    EXPECT_TRUE(equal(dst, src * 2.0));
    // The same pinned buffer sent again after it was rewritten: the first copy has read it.
    src.fill_(5.0);
    EXPECT_EQ(sum(src.to(gpu())).to(kCPU).item(), 5.0 * n);
  }
  cuda::free_pinned(src_mem, cuda::current_cuda_stream());
  cuda::free_pinned(dst_mem, cuda::current_cuda_stream());
  cuda::synchronize();
}
#endif

TEST(CudaErrors, OpsOnDifferentDevicesNameBoth) {
  LS_REQUIRE_GPU();
  const Tensor a = ones({2, 3});
  const Tensor b = ones({2, 3}, on_gpu());
  expect_error([&] { (void)add(a, b); }, {"add", "cpu", "cuda:0"});
  expect_error([&] { (void)matmul(b, a.t()); }, {"matmul", "cpu", "cuda:0"});
  expect_error([&] { (void)where(gt(a, 0.0), b, b); }, {"where", "cpu", "cuda:0"});
  expect_error([&] { (void)cross_entropy(b, zeros({2}, kInt64)); },
               {"cross_entropy", "cpu", "cuda:0"});
  expect_error([&] { (void)index_select(b, 0, zeros({1}, kInt64)); },
               {"index_select", "cpu", "cuda:0"});
}

TEST(CudaErrors, BadIndexOnTheDeviceIsReportedNotACrash) {
  LS_REQUIRE_GPU();
  const Tensor w = ones({4, 3}, on_gpu());
  const Tensor idx = from_vector<int64_t>({0, 7, 1}, {3}).to(gpu());
  expect_error([&] { (void)index_select(w, 0, idx); }, {"index_select", "7"});
  expect_error([&] { (void)embedding(w, idx); }, {"7"});
  const Tensor t = from_vector<int64_t>({0, 5}, {2}).to(gpu());
  expect_error([&] { (void)cross_entropy(ones({2, 3}, on_gpu()), t); }, {"cross_entropy", "5"});
  // The device is still usable after the refused calls.
  EXPECT_EQ(sum(w).to(kCPU).item(), 12.0);
}

}  // namespace
