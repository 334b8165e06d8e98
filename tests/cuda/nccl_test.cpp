// Collectives on CUDA tensors: the NCCL backend with one rank (every collective, stream-ordered
// waits, the watchdog aborting a stuck collective), the CPU backends staging cuda tensors through
// host memory (two ranks on one GPU, DDP over Gloo equal to one process on the whole batch), and
// DataParallel with its replicas on devices. One GPU cannot host two NCCL ranks, so NCCL runs
// with a world of one here; a collective is made to hang by blocking the stream it waits for.
#include <atomic>
#include <chrono>
#include <thread>

#include "distributed/ddp_helpers.h"
#include "distributed/thread_ranks.h"
#include "gpu.h"
#include "lockstep/distributed/store/hash_store.h"
#include "testing.h"

#ifdef LOCKSTEP_WITH_CUDA
#include <cuda_runtime_api.h>

#include "lockstep/distributed/nccl/process_group_nccl.h"
#endif

using namespace lockstep;
using namespace lockstep::dist;
using namespace lockstep::testing::ddp;
using lockstep::testing::gpu;
using namespace std::chrono_literals;

namespace {

std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

void expect_close_params(const std::vector<std::vector<double>>& got,
                         const std::vector<std::vector<double>>& want, double rel,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t k = 0; k < got.size(); ++k) {
    ASSERT_EQ(got[k].size(), want[k].size()) << what;
    for (size_t i = 0; i < got[k].size(); ++i) {
      const double tol = rel * std::max(1.0, std::abs(want[k][i]));
      ASSERT_NEAR(got[k][i], want[k][i], tol) << what << ": parameter " << k << " element " << i;
    }
  }
}

constexpr int kSteps = 4;
constexpr int64_t kBatch = 8;

// One process on the CPU on the whole batch: the reference.
std::vector<std::vector<double>> train_single_on_cpu(const Data& data) {
  auto model = mlp(7);
  optim::SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    cross_entropy(model->forward(data.x.narrow(0, s * kBatch, kBatch)),
                  data.y.narrow(0, s * kBatch, kBatch))
        .backward();
    opt.step();
  }
  return param_values(*model);
}

#ifdef LOCKSTEP_WITH_CUDA

std::shared_ptr<ProcessGroupNCCL> nccl_world_of_one(std::chrono::milliseconds timeout = 60s) {
  BackendConfig c;
  c.store = std::make_shared<HashStore>(30s);
  c.rank = 0;
  c.size = 1;
  c.timeout = timeout;
  return std::make_shared<ProcessGroupNCCL>(c);
}

// Holds a stream at this point until released (or destroyed): a host function queued on it
// blocks, so everything queued after it, and every stream that waits for it, waits too.
class StreamBlock {
 public:
  explicit StreamBlock(const cuda::Stream& s) : stream_(static_cast<cudaStream_t>(s.handle())) {
    EXPECT_EQ(cudaLaunchHostFunc(stream_, &StreamBlock::hold, &open_), cudaSuccess);
  }
  // The host function reads open_: it must have returned before this object is gone.
  ~StreamBlock() {
    release();
    cudaStreamSynchronize(stream_);
  }
  void release() { open_.store(true); }

 private:
  static void hold(void* flag) {
    auto* open = static_cast<std::atomic<bool>*>(flag);
    while (!open->load()) std::this_thread::sleep_for(1ms);
  }
  cudaStream_t stream_;
  std::atomic<bool> open_{false};
};

