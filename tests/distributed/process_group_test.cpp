// ProcessGroup with ranks as threads over a HashStore: every collective and dtype against a
// reference, the Work contract, timeouts, argument errors, the registry and the world of one.
#include <atomic>
#include <fstream>
#include <future>
#include <thread>

#include "distributed/collective_sweep.h"
#include "distributed/thread_ranks.h"
#include "lockstep/distributed/gloo/process_group_gloo.h"
#include "lockstep/distributed/store/hash_store.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using lockstep::testing::expect_error;
using namespace std::chrono_literals;

namespace {

using lockstep::testing::run_ranks;

void expect_all_succeeded(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

class GlooThreads : public ::testing::TestWithParam<int> {};

TEST_P(GlooThreads, EveryCollectiveEveryDtypeMatchesReference) {
  expect_all_succeeded(run_ranks(
      GetParam(), [](int, ProcessGroupPtr pg) { lockstep::testing::run_collective_sweep(*pg); }));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooThreads, ::testing::Values(1, 2, 3, 4));

// Bytes this process has handed to write-like system calls (sockets included): both ranks are
// its threads, so this counts what the two ranks sent each other.
int64_t bytes_written() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "wchar:") return value;
  }
  return -1;
}

// A reduce_scatter is a real one (Note [Gloo rank-order reduction]): of a 2 x 4 MiB input, each
// of 2 ranks sends one 4 MiB chunk, half of what an all_reduce of the same 8 MiB sends (2 x
// (n - 1) / n of the tensor); an all_reduce of a copy, as before, sent all of it.
TEST(GlooThreads, ReduceScatterSendsHalfTheBytesOfAnAllReduce) {
  ASSERT_GE(bytes_written(), 0) << "no wchar in /proc/self/io";
  constexpr int64_t kChunk = 1 << 20;  // elements (4 MiB of f32)
  std::atomic<int64_t> scatter_bytes{0}, reduce_bytes{0};
  expect_all_succeeded(run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    Tensor in = full({2 * kChunk}, 1.0 + r, kFloat32), out = empty({kChunk}, kFloat32);
    auto measure = [&](const std::function<void()>& collective, std::atomic<int64_t>& into) {
      pg->barrier()->wait();
      const int64_t before = bytes_written();
      pg->barrier()->wait();
      collective();
      pg->barrier()->wait();
      if (r == 0) into = bytes_written() - before;
    };
    measure([&] { pg->reduce_scatter(out, in)->wait(); }, scatter_bytes);
    LS_CHECK(out.to_vector<double>() == std::vector<double>(kChunk, 3.0), "reduce_scatter sum");
    measure([&] { pg->all_reduce(in)->wait(); }, reduce_bytes);
  }));
  const double ratio = static_cast<double>(scatter_bytes) / static_cast<double>(reduce_bytes);
  EXPECT_GT(scatter_bytes.load(), 2 * kChunk * 4 * 9 / 10) << "both ranks send a 4 MiB chunk";
  EXPECT_NEAR(ratio, 0.5, 0.1) << scatter_bytes << " bytes for reduce_scatter, " << reduce_bytes
                               << " for all_reduce";
}

// Gloo itself trusts its callers: a longer message than the receiver posted killed the process
// with an assertion on Gloo's own thread (Note [Gloo signature check]).
TEST(GlooThreads, MismatchesFailEveryRankNamingBothAndTheGroupGoesOn) {
  expect_all_succeeded(run_ranks(
      3, [](int r, ProcessGroupPtr pg) { lockstep::testing::run_mismatch_round(r, *pg); }));
}

TEST(WorldOfOne, EveryCollectiveIsTheIdentity) {
  WorldOfOneGroup pg;
  lockstep::testing::run_collective_sweep(pg);
  EXPECT_EQ(pg.backend(), "local");
}

TEST(ProcessGroupGloo, SumsBf16AndF16AsNumbersNotBitPatterns) {
  // 1.5 + 2.25 = 3.75 in either format; summed as integers the bit patterns would give garbage.
  expect_all_succeeded(run_ranks(2, [](int r, ProcessGroupPtr pg) {
    for (DType t : {kBFloat16, kFloat16}) {
      Tensor x = full({5}, r == 0 ? 1.5 : 2.25, t);
      pg->all_reduce(x)->wait();
      for (double v : x.to_vector<double>()) LS_CHECK(v == 3.75, dtype_name(t), ": got ", v);
    }
  }));
}

