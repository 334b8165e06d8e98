// The launcher's verdict (Note [Verdict] in tools/lockstep/verdict.h) on views built here: each
// kind of hang names the rank at fault.
#include "verdict.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace lockstep::launch {
namespace {

using dist::TraceRecord;
using dist::TraceState;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr int64_t kSecond = 1'000'000'000;
constexpr int64_t kT0 = 1'800'000'000 * kSecond;  // 2027-01-15 08:00:00 UTC

constexpr uint32_t kAllReduce = 1, kBroadcast = 2;
constexpr uint32_t kF32 = 0;

TraceRecord rec(int64_t seq, uint32_t kind, int64_t numel, TraceState state, int64_t issued_s,
                int64_t finished_s = 0) {
  TraceRecord r;
  r.seq = seq;
  r.kind = kind;
  r.dtype = kF32;
  r.numel = numel;
  r.state = state;
  r.issued_ns = kT0 + issued_s * kSecond;
  r.finished_ns = finished_s ? kT0 + finished_s * kSecond : 0;
  return r;
}

RankView rank(int r, std::vector<TraceRecord> records, std::string process = "running") {
  RankView v;
  v.rank = r;
  v.node = 0;
  v.host = "h";
  v.process = std::move(process);
  dist::TraceSnapshot t;
  t.rank = r;
  t.size = 4;
  t.pid = 100 + r;
  for (const auto& x : records) {
    t.issued = std::max(t.issued, x.seq);
    if (x.state == TraceState::finished || x.state == TraceState::failed) {
      t.finished = std::max(t.finished, x.seq);
    }
  }
  t.records = std::move(records);
  v.trace = std::move(t);
  return v;
}

// Ranks 0, 2, 3 finished broadcast #7 at +3 s and wait in all_reduce #8 since +4 s.
std::vector<RankView> three_waiting(RankView laggard) {
  std::vector<RankView> v;
  for (int r : {0, 2, 3}) {
    v.push_back(rank(r, {rec(7, kBroadcast, 1, TraceState::finished, 2, 3),
                         rec(8, kAllReduce, 1024, TraceState::started, 4)}));
  }
  v.insert(v.begin() + 1, std::move(laggard));
  return v;
}

TEST(Verdict, ARankThatNeverIssuedTheCollectiveIsNamedWithWhatItLastFinished) {
  const auto views = three_waiting(rank(1, {rec(7, kBroadcast, 1, TraceState::finished, 2, 3)}));
  const Verdict v = judge(views, kT0 + 304 * kSecond);
  EXPECT_EQ(v.line,
            "rank 1 never issued all_reduce #8 (sum, 1024 x f32) (it last finished broadcast #7 "
            "(root 0, 1 x f32) at 08:00:03); ranks 0,2,3 waited 300 s in all_reduce #8 (sum, "
            "1024 x f32)");
  EXPECT_EQ(v.seq, 8);
  EXPECT_DOUBLE_EQ(v.waited_s, 300);
  EXPECT_TRUE(v.culprit);
}

TEST(Verdict, AStoppedRankIsNamedWithItsStateAndSince) {
  RankView stopped = rank(1, {rec(7, kBroadcast, 1, TraceState::finished, 2, 3)}, "stopped");
  stopped.process_detail = "state T";
  stopped.process_since_ns = kT0 + 1 * kSecond;
  const Verdict v = judge(three_waiting(stopped), kT0 + 64 * kSecond);
  EXPECT_THAT(v.line, StartsWith("rank 1 never issued all_reduce #8"));
  EXPECT_THAT(v.line, HasSubstr("it is stopped (state T) since 08:00:01"));
  EXPECT_THAT(v.line, HasSubstr("ranks 0,2,3 waited 60 s"));

  // Stopped after issuing #8 itself: still the one named.
  RankView in8 = rank(1,
                      {rec(7, kBroadcast, 1, TraceState::finished, 2, 3),
                       rec(8, kAllReduce, 1024, TraceState::queued, 4)},
                      "stopped");
  in8.process_detail = "state T";
  in8.process_since_ns = kT0 + 5 * kSecond;
  EXPECT_THAT(judge(three_waiting(in8), kT0 + 64 * kSecond).line,
              StartsWith("rank 1 is stopped (state T) since 08:00:05; ranks 0,1,2,3 waited 60 s "
                         "in all_reduce #8"));

  // Nobody waits in a collective: the stopped rank is named anyway.
  std::vector<RankView> idle = {rank(0, {rec(1, kAllReduce, 4, TraceState::finished, 1, 1)}),
                                stopped};
  EXPECT_EQ(judge(idle, kT0 + 9 * kSecond).line,
            "rank 1 is stopped (state T) since 08:00:01; no rank waits in a collective");
}

TEST(Verdict, AnExitedRankIsNamedWithHowItEnded) {
  RankView dead = rank(1, {rec(7, kBroadcast, 1, TraceState::finished, 2, 3)}, "exited");
  dead.process_detail = "signal SIGKILL (9)";
  dead.process_since_ns = kT0 + 5 * kSecond;
  EXPECT_THAT(judge(three_waiting(dead), kT0 + 20 * kSecond).line,
              HasSubstr("rank 1 never issued all_reduce #8 (sum, 1024 x f32) (it last finished "
                        "broadcast #7 (root 0, 1 x f32) at 08:00:03; it exited (signal SIGKILL "
                        "(9)) at 08:00:05)"));
}

TEST(Verdict, RanksThatIssuedDifferentCollectivesAreBothNamed) {
  std::vector<RankView> op = {rank(0, {rec(1, kAllReduce, 1024, TraceState::started, 1)}),
                              rank(1, {rec(1, kBroadcast, 1024, TraceState::started, 1)})};
  EXPECT_EQ(judge(op, kT0 + 10 * kSecond).line,
            "the ranks disagree on collective #1: rank 0 issued all_reduce #1 (sum, 1024 x f32), "
            "rank 1 issued broadcast #1 (root 0, 1024 x f32); every rank must issue the same "
            "collectives in the same order");
  std::vector<RankView> size = {rank(0, {rec(1, kAllReduce, 1024, TraceState::failed, 1, 2)}),
                                rank(1, {rec(1, kAllReduce, 512, TraceState::failed, 1, 2)})};
  const Verdict v = judge(size, kT0 + 10 * kSecond);
  EXPECT_THAT(v.line, HasSubstr("rank 0 issued all_reduce #1 (sum, 1024 x f32), rank 1 issued "
                                "all_reduce #1 (sum, 512 x f32)"));
  EXPECT_TRUE(v.culprit);
}

TEST(Verdict, EveryRankInTheSameCollectiveBlamesTheTransport) {
  std::vector<RankView> all = {rank(0, {rec(3, kAllReduce, 8, TraceState::started, 1)}),
                               rank(1, {rec(3, kAllReduce, 8, TraceState::started, 1)})};
  const Verdict v = judge(all, kT0 + 41 * kSecond);
  EXPECT_THAT(v.line, StartsWith("every rank issued all_reduce #3 (sum, 8 x f32) and it has not "
                                 "finished after 40 s"));
  EXPECT_FALSE(v.culprit);
}

TEST(Verdict, NothingToSayWhenNoRankWaitsAndNoneIsStopped) {
  std::vector<RankView> fine = {rank(0, {rec(1, kAllReduce, 8, TraceState::finished, 1, 1)}),
                                rank(1, {rec(1, kAllReduce, 8, TraceState::finished, 1, 1)})};
  EXPECT_EQ(judge(fine, kT0 + 5 * kSecond).line, "");
}

TEST(Verdict, ARankWithoutATraceIsSaidSo) {
  RankView none;
  none.rank = 1;
  none.no_trace = "node 1 has not reported";
  std::vector<RankView> v = {rank(0, {rec(1, kAllReduce, 8, TraceState::started, 1)}), none};
  EXPECT_EQ(judge(v, kT0 + 3 * kSecond).line,
            "rank 1 has no collective trace (node 1 has not reported); rank 0 waited 2.0 s in "
            "all_reduce #1 (sum, 8 x f32)");
}

TEST(Verdict, ViewsSurviveTheirTripThroughTheStore) {
  RankView a = rank(2,
                    {rec(7, kBroadcast, 1, TraceState::finished, 2, 3),
                     rec(8, kAllReduce, 1024, TraceState::started, 4)},
                    "stopped");
  a.process_detail = "state T";
  a.process_since_ns = kT0 + 7;
  a.trace->wait_seq = 8;
  a.trace->wait_since_ns = kT0 + 5;
  const RankView b = rank_view_from_json(nlohmann::json::parse(to_json(a).dump()));
  EXPECT_EQ(b.rank, 2);
  EXPECT_EQ(b.process, "stopped");
  EXPECT_EQ(b.process_detail, "state T");
  EXPECT_EQ(b.process_since_ns, kT0 + 7);
  ASSERT_TRUE(b.trace.has_value());
  EXPECT_EQ(b.trace->wait_seq, 8);
  ASSERT_EQ(b.trace->records.size(), 2u);
  EXPECT_EQ(b.trace->records[1].describe(), a.trace->records[1].describe());
  EXPECT_EQ(b.trace->records[1].state, TraceState::started);
  EXPECT_EQ(b.trace->records[0].finished_ns, a.trace->records[0].finished_ns);
  const auto details = rank_details({b}, kT0 + 10 * kSecond);
  ASSERT_EQ(details.size(), 1u);
  EXPECT_THAT(details[0], HasSubstr("rank 2 (node 0, host h, pid 102): stopped (state T)"));
  EXPECT_THAT(details[0], HasSubstr("blocked in wait() on #8"));
  EXPECT_THAT(details[0], HasSubstr("all_reduce #8 (sum, 1024 x f32) started since 08:00:04"));
}

}  // namespace
}  // namespace lockstep::launch
