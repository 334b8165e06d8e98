// FullyShardedDataParallel with ranks as threads: parameters and optimizer state bitwise those of
// DDP (clipped, with gradient accumulation, both reshard settings, any world size, shm and Gloo),
// parameters that hold no memory outside their unit's use, and state that moves between FSDP
// and DDP runs of other sizes.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>

#include "distributed/ddp_helpers.h"
#include "distributed/thread_ranks.h"
#include "lockstep/amp/grad_scaler.h"
#include "lockstep/distributed/ddp.h"
#include "lockstep/distributed/fsdp.h"
#include "lockstep/distributed/join.h"
#include "lockstep/distributed/zero.h"
#include "lockstep/io/sharded_checkpoint.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using namespace lockstep::testing::ddp;

namespace {

constexpr int64_t kPerRank = 4;  // samples per rank per micro-batch
constexpr double kClip = 0.2;    // small enough that every step clips

// Three units (the Linears; the policy's threshold is below each), none of whose sizes (224,
// 1056, 99) divides by every world size: padding is exercised at 2, 3 and 4 ranks.
FSDPOptions fsdp_options(bool reshard) {
  return {.reshard_after_forward = reshard, .wrap = wrap_by_size(64)};
}

std::unique_ptr<optim::Optimizer> adamw(std::vector<optim::ParamGroup> groups) {
  return std::make_unique<optim::AdamW>(std::move(groups),
                                        optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.1});
}

// Two groups: the first layer at its own learning rate and without decay.
std::vector<optim::ParamGroup> groups_of(const nn::Module& m) {
  const auto ps = m.parameters();
  optim::ParamGroup first{{ps[0], ps[1]}, 0.02, 0.0};
  optim::ParamGroup rest{{ps.begin() + 2, ps.end()}};
  return {first, rest};
}

struct Result {
  nn::NamedTensors model;
  optim::NamedTensors optimizer;
  std::vector<double> norms;
  FSDPStats stats;
};

// The three layouts one training loop runs through dist::ParallelModule: DDP, DDP with ZeRO-1's
// reduce-scatter hook (its all-gathers overlapped with the next forward), FSDP.
enum class Layout { ddp, zero1, fsdp };

struct RunSpec {
  Layout layout = Layout::ddp;
  bool reshard = true;
  int steps = 8;
  int micro = 1;  // micro-batches per step (no_sync for all but the last)
  int start = 0;  // the first step's index (batches depend on it)
  const Result* from = nullptr;
};

Data batch_for(int step, int micro, int r, int world) {
  const uint64_t seed = 1000 + static_cast<uint64_t>(step) * 16 + static_cast<uint64_t>(micro);
  return shard(make_data(kPerRank * world, seed), r, world);
}

Result train(int r, const ProcessGroupPtr& pg, const RunSpec& run) {
  auto model = mlp(7);
  if (run.from) model->load_state_dict(run.from->model);
  const int world = pg->size();
  // Only the wrapper and its optimizer depend on the layout.
  std::shared_ptr<ParallelModule> net;
  std::unique_ptr<optim::Optimizer> opt;
  FullyShardedDataParallel* fsdp = nullptr;
  if (run.layout == Layout::fsdp) {
    auto f = std::make_shared<FullyShardedDataParallel>(model, pg, fsdp_options(run.reshard));
    opt = f->wrap_optimizer(groups_of(*model), adamw);
    fsdp = f.get();
    net = std::move(f);
  } else {
    auto ddp = std::make_shared<DistributedDataParallel>(model, pg);
    if (run.layout == Layout::zero1) {
      auto zero = std::make_unique<ZeroRedundancyOptimizer>(
          groups_of(*model), pg, adamw,
          ZeroOptions{.reduce_scatter_gradients = true, .overlap_all_gather = true});
      ddp->register_comm_hook(zero->comm_hook());
      opt = std::move(zero);
    } else {
      opt = adamw(groups_of(*model));
    }
    net = std::move(ddp);
  }
  if (run.from) opt->load_state_dict(run.from->optimizer);
  // The training loop, the same for every layout.
  Result res;
  for (int s = run.start; s < run.start + run.steps; ++s) {
    opt->zero_grad();
    for (int m = 0; m < run.micro; ++m) {
      const Data b = batch_for(s, m, r, world);
      if (m + 1 < run.micro) {
        auto scope = net->no_sync();
        cross_entropy(net->forward(b.x), b.y).backward();
      } else {
        cross_entropy(net->forward(b.x), b.y).backward();
      }
    }
    res.norms.push_back(net->clip_grad_norm(kClip));
    opt->step();
  }
  res.model = net->full_state_dict();
  res.optimizer = opt->state_dict();
  if (fsdp) res.stats = fsdp->stats();
  return res;
}

