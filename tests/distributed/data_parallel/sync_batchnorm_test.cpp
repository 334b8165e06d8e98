// SyncBatchNorm, ranks as threads: N ranks with their own batch sizes equal one process running
// BatchNorm on the concatenated batch (outputs, input/weight/bias gradients, running statistics),
// under DDP too; convert_sync_batchnorm swaps the layers and keeps their tensors.
#include <cmath>
#include <numeric>

#include "distributed/ddp_helpers.h"
#include "distributed/thread_ranks.h"
#include "lockstep/distributed/sync_batchnorm.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace lockstep::testing::ddp;
using lockstep::testing::run_ranks;

namespace {

constexpr int64_t kChannels = 3;

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i])))
        << what << " element " << i;
  }
}

// A BatchNorm2d with weight and bias other than ones and zeros, so their gradients matter.
std::shared_ptr<nn::BatchNorm2d> make_bn() {
  auto bn = std::make_shared<nn::BatchNorm2d>(kChannels);
  Generator gen(5);
  autograd::NoGradGuard no_grad;
  for (auto& p : bn->parameters()) p.copy_(randn({kChannels}, gen));
  return bn;
}

struct Expected {
  std::vector<double> y, dx, dw, db, running_mean, running_var, eval_y;
};

// rows[r] samples on rank r; two training steps (the running statistics move twice), then an
// evaluation forward on the whole batch.
void check_against_one_process(const std::vector<int64_t>& rows) {
  const int world = static_cast<int>(rows.size());
  const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
  Generator gen(17);
  const Tensor x0 = randn({total, kChannels, 4, 5}, gen, {}, 1.5, 2.0);
  const Tensor x1 = randn({total, kChannels, 4, 5}, gen, {}, -0.5, 0.7);
  const Tensor c = randn({total, kChannels, 4, 5}, gen);  // loss = sum(y * c): per-sample terms

  // One process, the whole batch.
  Expected want;
  {
    auto bn = make_bn();
    bn->forward(x0);
    Tensor x = x1.clone().requires_grad_(true);
    Tensor y = bn->forward(x);
    sum(mul(y, c)).backward();
    want.y = y.to_vector<double>();
    want.dx = x.grad().to_vector<double>();
    want.dw = bn->parameters()[0].grad().to_vector<double>();
    want.db = bn->parameters()[1].grad().to_vector<double>();
    want.running_mean = bn->buffers()[0].to_vector<double>();
    want.running_var = bn->buffers()[1].to_vector<double>();
    bn->eval();
    want.eval_y = bn->forward(x1).to_vector<double>();
  }

  std::vector<int64_t> start(world, 0);
  for (int r = 1; r < world; ++r) start[r] = start[r - 1] + rows[r - 1];
  std::vector<Expected> got(world);
  std::vector<std::vector<double>> summed_dw(world), summed_db(world);
  const auto errors = run_ranks(world, [&](int r, ProcessGroupPtr pg) {
    auto bn = convert_sync_batchnorm(make_bn(), pg);
    bn->forward(x0.narrow(0, start[r], rows[r]));
    Tensor x = x1.narrow(0, start[r], rows[r]).clone().requires_grad_(true);
    Tensor y = bn->forward(x);
    sum(mul(y, c.narrow(0, start[r], rows[r]))).backward();
    Expected& e = got[r];
    e.y = y.to_vector<double>();
    e.dx = x.grad().to_vector<double>();
    // The weight and bias gradients are per rank (DDP reduces them); their sum is the whole's.
    Tensor dw = bn->parameters()[0].grad().clone(), db = bn->parameters()[1].grad().clone();
    pg->all_reduce(std::vector<Tensor>{dw, db})->wait();
    summed_dw[r] = dw.to_vector<double>();
    summed_db[r] = db.to_vector<double>();
    e.running_mean = bn->buffers()[0].to_vector<double>();
    e.running_var = bn->buffers()[1].to_vector<double>();
    bn->eval();
    e.eval_y = bn->forward(x1).to_vector<double>();
  });
  for (int r = 0; r < world; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;

  const int64_t per_sample = kChannels * 4 * 5;
  for (int r = 0; r < world; ++r) {
    const std::string rank = "rank " + std::to_string(r);
    const auto slice = [&](const std::vector<double>& v) {
      return std::vector<double>(v.begin() + start[r] * per_sample,
                                 v.begin() + (start[r] + rows[r]) * per_sample);
    };
    expect_close(got[r].y, slice(want.y), 1e-5, rank + " output");
    expect_close(got[r].dx, slice(want.dx), 1e-4, rank + " input gradient");
    expect_close(summed_dw[r], want.dw, 1e-4, rank + " weight gradient (summed over ranks)");
    expect_close(summed_db[r], want.db, 1e-4, rank + " bias gradient (summed over ranks)");
    expect_close(got[r].running_mean, want.running_mean, 1e-6, rank + " running_mean");
    expect_close(got[r].running_var, want.running_var, 1e-6, rank + " running_var");
    expect_close(got[r].eval_y, want.eval_y, 1e-5, rank + " evaluation output");
    // Every rank combined the same gathered statistics in the same order.
    EXPECT_EQ(got[r].running_mean, got[0].running_mean) << rank;
    EXPECT_EQ(got[r].running_var, got[0].running_var) << rank;
  }
}

TEST(SyncBatchNorm, EvenBatchesEqualBatchNormOnTheWholeBatch) {
  check_against_one_process({4, 4, 4});
}

TEST(SyncBatchNorm, UnevenBatchesEqualBatchNormOnTheWholeBatch) {
  check_against_one_process({1, 5, 3});
}

TEST(SyncBatchNorm, ARankWithAnEmptyBatchStillTakesPart) { check_against_one_process({3, 0, 4}); }

TEST(SyncBatchNorm, OneValuePerChannelAcrossTheGroupIsAnErrorOnEveryRank) {
  const auto errors = run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    SyncBatchNorm bn(2, 1e-5, 0.1, true, pg);
    bn.forward(zeros({r == 0 ? 1 : 0, 2}));
  });
  for (const auto& e : errors) EXPECT_THAT(e, ::testing::HasSubstr("more than one value"));
}

