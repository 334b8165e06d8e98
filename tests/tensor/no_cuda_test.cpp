// What a build without CUDA says when asked for the GPU: every entry point that needs a device
// throws an Error that says this build has no CUDA support, and the queries answer "none". Runs
// in CPU-only builds (the asan build is one); a CUDA build skips it, saying why. It needs no GPU,
// so it lives here rather than in tests/cuda/ (label `gpu`).
#include "lockstep/tensor/cuda.h"
#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_error;

namespace {

#define LS_REQUIRE_NO_CUDA()                                                              \
  do {                                                                                    \
    if (cuda::compiled_with_cuda())                                                       \
      GTEST_SKIP() << "this build has CUDA support; the no-CUDA errors are checked by "   \
                      "builds configured with LOCKSTEP_CUDA=OFF";                         \
  } while (0)

TEST(NoCuda, QueriesSayNoDevice) {
  LS_REQUIRE_NO_CUDA();
  EXPECT_FALSE(cuda::is_available());
  EXPECT_FALSE(cuda_available());
  EXPECT_EQ(cuda::device_count(), 0);
  EXPECT_EQ(cuda_device_count(), 0);
  EXPECT_EQ(cuda::memory_stats().cuda_mallocs, 0);
  EXPECT_FALSE(cuda::allow_tf32());
}

TEST(NoCuda, CudaTensorThrowsNoCudaSupport) {
  LS_REQUIRE_NO_CUDA();
  expect_error([] { (void)empty({2, 3}, cuda_device(0)); }, {"cuda:0", "no CUDA support"});
  expect_error([] { (void)zeros({2}, TensorOptions(kFloat32).with_device(Device::parse("cuda"))); },
               {"cuda:0", "no CUDA support"});
  expect_error([] { (void)ones({2}).to(cuda_device(0)); }, {"to(cuda:0)", "no cuda:0 support"});
}

TEST(NoCuda, DeviceApiThrowsNoCudaSupport) {
  LS_REQUIRE_NO_CUDA();
  expect_error([] { cuda::set_device(0); }, {"set_device", "no CUDA support"});
  expect_error([] { cuda::synchronize(); }, {"synchronize", "no CUDA support"});
  expect_error([] { (void)cuda::Stream::create(); }, {"Stream::create", "no CUDA support"});
  expect_error([] { cuda::DeviceGuard g(0); }, {"DeviceGuard", "no CUDA support"});
  expect_error([] { cuda::Event e(true); e.record(cuda::Stream()); },
               {"Event::record", "no CUDA support"});
}

}  // namespace