std::vector<Result> run_all(const std::string& backend, int world, const RunSpec& run) {
  std::vector<Result> results(static_cast<size_t>(world));
  const auto errors = lockstep::testing::run_ranks_on(
      backend, world, [&](int r, ProcessGroupPtr pg) { results[r] = train(r, pg, run); });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return results;
}

// Names, shapes and every value bitwise equal (f32 values are exact as doubles).
void expect_same(const optim::NamedTensors& got, const optim::NamedTensors& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_EQ(got[k].first, want[k].first);
    EXPECT_EQ(got[k].second.shape(), want[k].second.shape()) << got[k].first;
    EXPECT_EQ(got[k].second.to_vector<double>(), want[k].second.to_vector<double>())
        << got[k].first;
  }
}

// The same, whatever the order of the entries (a file's are sorted by name).
void expect_same_by_name(optim::NamedTensors got, optim::NamedTensors want) {
  auto by_name = [](const auto& a, const auto& b) { return a.first < b.first; };
  std::sort(got.begin(), got.end(), by_name);
  std::sort(want.begin(), want.end(), by_name);
  expect_same(got, want);
}

struct Case {
  std::string backend;
  int world;
  bool reshard;
};

class FsdpEqualsDDP : public ::testing::TestWithParam<Case> {};

TEST_P(FsdpEqualsDDP, ParametersOptimizerStateAndNormsBitwiseWithClippingAndAccumulation) {
  const auto [backend, world, reshard] = GetParam();
  const RunSpec fsdp_run{.layout = Layout::fsdp, .reshard = reshard, .steps = 6, .micro = 2};
  const RunSpec ddp_run{.layout = Layout::ddp, .steps = 6, .micro = 2};
  const RunSpec zero_run{.layout = Layout::zero1, .steps = 6, .micro = 2};
  const auto fsdp = run_all(backend, world, fsdp_run);
  const auto ddp = run_all(backend, world, ddp_run);
  expect_same(fsdp[0].model, ddp[0].model);
  expect_same(fsdp[0].optimizer, ddp[0].optimizer);
  EXPECT_EQ(fsdp[0].norms, ddp[0].norms);
  // ZeRO-1 through the same loop (its clip_grad_norm is the hook's, over its shards).
  const auto zero = run_all(backend, world, zero_run);
  expect_same(zero[0].model, ddp[0].model);
  expect_same(zero[0].optimizer, ddp[0].optimizer);
  EXPECT_EQ(zero[0].norms, ddp[0].norms);
  for (double n : ddp[0].norms) EXPECT_GT(n, kClip);  // clipping changed every step
  for (int r = 1; r < world; ++r) expect_same(fsdp[r].model, fsdp[0].model);
  // Training moved the parameters.
  EXPECT_NE(fsdp[0].model[0].second.to_vector<double>(),
            mlp(7)->state_dict()[0].second.to_vector<double>());
  // Each rank holds its 1/world of every padded unit.
  const FSDPStats& s = fsdp[0].stats;
  EXPECT_EQ(s.units, 3);
  EXPECT_EQ(s.total_elements, 224 + 1056 + 99);
  EXPECT_EQ(s.padded_elements % world, 0);
  EXPECT_LT(s.padded_elements - s.total_elements, 3 * world);
  EXPECT_EQ(s.shard_elements * world, s.padded_elements);
  EXPECT_EQ(s.shard_bytes, s.shard_elements * 4);
}

