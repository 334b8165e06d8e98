// The kernel table (Note [Kernel tables] in src/ops/kernels.h): every front finds its kernel by
// device, and a device without a kernel is an error naming the op and the device, before any
// data is touched.
#include <cstring>

#include "lockstep/tensor/cuda.h"
#include "ops/kernels.h"  // internal to the library: test_ops has src/ on its include path
#include "testing.h"

using namespace lockstep;
using lockstep::detail::Kernels;
using lockstep::testing::expect_error;

namespace {

// A tensor that claims to live on cuda:0, over host memory that nothing may read.
Tensor fake_cuda(std::vector<float>& buf, const Dims& shape) {
  return borrow(buf.data(), shape, kFloat32, cuda_device(0));
}

}  // namespace

TEST(KernelTable, CpuTableHasEveryCoreKernel) {
  const Kernels* cpu = detail::kernels_of(DeviceType::cpu);
  ASSERT_NE(cpu, nullptr);
  EXPECT_NE(cpu->copy, nullptr);
  EXPECT_NE(cpu->fill, nullptr);
  EXPECT_NE(cpu->arange, nullptr);
  EXPECT_NE(cpu->rand_uniform, nullptr);
  EXPECT_NE(cpu->rand_normal, nullptr);
  EXPECT_NE(cpu->randint, nullptr);
  EXPECT_NE(cpu->binary, nullptr);
  EXPECT_NE(cpu->binary_scalar, nullptr);
  EXPECT_NE(cpu->compare, nullptr);
  EXPECT_NE(cpu->compare_scalar, nullptr);
  EXPECT_NE(cpu->unary, nullptr);
  EXPECT_NE(cpu->unary_backward, nullptr);
  EXPECT_NE(cpu->where, nullptr);
  EXPECT_NE(cpu->binary_inplace, nullptr);
  EXPECT_NE(cpu->sum, nullptr);
  EXPECT_NE(cpu->var, nullptr);
  EXPECT_NE(cpu->extreme, nullptr);
  EXPECT_NE(cpu->index_bounds, nullptr);
  EXPECT_NE(cpu->index_select, nullptr);
  EXPECT_NE(cpu->index_add, nullptr);
  EXPECT_NE(cpu->gather, nullptr);
  EXPECT_NE(cpu->scatter_add, nullptr);
  EXPECT_NE(cpu->softmax, nullptr);
  EXPECT_NE(cpu->softmax_backward, nullptr);
  EXPECT_NE(cpu->dropout_mask, nullptr);
  EXPECT_NE(cpu->masked_scale, nullptr);
  EXPECT_NE(cpu->attention, nullptr);
  EXPECT_NE(cpu->attention_backward, nullptr);
}

TEST(KernelTable, TheCpuKernelIsTheOneTheTableHolds) {
  const auto binary = detail::kernel(&Kernels::binary, kCPU, "add");
  EXPECT_EQ(binary, detail::kernels_of(DeviceType::cpu)->binary);
  Tensor a = from_vector<float>({1, 2, 3}, {3}), b = from_vector<float>({10, 20, 30}, {3});
  Tensor out = empty({3});
  binary(detail::BinaryOp::sub, out, a, b, 2.0);
  EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{-19, -38, -57}));
}

TEST(KernelTable, AMissingKernelNamesTheOpAndTheDevice) {
  expect_error([] { detail::throw_no_kernel("softmax", cuda_device(1), /*device_has_table=*/true); },
               {"softmax", "no kernel for cuda:1"});
  expect_error([] { detail::throw_no_kernel("add", cuda_device(0), /*device_has_table=*/false); },
               {"add", "cuda:0", "no cuda:0 support"});
  if (cuda::compiled_with_cuda()) GTEST_SKIP() << "this build has a CUDA table";
  EXPECT_EQ(detail::kernels_of(DeviceType::cuda), nullptr);
  expect_error([] { (void)detail::kernel(&Kernels::binary, cuda_device(0), "add"); },
               {"add: tensor on cuda:0", "no cuda:0 support"});
}

// What a user of a CPU-only build sees for a tensor on cuda:0: each op fails through its kernel
// lookup, naming itself and the device.
TEST(KernelTable, OpsOnADeviceWithoutKernelsFailNamingOpAndDevice) {
  if (cuda::compiled_with_cuda())
    GTEST_SKIP() << "this build has CUDA kernels, which would run on the borrowed host memory; "
                    "tests/cuda/ checks ops on cuda:0";
  expect_error([] { (void)empty({2}, cuda_device(0)); }, {"cuda:0", "CUDA"});
  expect_error([] { (void)zeros({2}).to(cuda_device(0)); }, {"to(cuda:0)", "no cuda:0 support"});
  std::vector<float> buf(6, std::nanf(""));
  const Tensor x = fake_cuda(buf, {2, 3});
  const Tensor idx = borrow(buf.data(), {1}, kInt64, cuda_device(0));
  Generator gen(0);
  const std::vector<std::pair<const char*, std::function<void()>>> cases = {
      {"add", [&] { (void)add(x, x); }},
      {"mul", [&] { (void)mul(x, 2.0); }},
      {"lt", [&] { (void)lt(x, x); }},
      {"eq", [&] { (void)eq(x, 0.0); }},
      {"relu", [&] { (void)relu(x); }},
      {"exp", [&] { (void)exp(x); }},
      {"where", [&] { (void)where(x, x, x); }},
      {"sum", [&] { (void)sum(x); }},
      {"mean", [&] { (void)mean(x, {1}); }},
      {"var", [&] { (void)var(x); }},
      {"max", [&] { (void)max(x, 1); }},
      {"cat", [&] { (void)cat({x, x}); }},
      {"index_select", [&] { (void)index_select(x, 0, idx); }},
      {"gather", [&] { (void)gather(x, 1, borrow(buf.data(), {2, 1}, kInt64, cuda_device(0))); }},
      {"softmax", [&] { (void)softmax(x, 1); }},
      {"log_softmax", [&] { (void)log_softmax(x, 1); }},
      {"dropout", [&] { (void)dropout(x, 0.5, true, gen); }},
      {"embedding", [&] { (void)embedding(x, idx); }},
      {"clone", [&] { (void)x.clone(); }},
      {"to", [&] { (void)x.to(kFloat64); }},
      {"fill_", [&] { Tensor y = x; y.fill_(1.0); }},
      {"add_", [&] { Tensor y = x; y.add_(x); }},
      {"copy_", [&] { Tensor y = zeros({2, 3}); y.copy_(x); }},
  };
  for (const auto& [op, run] : cases) {
    SCOPED_TRACE(op);
    expect_error(run, {std::string(op) + ": ", "cuda:0"});
  }
}