TEST(ProcessGroupGloo, IsCompletedNeverBlocksAndWaitWithTimeoutGivesUp) {
  std::promise<void> checked;
  auto checked_future = checked.get_future().share();
  expect_all_succeeded(run_ranks(2, [&](int r, ProcessGroupPtr pg) {
    Tensor x = full({4}, 1.0, kFloat32);
    if (r == 0) {
      WorkPtr w = pg->all_reduce(x);
      // Rank 1 has not issued its all_reduce yet, so this one cannot have completed.
      LS_CHECK(!w->is_completed(), "completed before the peer joined");
      LS_CHECK(!w->is_success(), "succeeded before the peer joined");
      try {
        w->wait(20ms);
        LS_THROW("wait(20ms) returned although the peer had not joined");
      } catch (const Error& e) {
        LS_CHECK(std::string(e.what()).find("all_reduce #1") != std::string::npos, e.what());
        LS_CHECK(std::string(e.what()).find("did not complete within") != std::string::npos,
                 e.what());
      }
      checked.set_value();
      w->wait();
      LS_CHECK(w->is_completed() && w->is_success() && w->exception() == nullptr, "not done");
    } else {
      checked_future.wait();
      pg->all_reduce(x)->wait();
    }
    for (double v : x.to_vector<double>()) LS_CHECK(v == 2.0, "got ", v);
  }));
}

// Callers wait; completing a Work is a backend's (ProcessGroup's protected work_* functions).
template <typename W>
concept CallerCanWait = requires(W& w) {
  w.wait();
  w.is_completed();
  w.is_success();
  w.exception();
};
template <typename W>
concept CallerCanFinish = requires(W& w) {
  w.finish();
};
template <typename W>
concept CallerCanChain = requires(W& w) {
  w.then(std::function<void()>());
};
template <typename W>
concept CallerCanHook = requires(W& w) {
  w.set_wait_hook(std::function<void(const W&)>());
};
static_assert(CallerCanWait<Work>);
static_assert(!CallerCanFinish<Work> && !CallerCanChain<Work> && !CallerCanHook<Work>);

struct BackendSide : ProcessGroup {
  using ProcessGroup::work_finish;
  using ProcessGroup::work_set_wait_hook;
};

TEST(Work, ABackendCompletesItAndWaitRethrowsItsError) {
  Work ok("test op #1", 1);
  int hooked = 0;
  // Runs the "collective" on the waiting thread, as Gloo's hook does (Note [Caller runs] in
  // src/distributed/gloo/process_group_gloo.cpp).
  BackendSide::work_set_wait_hook(ok, [&](const Work& w) {
    hooked += &w == &ok;
    BackendSide::work_finish(ok);
  });
  EXPECT_FALSE(ok.is_completed());
  ok.wait();
  EXPECT_EQ(hooked, 1);
  EXPECT_TRUE(ok.is_success());

  Work failed("test op #2", 2);
  BackendSide::work_finish(failed, std::make_exception_ptr(Error("peer gone", __FILE__, __LINE__)));
  BackendSide::work_finish(failed);  // a second finish changes nothing
  EXPECT_TRUE(failed.is_completed());
  EXPECT_FALSE(failed.is_success());
  expect_error([&] { failed.wait(); }, {"peer gone"});
}

TEST(ProcessGroupGloo, CollectivesRunOffTheCallingThread) {
  // The caller queues and returns; the collective completes while the caller does other work.
  expect_all_succeeded(run_ranks(2, [](int r, ProcessGroupPtr pg) {
    Tensor x = full({1 << 20}, 1.0, kFloat32);
    WorkPtr w = pg->all_reduce(x);
    while (!w->is_completed()) std::this_thread::sleep_for(1ms);  // "compute"
    w->wait();
    LS_CHECK(x.to_vector<double>()[12345] == 2.0, "wrong value");
  }));
}