TEST(Nccl, WorldOfOneRunsEveryCollectiveOnTheDevice) {
  LS_REQUIRE_GPU();
  auto pg = nccl_world_of_one();
  EXPECT_EQ(pg->backend(), "nccl");
  EXPECT_EQ(pg->device(), cuda::current_device());
  const TensorOptions f32 = TensorOptions(kFloat32).with_device(gpu());
  Tensor x = arange(0.0, 6.0, 1.0, f32);
  for (ReduceOp op :
       {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max, ReduceOp::product}) {
    pg->all_reduce(x, {.op = op})->wait();  // with one rank, every reduction is the identity
    EXPECT_EQ(values(x), (std::vector<double>{0, 1, 2, 3, 4, 5})) << reduce_op_name(op);
  }
  for (DType t : {kFloat64, kBFloat16, kFloat16, kInt32, kInt64}) {
    Tensor y = full({3}, 2.0, TensorOptions(t).with_device(gpu()));
    pg->all_reduce(y)->wait();
    EXPECT_EQ(values(y), (std::vector<double>{2, 2, 2})) << dtype_name(t);
  }
  // Several tensors travel fused; the unpacking runs on the group's stream after the collective.
  Tensor a = arange(0.0, 4.0, 1.0, f32).view({2, 2}), b = arange(10.0, 13.0, 1.0, f32);
  pg->all_reduce(std::vector<Tensor>{a.t(), b})->wait();  // a strided view among them
  EXPECT_EQ(values(a), (std::vector<double>{0, 1, 2, 3}));
  EXPECT_EQ(values(b), (std::vector<double>{10, 11, 12}));
  Tensor c = arange(0.0, 4.0, 1.0, f32);
  pg->broadcast(c)->wait();
  EXPECT_EQ(values(c), (std::vector<double>{0, 1, 2, 3}));
  Tensor gathered = zeros({4}, f32);
  pg->all_gather(gathered, c)->wait();
  EXPECT_EQ(values(gathered), (std::vector<double>{0, 1, 2, 3}));
  Tensor scattered = zeros({4}, f32);
  pg->reduce_scatter(scattered, c)->wait();
  EXPECT_EQ(values(scattered), (std::vector<double>{0, 1, 2, 3}));
  WorkPtr barrier = pg->barrier();
  barrier->wait();  // a barrier's wait blocks the host
  EXPECT_TRUE(barrier->is_completed());
  WorkPtr last = pg->all_reduce(c);
  last->synchronize();
  EXPECT_TRUE(last->is_success());
  EXPECT_EQ(to_string(pg->broadcast_object(to_bytes("on the device"), 0)), "on the device");
  EXPECT_EQ(to_string(pg->all_gather_object(to_bytes("xy"))[0]), "xy");
  EXPECT_EQ(pg->sequence_number(), 20);
}

TEST(Nccl, CpuTensorsAreRefusedNamingTheGroupsDevice) {
  LS_REQUIRE_GPU();
  auto pg = nccl_world_of_one();
  lockstep::testing::expect_error([&] { pg->all_reduce(full({2}, 1.0, kFloat32)); },
                                  {"(nccl)", "cannot move tensors on cpu", "cuda:0 only"});
}

TEST(Nccl, WaitOrdersTheCallersStreamWithoutBlockingTheHost) {
  LS_REQUIRE_GPU();
  auto pg = nccl_world_of_one();
  cuda::Stream s = cuda::Stream::create();
  cuda::StreamGuard on(s);
  Tensor x = full({1024}, 3.0, TensorOptions(kFloat32).with_device(gpu()));
  WorkPtr w;
  {
    StreamBlock block(s);  // the collective waits for s, which waits here
    w = pg->all_reduce(x, {.op = ReduceOp::avg});
    const auto t0 = std::chrono::steady_clock::now();
    w->wait();  // queues a wait on s and returns
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
    std::this_thread::sleep_for(50ms);
    EXPECT_FALSE(w->is_completed()) << "completed while the stream it waits for was held";
  }
  w->synchronize();
  EXPECT_TRUE(w->is_success());
  EXPECT_EQ(values(x), std::vector<double>(1024, 3.0));
}

TEST(Nccl, WatchdogAbortsAStuckCollectiveAndPoisonsTheGroup) {
  LS_REQUIRE_GPU();
  auto pg = nccl_world_of_one(/*timeout=*/1s);
  cuda::Stream s = cuda::Stream::create();
  cuda::StreamGuard on(s);
  Tensor x = full({16}, 1.0, TensorOptions(kFloat32).with_device(gpu()));
  pg->all_reduce(x)->synchronize();  // #1 runs
  StreamBlock block(s);
  WorkPtr stuck = pg->all_reduce(x);  // #2 cannot start: it waits for s
  const auto t0 = std::chrono::steady_clock::now();
  while (!stuck->is_completed() && std::chrono::steady_clock::now() - t0 < 30s) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(stuck->is_completed()) << "the watchdog did not fail the stuck collective";
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 900ms);
  block.release();  // the abort may wait for the device
  lockstep::testing::expect_error([&] { stuck->wait(); }, {"rank 0/1 (nccl)", "all_reduce #2",
                                                           "timed out after 1 s", "aborted"});
  // Poisoned: every later collective fails at once, naming the first failure.
  lockstep::testing::expect_error([&] { pg->all_reduce(x)->wait(); },
                                  {"all_reduce #3", "was not run", "all_reduce #2",
                                   "timed out after 1 s", "build a new group"});
  lockstep::testing::expect_error([&] { pg->barrier()->synchronize(); },
                                  {"barrier #4", "was not run"});
}

