// The collective trace (Note [Collective trace]): what each collective leaves in the ring, in
// memory and through the file the launcher reads.
#include "lockstep/distributed/trace.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "distributed/thread_ranks.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/tensor/tensor.h"

namespace lockstep::dist {
namespace {

using ::testing::HasSubstr;

std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::temp_directory_path() /
         ("lockstep_trace_" + std::to_string(::getpid()) + "_" + name);
}

TEST(CollectiveTrace, EveryCollectiveIsRecordedWithItsSignatureAndEndsFinished) {
  const auto errors = testing::run_ranks(2, [](int rank, ProcessGroupPtr pg) {
    Tensor x = full({1024}, 1.0, kFloat32);
    pg->all_reduce(x, {.op = ReduceOp::max})->wait();
    Tensor b = full({7}, 2.0, kInt64);
    pg->broadcast(b, {.root = 1})->wait();
    Tensor out = empty({2 * 5}, kFloat64);
    pg->all_gather(out, full({5}, 1.0, kFloat64))->wait();
    Tensor rs = empty({3}, kFloat32);
    pg->reduce_scatter(rs, full({6}, 1.0, kFloat32))->wait();
    pg->barrier()->wait();
    const TraceSnapshot t = pg->trace().snapshot();
    EXPECT_EQ(t.rank, rank);
    EXPECT_EQ(t.size, 2);
    EXPECT_EQ(t.backend, "gloo");
    EXPECT_EQ(t.pid, ::getpid());
    EXPECT_EQ(t.issued, 5);
    EXPECT_EQ(t.finished, 5);
    EXPECT_EQ(t.wait_seq, 0);  // nobody waits any more
    ASSERT_EQ(t.records.size(), 5u);
    EXPECT_EQ(t.records[0].describe(), "all_reduce #1 (max, 1024 x f32)");
    EXPECT_EQ(t.records[1].describe(), "broadcast #2 (root 1, 7 x i64)");
    EXPECT_EQ(t.records[2].describe(), "all_gather #3 (5 x f64)");
    EXPECT_EQ(t.records[3].describe(), "reduce_scatter #4 (sum, 3 x f32)");
    EXPECT_EQ(t.records[4].describe(), "barrier #5");
    for (const auto& r : t.records) {
      EXPECT_EQ(r.state, TraceState::finished) << r.describe();
      EXPECT_GT(r.issued_ns, 0);
      EXPECT_GT(r.started_ns, 0) << r.describe() << ": gloo marks the start";
      EXPECT_GE(r.finished_ns, r.issued_ns);
    }
    EXPECT_EQ(t.oldest_pending(), nullptr);
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(CollectiveTrace, AFailedCollectiveIsRecordedAsFailedAndAWaitingOneAsPending) {
  std::atomic<bool> rank0_checked{false};
  const auto errors = testing::run_ranks(
      2,
      [&](int rank, ProcessGroupPtr pg) {
        Tensor x = full({4}, 1.0, kFloat32);
        pg->all_reduce(x)->wait();
        if (rank == 1) {
          // Rank 1 never issues #2: rank 0 waits, then fails at its timeout.
          while (!rank0_checked.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
          return;
        }
        WorkPtr w = pg->all_reduce(x);
        std::thread waiter([&] {
          try {
            w->wait();
          } catch (const Error&) {
          }
        });
        // While it waits: pending, and the caller is blocked on it.
        TraceSnapshot t;
        for (int i = 0; i < 400; ++i) {
          t = pg->trace().snapshot();
          if (t.wait_seq == 2) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        EXPECT_EQ(t.wait_seq, 2);
        ASSERT_NE(t.oldest_pending(), nullptr);
        EXPECT_EQ(t.oldest_pending()->seq, 2);
        waiter.join();
        t = pg->trace().snapshot();
        EXPECT_EQ(t.find(1)->state, TraceState::finished);
        EXPECT_EQ(t.find(2)->state, TraceState::failed);
        EXPECT_EQ(t.oldest_pending(), nullptr);
        EXPECT_EQ(t.wait_seq, 0);
        rank0_checked = true;
      },
      std::chrono::milliseconds(1500));
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(CollectiveTrace, TheRingKeepsTheNewestCollectivesInOrder) {
  CollectiveTrace trace;
  const int64_t n = kTraceCapacity * 2 + 17;
  for (int64_t s = 1; s <= n; ++s) {
    trace.record_issue(s, 1, 0, 0, 0, s * 10);
    trace.record_start(s);
    if (s != n) trace.record_finish(s, true);
  }
  const TraceSnapshot t = trace.snapshot();
  ASSERT_EQ(t.records.size(), static_cast<size_t>(kTraceCapacity));
  EXPECT_EQ(t.records.front().seq, n - kTraceCapacity + 1);
  EXPECT_EQ(t.records.back().seq, n);
  EXPECT_EQ(t.records.back().numel, n * 10);
  EXPECT_EQ(t.records.back().state, TraceState::started);
  EXPECT_EQ(t.finished, n - 1);
  for (size_t i = 1; i < t.records.size(); ++i) {
    EXPECT_EQ(t.records[i].seq, t.records[i - 1].seq + 1);
  }
  // A finish for a collective the ring no longer holds changes no slot.
  trace.record_finish(1, false);
  EXPECT_EQ(trace.snapshot().find(kTraceCapacity + 1), nullptr);
}

TEST(CollectiveTrace, TheExportedFileIsReadByAnotherReaderAsTheWriterUpdatesIt) {
  const auto path = temp_path("export");
  CollectiveTrace trace;
  trace.set_identity(3, 8, "shm");
  trace.record_issue(1, 1, 0, 0, 0, 64);
  trace.record_finish(1, true);
  trace.export_to(path.string());  // what came before is in the file
  trace.record_issue(2, 2, 5, 0, 4, 9);
  std::string why;
  auto t = read_trace_file(path.string(), &why);
  ASSERT_TRUE(t.has_value()) << why;
  EXPECT_EQ(t->rank, 3);
  EXPECT_EQ(t->size, 8);
  EXPECT_EQ(t->backend, "shm");
  EXPECT_EQ(t->issued, 2);
  ASSERT_EQ(t->records.size(), 2u);
  EXPECT_EQ(t->records[0].state, TraceState::finished);
  EXPECT_EQ(t->records[1].describe(), "broadcast #2 (root 4, 9 x i64)");
  EXPECT_EQ(t->records[1].state, TraceState::queued);
  trace.record_finish(2, false);  // seen through the shared mapping, without a flush
  t = read_trace_file(path.string(), &why);
  ASSERT_TRUE(t.has_value()) << why;
  EXPECT_EQ(t->records[1].state, TraceState::failed);
  std::filesystem::remove(path);
}

TEST(CollectiveTrace, AFileThatIsNotATraceIsRefusedSayingWhy) {
  std::string why;
  EXPECT_FALSE(read_trace_file(temp_path("missing").string(), &why).has_value());
  EXPECT_THAT(why, HasSubstr("cannot open"));
  const auto path = temp_path("short");
  { std::ofstream(path) << "LSTRACE"; }
  EXPECT_FALSE(read_trace_file(path.string(), &why).has_value());
  EXPECT_THAT(why, HasSubstr("a trace needs"));
  {
    std::ofstream out(path);
    out << std::string(64 * 1024, 'x');
  }
  EXPECT_FALSE(read_trace_file(path.string(), &why).has_value());
  EXPECT_THAT(why, HasSubstr("bad magic"));
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace lockstep::dist