TEST(ProcessGroupGloo, TimeoutFailsEveryWaitingRankNamingOpAndSequence) {
  // Ranks 0 and 1 enter an all_reduce that rank 2 never joins.
  std::promise<void> failed0, failed1;
  auto f0 = failed0.get_future().share(), f1 = failed1.get_future().share();
  std::vector<std::string> first(3), later(3);
  auto errors = run_ranks(3, [&](int r, ProcessGroupPtr pg) {
    pg->barrier()->wait();  // #1
    if (r == 2) {
      f0.wait();
      f1.wait();
      return;
    }
    Tensor x = full({16}, 1.0, kFloat32);
    try {
      pg->all_reduce(x, {.op = ReduceOp::sum, .timeout = 300ms})->wait();  // #2
    } catch (const Error& e) {
      first[r] = e.what();
    }
    // The group is unusable now, and says why at once.
    try {
      pg->all_reduce(x)->wait();
    } catch (const Error& e) {
      later[r] = e.what();
    }
    (r == 0 ? failed0 : failed1).set_value();
  });
  expect_all_succeeded(errors);
  bool someone_timed_out = false;
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(first[r], ::testing::HasSubstr("rank " + std::to_string(r) + "/3 (gloo)"));
    EXPECT_THAT(first[r], ::testing::HasSubstr("all_reduce #2 (sum, 1 tensor, 64 B of f32)"));
    EXPECT_THAT(first[r], ::testing::AnyOf(::testing::HasSubstr("timed out after 300 ms"),
                                           ::testing::HasSubstr("closed its connection")));
    someone_timed_out |= first[r].find("timed out after 300 ms") != std::string::npos;
    EXPECT_THAT(later[r], ::testing::HasSubstr("all_reduce #3"));
    EXPECT_THAT(later[r], ::testing::HasSubstr("failed earlier (all_reduce #2"));
  }
  EXPECT_TRUE(someone_timed_out) << first[0] << "\n" << first[1];
}

TEST(ProcessGroupGloo, RendezvousTimesOutNamingTheProblem) {
  auto store = std::make_shared<HashStore>(30s);
  BackendConfig c;
  c.store = store;
  c.rank = 0;
  c.size = 2;
  c.timeout = 200ms;
  expect_error([&] { ProcessGroupGloo pg(c); }, {"rank 0/2 (gloo)", "rendezvous"});
}

TEST(ProcessGroup, ArgumentErrorsSayWhatWasExpected) {
  WorldOfOneGroup pg;
  expect_error([&] { pg.all_reduce(full({3}, 1.0, kUInt8)); },
               {"all_reduce cannot reduce u8", "expected f32"});
  expect_error([&] { pg.all_reduce(full({3}, 1.0, kInt32), {.op = ReduceOp::avg}); },
               {"avg needs floating-point tensors, got i32"});
  expect_error([&] { pg.all_reduce(std::vector<Tensor>{}); }, {"at least one tensor"});
  expect_error(
      [&] {
        pg.all_reduce(std::vector<Tensor>{zeros({2}), zeros({2}, kFloat64)});
      },
      {"tensor 0 is f32, tensor 1 is f64"});
  expect_error([&] { pg.all_reduce(Tensor()); }, {"tensor 0 is undefined"});
  expect_error([&] { pg.broadcast(zeros({2}), {.root = 1}); }, {"root 1 is outside [0, 1)"});
  expect_error([&] { pg.all_gather(zeros({3}), zeros({2})); },
               {"output needs 1 x 2 = 2 elements", "got 3"});
  expect_error([&] { pg.reduce_scatter(zeros({2}), zeros({3})); },
               {"input needs 1 x 2 = 2 elements", "got 3"});
  // In place is the output at the input's chunk rank(); any other overlap is refused.
  Tensor buf = full({5}, 1.0, kFloat32);
  expect_error([&] { pg.reduce_scatter(buf.narrow(0, 1, 4), buf.narrow(0, 0, 4)); },
               {"output overlaps the input other than as its chunk 0",
                "starts 1 elements into the input, expected 0"});
  pg.reduce_scatter(buf.narrow(0, 0, 4), buf.narrow(0, 0, 4))->wait();  // in place
  EXPECT_EQ(buf.to_vector<double>(), std::vector<double>(5, 1.0));
  expect_error(
      [&] {
        pg.all_gather(std::vector<Tensor>{zeros({2}), zeros({2})}, zeros({2}));
      },
      {"expected 1 output tensors", "got 2"});
  expect_error([&] { pg.barrier({.timeout = -1ms}); }, {"timeout >= 0 ms"});
  // None of the rejected calls took a sequence number (the in-place one took 1).
  EXPECT_EQ(pg.sequence_number(), 1);
  EXPECT_EQ(pg.barrier()->seq(), 2);
}