// Note [NCCL signature check]: two ranks (one GPU each: NCCL cannot put two ranks on one GPU)
// that disagree on a collective's size, and then on its kind, both fail before any data moves,
// naming both sides; the group stays usable, and a matching all_reduce then sums.
TEST(Nccl, RanksThatDisagreeFailOnBothRanksNamingBothSidesAndTheGroupGoesOn) {
  LS_REQUIRE_GPU();
  if (lockstep::testing::gpu_as_cpu() || cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 GPUs (NCCL puts one rank on each), found "
                 << (lockstep::testing::gpu_as_cpu() ? 0 : cuda::device_count());
  }
  auto store = std::make_shared<HashStore>(30s);
  std::vector<std::string> errors(2), kinds(2);
  std::vector<double> sums(2, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        cuda::set_device(r);
        BackendConfig c;
        c.store = store;
        c.rank = r;
        c.size = 2;
        c.timeout = 60s;
        auto pg = std::make_shared<ProcessGroupNCCL>(c);
        const auto on = TensorOptions(kFloat32).with_device(cuda_device(r));
        Tensor x = full({r == 0 ? 1024 : 512}, 1.0, on);
        try {
          pg->all_reduce(x)->synchronize();
        } catch (const Error& e) {
          errors[r] = e.message();
        }
        Tensor y = full({8}, 1.0, on);
        try {
          if (r == 0) pg->all_reduce(y)->synchronize();
          if (r == 1) pg->broadcast(y)->synchronize();
        } catch (const Error& e) {
          kinds[r] = e.message();
        }
        Tensor z = full({8}, static_cast<double>(r + 1), on);
        pg->all_reduce(z)->synchronize();
        sums[r] = z.to(kCPU).data<float>()[0];
      } catch (const std::exception& e) {
        errors[r] += std::string(" | unexpected: ") + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("all_reduce: rank 1 has 512 elements, rank 0 has 1024"),
              std::string::npos)
        << errors[r];
    EXPECT_NE(kinds[r].find("rank 1 called broadcast, rank 0 called all_reduce"), std::string::npos)
        << kinds[r];
    EXPECT_EQ(sums[r], 3.0) << "the group went on after the mismatches";
  }
}

// DDP's reducer on the device through NCCL: buckets on the GPU, all-reduces launched from the
// backward hooks on the group's stream, the optimizer ordered after them by wait().
TEST(Nccl, DdpOnOneRankEqualsOneProcessOnTheCpu) {
  LS_REQUIRE_GPU();
  const Data data = make_data(kSteps * kBatch, 11);
  const auto want = train_single_on_cpu(data);
  auto pg = nccl_world_of_one();
  auto model = mlp(7);
  model->to(gpu());
  DDPOptions o;
  o.first_bucket_bytes = 256;
  o.bucket_bytes = 1024;
  auto ddp = std::make_shared<DistributedDataParallel>(model, pg, o);
  optim::SGD opt(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    cross_entropy(ddp->forward(data.x.narrow(0, s * kBatch, kBatch).to(gpu())),
                  data.y.narrow(0, s * kBatch, kBatch).to(gpu()))
        .backward();
    opt.step();
  }
  for (const auto& p : model->parameters()) ASSERT_TRUE(p.device() == gpu());
  expect_close_params(param_values(*model), want, 1e-4, "DDP over nccl");
  EXPECT_GE(ddp->stats().bucket_bytes.size(), 4u) << ddp->stats().str();
}

#endif  // LOCKSTEP_WITH_CUDA