// Under DDP with equal per-rank batches the mean losses average to the whole batch's mean loss:
// parameters after SGD steps equal one process with BatchNorm on the whole batch.
TEST(SyncBatchNorm, UnderDDPRanksEqualOneProcessOnTheWholeBatch) {
  constexpr int kWorld = 2, kSteps = 3;
  constexpr int64_t kBatch = 8;
  auto make = [](uint64_t seed) {
    Generator gen(seed);
    return std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
        std::make_shared<nn::Linear>(kIn, 16, gen), std::make_shared<nn::BatchNorm1d>(16),
        std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(16, kClasses, gen)});
  };
  const Data data = make_data(kSteps * kBatch, 29);
  auto ref = make(3);
  optim::SGD ref_opt(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int s = 0; s < kSteps; ++s) {
    ref_opt.zero_grad();
    cross_entropy(ref->forward(data.x.narrow(0, s * kBatch, kBatch)),
                  data.y.narrow(0, s * kBatch, kBatch))
        .backward();
    ref_opt.step();
  }
  const auto want = param_values(*ref);
  const auto want_bufs = ref->buffers();
  std::vector<std::vector<std::vector<double>>> got(kWorld);
  std::vector<std::vector<double>> running_mean(kWorld);
  const auto errors = run_ranks(kWorld, [&](int r, ProcessGroupPtr pg) {
    DDPOptions o;
    o.first_bucket_bytes = 256;  // buckets in flight while SyncBatchNorm reduces in backward
    o.bucket_bytes = 512;
    auto ddp =
        std::make_shared<DistributedDataParallel>(convert_sync_batchnorm(make(3 + r), pg), pg, o);
    optim::SGD opt(ddp->parameters(), {.lr = 0.1, .momentum = 0.9});
    for (int s = 0; s < kSteps; ++s) {
      Data step{data.x.narrow(0, s * kBatch, kBatch), data.y.narrow(0, s * kBatch, kBatch)};
      Data mine = shard(step, r, kWorld);
      opt.zero_grad();
      cross_entropy(ddp->forward(mine.x), mine.y).backward();
      opt.step();
    }
    got[r] = param_values(*ddp->module());
    running_mean[r] = ddp->module()->buffers()[0].to_vector<double>();
  });
  for (int r = 0; r < kWorld; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  for (int r = 0; r < kWorld; ++r) {
    for (size_t k = 0; k < want.size(); ++k) {
      expect_close(got[r][k], want[k], 1e-5,
                   "rank " + std::to_string(r) + " parameter " + std::to_string(k));
    }
    expect_close(running_mean[r], want_bufs[0].to_vector<double>(), 1e-5, "running_mean");
  }
  EXPECT_EQ(got[1], got[0]);
}

TEST(SyncBatchNorm, ConvertReplacesBatchNormInATreeAndKeepsItsTensors) {
  Generator gen(1);
  auto inner = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(4, 4, gen), std::make_shared<nn::BatchNorm1d>(4, 1e-3, 0.2)});
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Conv2d>(nn::Conv2dConfig{.in_channels = 1, .out_channels = 2}, gen),
      std::make_shared<nn::BatchNorm2d>(2), std::make_shared<nn::ReLU>(), inner});
  const auto before = model->named_parameters();
  const auto buffers_before = model->named_buffers();
  auto converted = convert_sync_batchnorm(model);
  EXPECT_EQ(converted, model);
  EXPECT_EQ((*model)[1]->type_name(), "SyncBatchNorm");
  EXPECT_EQ((*inner)[1]->type_name(), "SyncBatchNorm");
  EXPECT_EQ((*model)[0]->type_name(), "Conv2d");
  EXPECT_THAT((*inner)[1]->to_string(), ::testing::HasSubstr("eps=0.001, momentum=0.2"));
  // Same names, order and tensors (storage), so an optimizer built before still applies.
  const auto after = model->named_parameters();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i].first, before[i].first);
    EXPECT_EQ(after[i].second.data_ptr(), before[i].second.data_ptr()) << after[i].first;
  }
  const auto buffers_after = model->named_buffers();
  ASSERT_EQ(buffers_after.size(), buffers_before.size());
  for (size_t i = 0; i < buffers_after.size(); ++i) {
    EXPECT_EQ(buffers_after[i].first, buffers_before[i].first);
    EXPECT_EQ(buffers_after[i].second.data_ptr(), buffers_before[i].second.data_ptr());
  }
  // A BatchNorm at the root comes back as a new SyncBatchNorm.
  auto root = convert_sync_batchnorm(std::make_shared<nn::BatchNorm1d>(3));
  EXPECT_NE(std::dynamic_pointer_cast<SyncBatchNorm>(root), nullptr);
}

}  // namespace