TEST(ProcessGroup, AllGatherListFormAndStridedOutputs) {
  expect_all_succeeded(run_ranks(3, [](int r, ProcessGroupPtr pg) {
    std::vector<Tensor> outs = {zeros({2, 2}), zeros({2, 2}), zeros({4}, kFloat32)};
    pg->all_gather(outs, full({2, 2}, r + 1.0))->wait();
    for (int k = 0; k < 3; ++k) {
      for (double v : outs[k].to_vector<double>()) LS_CHECK(v == k + 1.0, "outs[", k, "]: ", v);
    }
    // A transposed output and a strided reduce_scatter output are written through.
    Tensor out = zeros({2, 3}).t();  // [3, 2] view, not contiguous
    pg->all_gather(out, full({2}, r + 1.0))->wait();
    const auto got = out.contiguous().to_vector<double>();
    for (int k = 0; k < 3; ++k) LS_CHECK(got[2 * k] == k + 1.0 && got[2 * k + 1] == k + 1.0, k);
    Tensor big = zeros({4});
    Tensor every_other = big.slice(0, 0, 4, 2);
    pg->reduce_scatter(every_other, full({6}, 1.0))->wait();
    const auto b = big.to_vector<double>();
    LS_CHECK(b[0] == 3 && b[1] == 0 && b[2] == 3 && b[3] == 0, "strided reduce_scatter");
  }));
}

TEST(ProcessGroup, CollectivesWriteIntoParametersThatRequireGrad) {
  expect_all_succeeded(run_ranks(2, [](int r, ProcessGroupPtr pg) {
    Tensor w = full({3, 2}, r == 0 ? 5.0 : -1.0).requires_grad_();
    pg->broadcast(w)->wait();
    for (double v : w.to_vector<double>()) LS_CHECK(v == 5.0, "got ", v);
    Tensor v = full({2, 3}, 1.0).requires_grad_();
    pg->broadcast(std::vector<Tensor>{v.t(), w})->wait();  // packed path
  }));
}

TEST(Registry, KnowsGlooUnknownNamesListTheRegisteredOnes) {
  EXPECT_TRUE(has_backend("gloo"));
  BackendConfig c;
  c.size = 2;
  expect_error([&] { create_process_group("mpi", c); },
               {"unknown process group backend 'mpi'", "gloo"});
  // A world of one needs no store and no network, whatever the backend.
  c.size = 1;
  EXPECT_EQ(create_process_group("gloo", c)->backend(), "local");
  c.size = 2;
  expect_error([&] { create_process_group("gloo", c); }, {"needs a store"});
}

// The linker keeps a static library's object files only when something references them, so a
// backend that registered itself from a static initializer would be missing here. The child is a
// fresh process (the threadsafe style re-executes this binary): nothing has touched the registry
// or the Gloo backend before it asks for "gloo" by name.
TEST(Registry, AFreshProcessBuildsGlooGroupsByName) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        auto store = std::make_shared<HashStore>(30s);
        std::atomic<int> ok{0};
        std::vector<std::thread> ts;
        for (int r = 0; r < 2; ++r) {
          ts.emplace_back([&, r] {
            BackendConfig c;
            c.store = store;
            c.rank = r;
            c.size = 2;
            auto pg = create_process_group("gloo", c);
            Tensor x = full({2}, r + 1.0);
            pg->all_reduce(x)->wait();
            if (pg->backend() == "gloo" && x.to_vector<double>()[1] == 3.0) ++ok;
          });
        }
        for (auto& t : ts) t.join();
        std::_Exit(ok == 2 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(Registry, RegisteredFactoriesAreUsedByName) {
  std::atomic<int> made{0};
  register_backend("test-backend", [&](const BackendConfig& cfg) -> ProcessGroupPtr {
    ++made;
    return std::make_shared<ProcessGroupGloo>(cfg);
  });
  EXPECT_TRUE(has_backend("test-backend"));
  auto names = backend_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "test-backend"), names.end());
  auto store = std::make_shared<HashStore>(30s);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      BackendConfig c;
      c.store = store;
      c.rank = r;
      c.size = 2;
      create_process_group("test-backend", c)->barrier()->wait();
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(made.load(), 2);
}

}  // namespace

namespace {

TEST(ProcessGroupGloo, ARankThatCannotListenFailsTheOthersAtOnce) {
  // Rank 0 asks for an address this machine does not have (TEST-NET-1); rank 1 would otherwise
  // wait the whole 20 s for rank 0's address.
  auto store = std::make_shared<HashStore>(30s);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      try {
        BackendConfig c;
        c.store = store;
        c.rank = r;
        c.size = 2;
        c.timeout = 20s;
        if (r == 0) c.bind_address = "192.0.2.1";
        ProcessGroupGloo pg(c);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_THAT(errors[0], ::testing::HasSubstr("cannot listen on 192.0.2.1"));
  EXPECT_THAT(errors[1], ::testing::HasSubstr("another rank failed while connecting"));
  EXPECT_THAT(errors[1], ::testing::HasSubstr("cannot listen on 192.0.2.1"));
}

}  // namespace