// Note [Staging device tensors] in src/distributed/process_group.cpp: Gloo with cuda tensors,
// two ranks (threads) on one GPU.
TEST(GlooStaging, EveryCollectiveOnCudaTensorsMatchesTheCpu) {
  LS_REQUIRE_GPU();
  const auto errors = lockstep::testing::run_ranks(2, [](int r, ProcessGroupPtr pg) {
    cuda::set_device(0);
    const TensorOptions f32 = TensorOptions(kFloat32).with_device(gpu());
    Tensor x = full({5}, r + 1.0, f32);
    pg->all_reduce(x)->wait();
    LS_CHECK(values(x) == std::vector<double>(5, 3.0), "all_reduce sum: ", x.to(kCPU));
    Tensor a = full({2, 3}, r == 0 ? 1.0 : 3.0, f32), b = full({4}, r * 10.0, f32);
    pg->all_reduce(std::vector<Tensor>{a.t(), b}, {.op = ReduceOp::avg})->wait();
    LS_CHECK(values(a) == std::vector<double>(6, 2.0), "all_reduce avg (strided): ", a.to(kCPU));
    LS_CHECK(values(b) == std::vector<double>(4, 5.0), "all_reduce avg: ", b.to(kCPU));
    Tensor c = full({3}, r == 1 ? 42.0 : 0.0, TensorOptions(kInt64).with_device(gpu()));
    pg->broadcast(c, {.root = 1})->wait();
    LS_CHECK(values(c) == std::vector<double>(3, 42.0), "broadcast: ", c.to(kCPU));
    Tensor out = zeros({2, 2}, f32);
    pg->all_gather(out, full({2}, r + 1.0, f32))->wait();
    LS_CHECK(values(out) == (std::vector<double>{1, 1, 2, 2}), "all_gather: ", out.to(kCPU));
    Tensor mine = zeros({2}, f32);
    pg->reduce_scatter(mine, arange(0.0, 4.0, 1.0, f32))->wait();
    LS_CHECK(values(mine) == (std::vector<double>{2.0 * (2 * r), 2.0 * (2 * r + 1)}),
             "reduce_scatter: ", mine.to(kCPU));
    pg->barrier()->wait();
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(GlooStaging, DdpTwoRanksOnOneGpuEqualsOneProcessOnTheWholeBatch) {
  LS_REQUIRE_GPU();
  const Data data = make_data(kSteps * kBatch, 11);
  const auto want = train_single_on_cpu(data);
  std::vector<std::vector<std::vector<double>>> got(2);
  const auto errors = lockstep::testing::run_ranks(
      2,
      [&](int r, ProcessGroupPtr pg) {
        cuda::set_device(0);
        auto model = mlp(7 + r);  // rank 0's parameters reach rank 1 through DDP's broadcast
        model->to(gpu());
        DDPOptions o;
        o.first_bucket_bytes = 256;
        o.bucket_bytes = 1024;
        auto ddp = std::make_shared<DistributedDataParallel>(model, pg, o);
        optim::SGD opt(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
        for (int s = 0; s < kSteps; ++s) {
          Data mine = shard(
              Data{data.x.narrow(0, s * kBatch, kBatch), data.y.narrow(0, s * kBatch, kBatch)}, r,
              2);
          opt.zero_grad();
          cross_entropy(ddp->forward(mine.x.to(gpu())), mine.y.to(gpu())).backward();
          opt.step();
        }
        got[r] = param_values(*model);
      },
      60s, /*via_registry=*/true);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  for (int r = 0; r < 2; ++r) {
    expect_close_params(got[r], want, 1e-4, "rank " + std::to_string(r));
  }
  EXPECT_EQ(got[1], got[0]) << "the ranks drifted apart";
}

TEST(DataParallelCuda, TwoReplicasOnTheGpuEqualOneModelOnTheCpu) {
  LS_REQUIRE_GPU();
  const Data data = make_data(kSteps * 9, 31);
  auto ref = mlp(8);
  optim::SGD ref_opt(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
  int seed = 0;
  // Two replicas on one GPU: the lent machine has one; the path is the one of several GPUs but
  // for the peer copies.
  DataParallel dp([&] { return mlp(8 + seed++); }, std::vector<Device>{gpu(), gpu()});
  optim::SGD opt(dp.module()->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int s = 0; s < kSteps; ++s) {
    Tensor x = data.x.narrow(0, s * 9, 9), y = data.y.narrow(0, s * 9, 9);
    ref_opt.zero_grad();
    Tensor l = cross_entropy(ref->forward(x), y);
    l.backward();
    ref_opt.step();
    opt.zero_grad();
    const double dl = dp.forward_backward(
        x, y, [](const Tensor& out, const Tensor& t) { return cross_entropy(out, t); });
    opt.step();
    EXPECT_NEAR(dl, l.item(), 1e-4) << "step " << s;
  }
  for (const auto& p : dp.module()->parameters()) ASSERT_TRUE(p.device() == gpu());
  expect_close_params(param_values(*dp.module()), param_values(*ref), 1e-4, "DataParallel");
}

}  // namespace