INSTANTIATE_TEST_SUITE_P(Layouts, FsdpEqualsDDP,
                         ::testing::Values(Case{"shm", 2, true}, Case{"shm", 3, false},
                                           Case{"shm", 4, true}, Case{"gloo", 2, false},
                                           Case{"gloo", 3, true}, Case{"gloo", 4, false},
                                           Case{"hier", 2, true}),
                         [](const auto& info) {
                           return info.param.backend + "_" + std::to_string(info.param.world) +
                                  (info.param.reshard ? "_reshard" : "_keep");
                         });

// ZeRO-3 frees a unit's parameters after its forward: during the forward of one unit, no other
// unit (but the one prefetched) is gathered, and outside forward and backward a parameter holds
// no memory and reading it is an error that names the way to read it.
TEST(Fsdp, ParametersHoldNoMemoryOutsideTheirUnitsUse) {
  for (const bool reshard : {true, false}) {
    std::vector<int64_t> peak(2);
    const auto errors = lockstep::testing::run_ranks_on("shm", 2, [&](int r, ProcessGroupPtr pg) {
      auto model = mlp(7);
      const auto params = model->parameters();
      FSDPOptions opts = fsdp_options(reshard);
      opts.prefetch = false;
      FullyShardedDataParallel fsdp(model, pg, opts);
      const Data b = batch_for(0, 0, r, 2);
      cross_entropy(fsdp.forward(b.x), b.y).backward();
      EXPECT_EQ(params[0].storage()->nbytes(), 0u);
      peak[r] = fsdp.stats().peak_gathered_bytes;  // before summon_full_params gathers them all
      try {
        (void)params[0].to_vector<double>();
        ADD_FAILURE() << "reading a resharded parameter did not throw";
      } catch (const Error& e) {
        EXPECT_THAT(e.what(), ::testing::HasSubstr("FullyShardedDataParallel"));
      }
      {
        auto full = fsdp.summon_full_params();
        EXPECT_EQ(params[0].numel(), 6 * 32);
        EXPECT_TRUE(std::isfinite(params[0].to_vector<double>()[0]));
      }
      EXPECT_EQ(params[0].storage()->nbytes(), 0u);
    });
    for (const auto& e : errors) EXPECT_EQ(e, "");
    // All three units at once (1379 floats, padded) only when they are kept from the forward.
    const int64_t all_units = (224 + 1056 + 100) * 4;
    if (reshard) {
      EXPECT_LT(peak[0], all_units) << "ZeRO-3 kept more than one unit gathered";
      EXPECT_GE(peak[0], 1056 * 4);
    } else {
      EXPECT_GE(peak[0], all_units);
    }
  }
}

// A checkpoint in the full format moves between layouts: FSDP at 4 ranks -> FSDP at 3 and DDP at
// 2 ranks -> back into FSDP at 2; each continuation equals DDP's continuation at that size.
TEST(Fsdp, FullStateMovesBetweenFsdpAndDdpAtOtherWorldSizes) {
  const Result saved = run_all("shm", 4, {.layout = Layout::fsdp, .steps = 3})[0];
  const Result ddp_saved = run_all("shm", 4, {.layout = Layout::ddp, .steps = 3})[0];
  expect_same(saved.model, ddp_saved.model);
  expect_same(saved.optimizer, ddp_saved.optimizer);
  const Result fsdp3 =
      run_all("shm", 3, {.layout = Layout::fsdp, .steps = 2, .start = 3, .from = &saved})[0];
  const Result ddp3 =
      run_all("shm", 3, {.layout = Layout::ddp, .steps = 2, .start = 3, .from = &saved})[0];
  expect_same(fsdp3.model, ddp3.model);
  expect_same(fsdp3.optimizer, ddp3.optimizer);
  const Result fsdp2 =
      run_all("gloo", 2,
              {.layout = Layout::fsdp, .reshard = false, .steps = 2, .start = 5, .from = &ddp3})[0];
  const Result ddp2 =
      run_all("gloo", 2, {.layout = Layout::ddp, .steps = 2, .start = 5, .from = &ddp3})[0];
  expect_same(fsdp2.model, ddp2.model);
  expect_same(fsdp2.optimizer, ddp2.optimizer);
}

