// Emulated GPUs (Note [Emulated CUDA devices] in src/tensor/cuda_emulated.cpp): host memory
// behind the device seam, the CPU's kernels less those CUDA lacks, and the nccl backend's
// contract over the CPU transport. ctest runs these as cuda.emulated, with
// LOCKSTEP_TEST_EMULATE_GPUS=2; without it they skip, saying so.
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "distributed/thread_ranks.h"
#include "gpu.h"
#include "lockstep/distributed/checkpoint.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/store/hash_store.h"
#include "ops/kernels.h"
#include "testing.h"

#ifdef LOCKSTEP_WITH_CUDA
#include "ops/cuda/kernels.h"
#endif

using namespace lockstep;
using namespace lockstep::dist;
using namespace std::chrono_literals;

namespace {

#define LS_REQUIRE_EMULATION()                                                                  \
  do {                                                                                          \
    if (!cuda::emulated() || cuda::device_count() < 2)                                          \
      GTEST_SKIP() << "needs 2 emulated GPUs: LOCKSTEP_TEST_EMULATE_GPUS=2 (ctest cuda.emulated)"; \
  } while (0)

std::vector<double> values(const Tensor& t) { return t.to(kCPU).to_vector<double>(); }

TensorOptions on(int device, DType dtype = kFloat32) {
  return TensorOptions(dtype).with_device(cuda_device(device));
}

TEST(Emulated, DevicesAreHostMemoryBehindTheDeviceSeam) {
  LS_REQUIRE_EMULATION();
  EXPECT_TRUE(cuda::is_available());
  EXPECT_EQ(cuda::device_count(), 2);
  const int64_t before = cuda::memory_stats(1).allocated_bytes;
  {
    Tensor x = arange(0.0, 6.0, 1.0, on(1));
    EXPECT_EQ(x.device(), cuda_device(1));
    EXPECT_EQ(values(mul(x, 2.0)), (std::vector<double>{0, 2, 4, 6, 8, 10}));
    EXPECT_GE(cuda::memory_stats(1).allocated_bytes, before + 24);
    EXPECT_GE(cuda::memory_stats(1).peak_allocated_bytes, before + 24);
    // As on a GPU: the host reads a device tensor through a copy, never directly.
    lockstep::testing::expect_error([&] { (void)x.at({0}); },
                                    {"tensor on cuda:1", "copy it with .to(kCPU) first"});
    EXPECT_EQ(x.select(0, 5).item(), 5.0);
    lockstep::testing::expect_error([&] { (void)add(x, full({6}, 1.0, kFloat32)); },
                                    {"cuda:1", "cpu"});
    lockstep::testing::expect_error([&] { (void)add(x, full({6}, 1.0, on(0))); },
                                    {"cuda:1", "cuda:0"});
  }
  EXPECT_EQ(cuda::memory_stats(1).allocated_bytes, before);
  lockstep::testing::expect_error([] { cuda::set_device(2); },
                                  {"expected a device index in [0, 2)", "emulated"});
  cuda::DeviceGuard on1(1);
  EXPECT_EQ(cuda::current_device(), 1);
  cuda::Event start(true), end(true);
  start.record();
  end.record();
  EXPECT_GE(end.elapsed_ms(start), 0.0f);
}

// clip_grad_norm of gradients on a GPU is the norm of the same gradients on the CPU, to the bit,
// and scales them alike: the exact sum (Note [Exact norm]) that lets DDP, ZeRO and FSDP clip
// alike holds wherever the gradient lives. The magnitudes span about 2^40, so a sum of the
// squares in f64, in any order, rounds away bits the exact sum keeps.
TEST(Emulated, ClipGradNormOfDeviceGradientsIsTheCpuNormBitwise) {
  LS_REQUIRE_EMULATION();
  Generator gen(5);
  const Tensor wide = mul(randn({3, 4099}, gen), exp(mul(rand({3, 4099}, gen), 27.7)));
  std::vector<Tensor> host, device;
  for (int64_t i = 0; i < 3; ++i) {
    Tensor g = wide.select(0, i).contiguous();
    Tensor p = zeros({4099}).requires_grad_();
    p.set_grad(g.clone());
    host.push_back(p);
    Tensor q = zeros({4099}, on(0)).requires_grad_();
    q.set_grad(g.to(cuda_device(0)));
    device.push_back(q);
  }
  const double cpu_norm = optim::clip_grad_norm(host, 1.0);
  const double gpu_norm = optim::clip_grad_norm(device, 1.0);
  EXPECT_EQ(std::bit_cast<uint64_t>(gpu_norm), std::bit_cast<uint64_t>(cpu_norm))
      << "cpu " << cpu_norm << ", gpu " << gpu_norm;
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(values(device[i].grad()), values(host[i].grad())) << "parameter " << i;
}

// The nccl backend on emulated GPUs, two ranks as threads, each bound to its own device.
std::vector<std::string> nccl_ranks(const std::function<void(int, ProcessGroupPtr)>& body) {
  return lockstep::testing::run_ranks_with(
      2,
      [](const BackendConfig& c) {
        cuda::set_device(c.rank);
        return create_process_group("nccl", c);
      },
      body, 30s);
}

TEST(Emulated, NcclGroupKeepsNcclsContract) {
  LS_REQUIRE_EMULATION();
  const auto errors = nccl_ranks([](int r, ProcessGroupPtr pg) {
    EXPECT_EQ(pg->backend(), "nccl");
    Tensor x = full({3}, r + 1.0, on(r));
    pg->all_reduce(x)->wait();
    EXPECT_EQ(values(x), (std::vector<double>{3, 3, 3}));
    Tensor gathered = zeros({4}, on(r, kInt64));
    pg->all_gather(gathered, full({2}, r, on(r, kInt64)))->wait();
    EXPECT_EQ(values(gathered), (std::vector<double>{0, 0, 1, 1}));
    // Host tensors, and tensors of the other rank's GPU, are refused as NCCL refuses them:
    // nothing is staged through host memory.
    lockstep::testing::expect_error(
        [&] { pg->all_reduce(full({2}, 1.0, kFloat32)); },
        {"(nccl)", "cannot move tensors on cpu", "cuda:" + std::to_string(r) + " only"});
    lockstep::testing::expect_error([&] { pg->broadcast(full({2}, 1.0, on(1 - r))); },
                                    {"(nccl)", "cannot move tensors on cuda:" + std::to_string(1 - r)});
    lockstep::testing::expect_error([&] { pg->all_reduce(full({2}, 1.0, on(r, kBool))); },
                                    {"cannot reduce"});
    // The one way for host values: through the device and back.
    Tensor counts = full({2}, 10.0 * (r + 1), kInt64);
    pg->all_reduce_host(counts);
    EXPECT_EQ(counts.to_vector<double>(), (std::vector<double>{30, 30}));
    Tensor all = zeros({4}, kFloat64);
    pg->all_gather_host(all, full({2}, r + 0.5, kFloat64));
    EXPECT_EQ(all.to_vector<double>(), (std::vector<double>{0.5, 0.5, 1.5, 1.5}));
    Tensor bytes = full({3}, r == 0 ? 7.0 : 0.0, kUInt8);
    pg->broadcast_host(bytes);
    EXPECT_EQ(bytes.to_vector<double>(), (std::vector<double>{7, 7, 7}));
    lockstep::testing::expect_error([&] { pg->all_reduce_host(full({1}, 1.0, on(r))); },
                                    {"all_reduce_host", "expected a CPU tensor", "cuda:"});
    EXPECT_EQ(dist::to_string(pg->broadcast_object(dist::to_bytes("hi"), 1)),
              "hi");
    pg->barrier()->wait();
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// A checkpoint loaded by broadcast from rank 0 (a rank that cannot see rank 0's file) travels
// through the nccl group as bytes on the device (it once sent a host buffer).
TEST(Emulated, CheckpointLoadedByBroadcastTravelsOnTheDevice) {
  LS_REQUIRE_EMULATION();
  lockstep::testing::TempDir dir;
  const std::string path = dir.path("ck.safetensors");
  io::TrainingCheckpoint ck;
  Generator gen(3);
  ck.model = {{"w", randn({17, 5}, gen)}, {"n", full({}, 4.0, kInt64)}};
  ck.optimizer = {{"0.momentum_buffer", randn({17, 5}, gen)}};
  ck.step = 12;
  io::save_checkpoint(path, ck);
  const std::vector<double> want = ck.model[0].second.to_vector<double>();
  const auto errors = nccl_ranks([&](int r, ProcessGroupPtr pg) {
    const std::string mine = r == 0 ? path : dir.path("not-on-this-machine.safetensors");
    const io::TrainingCheckpoint got = load_checkpoint(*pg, mine, CheckpointLoad::automatic);
    EXPECT_EQ(got.step, 12);
    EXPECT_EQ(got.model[0].second.to_vector<double>(), want) << "rank " << r;
    EXPECT_EQ(got.model[1].second.item(), 4.0);
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// A world of one under nccl keeps the contract too (it was the one world in which the examples'
// host tensors got through).
TEST(Emulated, NcclWorldOfOneRefusesHostTensors) {
  LS_REQUIRE_EMULATION();
  DistEnv env;
  World w = connect_world(env, {.backend = "nccl"});
  EXPECT_EQ(w.cuda_device, 0);
  lockstep::testing::expect_error([&] { w.group->all_reduce(full({2}, 1.0, kFloat32)); },
                                  {"cannot move tensors on cpu", "cuda:0 only"});
  Tensor x = full({2}, 4.0, on(0));
  w.group->all_reduce(x)->wait();
  EXPECT_EQ(values(x), (std::vector<double>{4, 4}));
  Tensor h = full({1}, 2.0, kFloat64);
  w.group->all_reduce_host(h);
  EXPECT_EQ(h.item(), 2.0);
}

// Note [Emulated kernels]: an op without a CUDA kernel has none on an emulated GPU either.
TEST(Emulated, KernelTableLacksWhatTheCudaTableLacks) {
  const lockstep::detail::Kernels& emu = lockstep::detail::emulated_kernels();
  constexpr size_t n = sizeof(lockstep::detail::Kernels) / sizeof(void*);
  static_assert(n * sizeof(void*) == sizeof(lockstep::detail::Kernels), "entries are function pointers");
  void* e[n];
  std::memcpy(e, &emu, sizeof e);
#ifdef LOCKSTEP_WITH_CUDA
  void* c[n];
  std::memcpy(c, &cuda_ops::table(), sizeof c);
  for (size_t i = 0; i < n; ++i) {
    if (c[i] == nullptr) EXPECT_EQ(e[i], nullptr) << "entry " << i << ": CUDA has no kernel";
  }
#endif
  // CUDA has a fused attention (src/ops/cuda/attention.cu): the emulated GPUs run the CPU's.
  EXPECT_EQ(emu.attention, lockstep::detail::kCpuKernels.attention);
  EXPECT_EQ(emu.attention_backward, lockstep::detail::kCpuKernels.attention_backward);
  EXPECT_EQ(emu.gemm, lockstep::detail::kCpuKernels.gemm);
}

}  // namespace