// A sharded checkpoint (each rank's pieces, io/sharded_checkpoint.h) written by 4 FSDP ranks
// holds the full state bitwise (consolidated into one file: DDP's model and optimizer state at
// that step), and 3 FSDP ranks that read only their own pieces continue as 3 DDP ranks continue
// from the full state.
TEST(Fsdp, ShardedCheckpointOfFourRanksResumesInThreeAndConsolidates) {
  const std::string dir = ::testing::TempDir() + "fsdp_sharded_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::vector<std::vector<io::TensorSlice>> shards(4);
  const auto errors = lockstep::testing::run_ranks_on("shm", 4, [&](int r, ProcessGroupPtr pg) {
    auto model = mlp(7);
    FullyShardedDataParallel fsdp(model, pg, fsdp_options(true));
    auto opt = fsdp.wrap_optimizer(groups_of(*model), adamw);
    for (int s = 0; s < 3; ++s) {
      const Data b = batch_for(s, 0, r, 4);
      opt->zero_grad();
      cross_entropy(fsdp.forward(b.x), b.y).backward();
      fsdp.clip_grad_norm(kClip);
      opt->step();
    }
    for (auto& slice : fsdp.state_slices(opt.get())) {
      slice.data = slice.data.clone();
      shards[r].push_back(std::move(slice));
    }
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  io::TrainingCheckpoint meta;
  meta.step = 3;
  meta.world_size = 4;
  io::save_sharded_checkpoint(dir, shards, meta);

  // The same 3 steps under DDP give the full state to compare with.
  const Result ddp_saved = run_all("shm", 4, {.layout = Layout::ddp, .steps = 3})[0];
  const std::string file = dir + ".consolidated.safetensors";
  io::consolidate(dir, file);
  const io::TrainingCheckpoint whole = io::load_checkpoint(file);
  expect_same_by_name(whole.model, ddp_saved.model);
  // The file names optimizer state by parameter ("optim.0.weight.exp_avg"), DDP's state_dict
  // by index: the same tensors.
  ASSERT_EQ(whole.optimizer.size(), ddp_saved.optimizer.size());
  optim::NamedTensors indexed;
  const auto names = mlp(7)->named_parameters();
  for (auto [name, t] : whole.optimizer) {
    for (size_t k = 0; k < names.size(); ++k)
      if (name.rfind(names[k].first + ".", 0) == 0)
        name = std::to_string(k) + name.substr(names[k].first.size());
    indexed.emplace_back(name, t);
  }
  expect_same_by_name(indexed, ddp_saved.optimizer);

  std::vector<Result> resumed(3);
  const auto errors3 = lockstep::testing::run_ranks_on("shm", 3, [&](int r, ProcessGroupPtr pg) {
    auto model = mlp(7);
    FullyShardedDataParallel fsdp(model, pg, fsdp_options(false));
    auto opt = fsdp.wrap_optimizer(groups_of(*model), adamw);
    const io::ShardedCheckpointReader reader(dir);
    std::vector<std::string> names;
    for (const auto& t : reader.tensors()) names.push_back(t.name);
    std::vector<io::TensorSlice> mine;
    for (const auto& req : fsdp.state_requests(names, opt.get())) mine.push_back(reader.read(req));
    fsdp.load_state_slices(mine, opt.get());
    for (int s = 3; s < 5; ++s) {
      const Data b = batch_for(s, 0, r, 3);
      opt->zero_grad();
      cross_entropy(fsdp.forward(b.x), b.y).backward();
      fsdp.clip_grad_norm(kClip);
      opt->step();
    }
    resumed[r].model = fsdp.full_state_dict();
    resumed[r].optimizer = opt->state_dict();
  });
  for (const auto& e : errors3) EXPECT_EQ(e, "");
  const Result ddp3 =
      run_all("shm", 3, {.layout = Layout::ddp, .steps = 2, .start = 3, .from = &ddp_saved})[0];
  expect_same(resumed[0].model, ddp3.model);
  expect_same(resumed[0].optimizer, ddp3.optimizer);
  std::filesystem::remove_all(dir);
  std::filesystem::remove(file);
}

// A GradScaler over the wrapped optimizer: an overflow in one rank's shard of the gradient skips
// the step on every rank.
TEST(Fsdp, GradScalerSkipsOnEveryRankWhenOneShardOverflows) {
  std::vector<std::vector<double>> firsts(2);
  std::vector<bool> skipped(2);
  const auto errors = lockstep::testing::run_ranks_on("shm", 2, [&](int r, ProcessGroupPtr pg) {
    auto model = mlp(7);
    FullyShardedDataParallel fsdp(model, pg, fsdp_options(true));
    auto opt = fsdp.wrap_optimizer(groups_of(*model), adamw);
    amp::GradScaler scaler;
    const Data b = batch_for(0, 0, r, 2);
    opt->zero_grad();
    scaler.scale(cross_entropy(fsdp.forward(b.x), b.y)).backward();
    // Rank 1's shard alone overflows. (An input of 1e36 did it only as a matter of rounding: the
    // scaled loss stayed finite and the gradients ended near the f32 maximum.)
    if (r == 1) {
      Tensor g = opt->step_gradients()[0];
      ASSERT_GT(g.numel(), 0);
      g.set_at({0}, std::numeric_limits<double>::infinity());
    }
    scaler.step(*opt);
    scaler.update();
    skipped[r] = scaler.last_step_skipped();
    // The decision is collective: an inf on rank 1 alone is every rank's.
    EXPECT_TRUE(opt->agree_found_inf(r == 1)) << "rank " << r;
    EXPECT_FALSE(opt->agree_found_inf(false)) << "rank " << r;
    firsts[r] = fsdp.full_state_dict()[0].second.to_vector<double>();
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_TRUE(skipped[0]);
  EXPECT_TRUE(skipped[1]);
  EXPECT_EQ(firsts[0], firsts[1]);
  EXPECT_EQ(firsts[0], mlp(7)->state_dict()[0].second.to_vector<double>());  // not stepped
}

// The pitfall of an optimizer built over the wrapped module's own parameters: it would find no
// gradient and step nothing, silently; their gradients are placeholders that fail when read,
// saying how to build it (Note [FSDP placeholder gradients]). The next step trains as usual.
TEST(Fsdp, AnOptimizerOverTheWrappedModulesParametersFailsSayingHowToBuildIt) {
  const auto errors = lockstep::testing::run_ranks_on("shm", 2, [&](int r, ProcessGroupPtr pg) {
    auto model = mlp(7);
    FullyShardedDataParallel fsdp(model, pg, fsdp_options(true));
    optim::AdamW wrong(model->parameters(), optim::AdamWOptions{});
    for (int s = 0; s < 2; ++s) {
      const Data b = batch_for(s, 0, r, 2);
      cross_entropy(fsdp.forward(b.x), b.y).backward();
    }
    wrong.step();
  });
  for (const auto& e : errors)
    EXPECT_THAT(e, ::testing::HasSubstr("build the optimizer with "
                                        "wrap_optimizer()"));
}

// Note [FSDP mixed precision]: bf16 gathers and compute over f32 master shards, gradients
// reduced in f32 or in bf16. The master state stays f32, the gathered memory halves, and the
// losses and gradient norms of 6 steps stay within 2% of the f32 run's (bf16 keeps 8 bits of
// mantissa), without being the same bits (it did compute in bf16).
TEST(Fsdp, Bf16GathersAndComputeOverF32MasterShards) {
  struct Out {
    std::vector<double> losses, norms;
    FSDPStats stats;
    DType master = DType::f64;
  };
  auto run = [](std::optional<DType> param, std::optional<DType> reduce) {
    std::vector<Out> out(2);
    const auto errors = lockstep::testing::run_ranks_on("shm", 2, [&](int r, ProcessGroupPtr pg) {
      auto model = mlp(7);
      FSDPOptions opts = fsdp_options(true);
      opts.param_dtype = param;
      opts.reduce_dtype = reduce;
      FullyShardedDataParallel fsdp(model, pg, opts);
      auto opt = fsdp.wrap_optimizer(groups_of(*model), adamw);
      for (int s = 0; s < 6; ++s) {
        const Data b = batch_for(s, 0, r, 2);
        opt->zero_grad();
        Tensor loss = cross_entropy(fsdp.forward(b.x), b.y);
        out[r].losses.push_back(loss.item());
        loss.backward();
        out[r].norms.push_back(fsdp.clip_grad_norm(kClip));
        opt->step();
      }
      out[r].stats = fsdp.stats();
      out[r].master = fsdp.full_state_dict()[0].second.dtype();
      for (const auto& [name, t] : opt->state_dict())
        if (t.dim() > 0) EXPECT_EQ(t.dtype(), kFloat32) << name;
    });
    for (const auto& e : errors) EXPECT_EQ(e, "");
    return out[0];
  };
  const Out f32 = run(std::nullopt, std::nullopt);
  for (const auto& reduce : {std::optional<DType>(kFloat32), std::optional<DType>(kBFloat16)}) {
    const Out mixed = run(kBFloat16, reduce);
    EXPECT_EQ(mixed.master, kFloat32);  // checkpoints hold the master's values
    EXPECT_EQ(mixed.stats.peak_gathered_bytes * 2, f32.stats.peak_gathered_bytes);
    EXPECT_NE(mixed.losses, f32.losses);
    for (size_t s = 0; s < f32.losses.size(); ++s) {
      EXPECT_NEAR(mixed.losses[s], f32.losses[s], 0.02 * f32.losses[s]) << "step " << s;
      EXPECT_NEAR(mixed.norms[s], f32.norms[s], 0.02 * f32.norms[s]) << "step " << s;
    }
  }
}

TEST(Fsdp, ShardGroupsRefusesATensorThatIsNoParameterOfTheModel) {
  const auto errors = lockstep::testing::run_ranks_on("shm", 2, [&](int, ProcessGroupPtr pg) {
    auto model = mlp(7);
    FullyShardedDataParallel fsdp(model, pg, fsdp_options(true));
    (void)fsdp.shard_groups({optim::ParamGroup{{zeros({3})}}});
  });
  for (const auto& e : errors)
    EXPECT_THAT(e, ::testing::HasSubstr("expected parameters of the wrapped module"));
}

TEST(Fsdp, RanksWithDifferentModelsFailOnEveryRankNamingTheDifference) {
  const auto errors = lockstep::testing::run_ranks_on("shm", 2, [&](int r, ProcessGroupPtr pg) {
    FullyShardedDataParallel fsdp(mlp(7, r == 0 ? 32 : 16), pg, fsdp_options(true));
  });
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("FullyShardedDataParallel: ranks built different models"));
    EXPECT_THAT(e, ::testing::HasSubstr("rank 1"));
  }
}

// Note [Join and FSDP]: uneven inputs. Ranks with 1, 3 and 4 steps of data (and, accumulating 2
// micro-batches per step without resharding, 0, 2 and 5, rank 0 giving a shadow input) train
// under a Join, clipping in the step the joined ranks take too, to the very parameters and
// optimizer state of DDP under a Join with the same data.
struct JoinSpec {
  bool reshard = true;
  int micro = 1;
  std::vector<int> steps;  // by rank
};

Result train_joined(int r, const ProcessGroupPtr& pg, bool use_fsdp, const JoinSpec& spec) {
  auto model = mlp(7);
  const int world = pg->size();
  const int steps = spec.steps[static_cast<size_t>(r)];
  Result res;
  // One step of this rank's data: forward and backward of each micro-batch, the last synchronized.
  auto backward = [&](nn::Module& net, int s, auto no_sync) {
    for (int m = 0; m < spec.micro; ++m) {
      const Data b = batch_for(s, m, r, world);
      if (m + 1 < spec.micro) {
        auto scope = no_sync();
        cross_entropy(net.forward(b.x), b.y).backward();
      } else {
        cross_entropy(net.forward(b.x), b.y).backward();
      }
    }
  };
  if (use_fsdp) {
    FullyShardedDataParallel fsdp(model, pg, fsdp_options(spec.reshard));
    auto opt = fsdp.wrap_optimizer(groups_of(*model), adamw);
    auto step = [&] {
      fsdp.clip_grad_norm(kClip);
      opt->step();
    };
    JoinOptions jo{.optimizer = opt.get(), .step = step};
    if (steps == 0) jo.shadow_input = batch_for(0, 0, r, world).x;
    Join join(fsdp, jo);
    for (int s = 0; join.next(s < steps); ++s) {
      opt->zero_grad();
      backward(fsdp, s, [&] { return fsdp.no_sync(); });
      step();
    }
    res.norms = {static_cast<double>(join.steps_shadowed())};
    res.model = fsdp.full_state_dict();
    res.optimizer = opt->state_dict();
    return res;
  }
  DistributedDataParallel ddp(model, pg);
  auto opt = adamw(groups_of(*model));
  Join join(ddp, {.optimizer = opt.get()});
  for (int s = 0; join.next(s < steps); ++s) {
    opt->zero_grad();
    backward(ddp, s, [&] { return ddp.no_sync(); });
    optim::clip_grad_norm(model->parameters(), kClip);
    opt->step();
  }
  res.model = model->state_dict();
  res.optimizer = opt->state_dict();
  return res;
}

TEST(Fsdp, UnevenInputsUnderJoinEqualDDPUnderJoin) {
  for (const auto& [backend, spec] :
       {std::pair{"shm", JoinSpec{.reshard = true, .micro = 1, .steps = {1, 3, 4}}},
        std::pair{"gloo", JoinSpec{.reshard = false, .micro = 2, .steps = {0, 2, 5}}}}) {
    SCOPED_TRACE(spec.reshard ? "shm, reshard_after_forward, 1, 3 and 4 steps"
                              : "gloo, kept for the backward, 2 micro-batches, 0, 2 and 5 steps");
    std::vector<Result> fsdp(3), ddp(3);
    for (const bool use_fsdp : {true, false}) {
      const auto errors =
          lockstep::testing::run_ranks_on(backend, 3, [&](int r, ProcessGroupPtr pg) {
            (use_fsdp ? fsdp : ddp)[static_cast<size_t>(r)] = train_joined(r, pg, use_fsdp, spec);
          });
      for (int r = 0; r < 3; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
    }
    const int last = *std::max_element(spec.steps.begin(), spec.steps.end());
    for (int r = 0; r < 3; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      // Each rank shadowed the forwards of the steps it had no data for.
      EXPECT_EQ(fsdp[r].norms,
                std::vector<double>{static_cast<double>((last - spec.steps[r]) * spec.micro)});
      expect_same(fsdp[r].model, ddp[0].model);
      expect_same(fsdp[r].optimizer, ddp[0].optimizer);
      expect_same(ddp[r].model, ddp[0].model);
    }
    // The steps moved the model.
    EXPECT_NE(fsdp[0].model[0].second.to_vector<double>(),
              mlp(7)->state_dict()[0].second.to_vector<double>());
  }
}

// A rank out of data before its first batch has nothing to run the model on: it says so, and
// what to give (the other ranks then fail on their timeout or the error's abort).
TEST(Fsdp, AJoinedRankWithoutAnyInputSaysToGiveAShadowInput) {
  const auto errors = lockstep::testing::run_ranks_on(
      "shm", 2,
      [&](int r, ProcessGroupPtr pg) {
        auto model = mlp(7);
        FullyShardedDataParallel fsdp(model, pg, fsdp_options(true));
        auto opt = fsdp.wrap_optimizer(groups_of(*model), adamw);
        Join join(fsdp, {.optimizer = opt.get()});
        for (int s = 0; join.next(r == 1 && s < 1); ++s) {
          const Data b = batch_for(s, 0, r, 2);
          cross_entropy(fsdp.forward(b.x), b.y).backward();
          opt->step();
        }
      },
      std::chrono::seconds(5));
  EXPECT_THAT(errors[0], ::testing::HasSubstr("give JoinOptions::shadow_input"));
  EXPECT_NE(errors[1], "");
}

// Under FSDP a Join needs the wrapped optimizer: every rank steps its own shards.
TEST(Fsdp, JoinWithoutTheWrappedOptimizerIsRefused) {
  const auto errors = lockstep::testing::run_ranks_on("shm", 1, [&](int, ProcessGroupPtr pg) {
    auto model = mlp(7);
    FullyShardedDataParallel fsdp(model, pg, fsdp_options(true));
    optim::SGD plain(model->parameters(), {.lr = 0.1});
    Join join(fsdp, {.optimizer = &plain});
  });
  EXPECT_THAT(errors[0], ::testing::HasSubstr("must be the optimizer wrap_optimizer() built"));
}

// The units go through the comm-hook interface (comm_hook.h), as DDP's buckets do: a hook that
// records what it is given and hands on to reduce_scatter_hook() trains to the default's very
// parameters, and saw each unit once per synchronized backward, padded to the world size, with
// its parameters' names.
TEST(Fsdp, UnitsAreReducedThroughTheCommHook) {
  constexpr int kWorld = 3;
  std::vector<Result> plain(kWorld), hooked(kWorld);
  std::vector<std::vector<std::string>> seen(kWorld);
  for (const bool hook : {false, true}) {
    const auto errors =
        lockstep::testing::run_ranks_on("shm", kWorld, [&](int r, ProcessGroupPtr pg) {
          auto model = mlp(7);
          FSDPOptions opts = fsdp_options(true);
          if (hook) {
            const CommHook inner = reduce_scatter_hook();
            opts.comm_hook = {"recording",
                              [&, inner, r](ProcessGroup& g, GradBucket& b) {
                                seen[r].push_back(std::to_string(b.index) + ":" +
                                                  std::to_string(b.numel) + ":" +
                                                  b.parameter_names.front());
                                EXPECT_EQ(b.numel % kWorld, 0);
                                return inner.start(g, b);
                              },
                              inner.finish, nullptr, nullptr};
          }
          FullyShardedDataParallel fsdp(model, pg, opts);
          auto opt = fsdp.wrap_optimizer(groups_of(*model), adamw);
          for (int s = 0; s < 2; ++s) {
            opt->zero_grad();
            const Data b = batch_for(s, 0, r, kWorld);
            cross_entropy(fsdp.forward(b.x), b.y).backward();
            opt->step();
          }
          (hook ? hooked : plain)[r].model = fsdp.full_state_dict();
        });
    for (int r = 0; r < kWorld; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  }
  for (int r = 0; r < kWorld; ++r) {
    expect_same(hooked[r].model, plain[r].model);
    // Three units (the Linears, last first in the backward), twice; sizes padded to 3.
    EXPECT_EQ(seen[r],
              (std::vector<std::string>{"3:99:4.weight", "2:1056:2.weight", "1:225:0.weight",
                                        "3:99:4.weight", "2:1056:2.weight", "1:225:0.weight"}))
        << "rank " << r;
  }
}

// A hook that does not shard (DDP's all-reduce) leaves no shard: FSDP says which hook, which
// unit, and what it needs.
TEST(Fsdp, AHookThatDoesNotShardIsNamed) {
  const auto errors = lockstep::testing::run_ranks_on("shm", 2, [&](int r, ProcessGroupPtr pg) {
    auto model = mlp(7);
    FSDPOptions opts = fsdp_options(true);
    opts.comm_hook = allreduce_hook();
    FullyShardedDataParallel fsdp(model, pg, opts);
    const Data b = batch_for(0, 0, r, 2);
    cross_entropy(fsdp.forward(b.x), b.y).backward();
  });
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("the comm hook 'allreduce' left no tensor in "
                                        "GradBucket::shard for unit 3"));
    EXPECT_THAT(e, ::testing::HasSubstr("FSDP needs a sharding hook, as reduce_scatter_hook()"));
  }
}

}  // namespace
