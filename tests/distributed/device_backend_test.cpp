// What ProcessGroup offers a device backend (NCCL), checked without a GPU through a fake one: its
// own kind of Work, the public call's steps run when the collective is queued, synchronize(),
// and the error for a tensor on a device it does not move.
#include "lockstep/distributed/process_group.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using lockstep::testing::expect_error;
using namespace std::chrono_literals;

namespace {

class CountingWork : public Work {
 public:
  using Work::Work;
  void wait() override {
    ++waits;
    Work::wait();
  }
  int waits = 0;
};

// Like ProcessGroupNCCL: runs the steps (unpacking) itself right after the "collective" (here:
// doubling the buffer), hands out CountingWorks, and moves tensors on `moves` only.
class StepsAtQueueTime : public ProcessGroup {
 public:
  explicit StepsAtQueueTime(Device moves = kCPU) : ProcessGroup(0, 1, 10s), moves_(moves) {}
  std::string_view backend() const override { return "fake"; }
  int steps_run = 0;

 protected:
  void do_all_reduce(Tensor t, ReduceOp, std::chrono::milliseconds, const WorkPtr& w) override {
    t.mul_(2.0);
    queue(w);
  }
  void do_broadcast(Tensor, int, std::chrono::milliseconds, const WorkPtr& w) override { queue(w); }
  void do_all_gather(Tensor out, Tensor in, std::chrono::milliseconds, const WorkPtr& w) override {
    out.copy_(in);
    queue(w);
  }
  void do_reduce_scatter(Tensor out, Tensor in, ReduceOp, std::chrono::milliseconds,
                         const WorkPtr& w) override {
    out.copy_(in);
    queue(w);
  }
  void do_barrier(std::chrono::milliseconds, const WorkPtr& w) override { queue(w); }
  bool supports(Device d) const override { return d == moves_; }
  Device object_device() const override { return moves_; }
  WorkPtr create_work(std::string description, int64_t seq) override {
    return std::make_shared<CountingWork>(std::move(description), seq);
  }

 private:
  void queue(const WorkPtr& w) {
    for (auto& step : work_take_steps(*w)) {
      step();
      ++steps_run;
    }
    work_finish(*w);  // runs no step a second time
  }
  Device moves_;
};

TEST(DeviceBackend, StepsRunWhenTheCollectiveIsQueuedAndWorksAreTheBackendsOwn) {
  StepsAtQueueTime pg;
  Tensor a = full({3}, 1.0, kFloat32);
  Tensor b = full({2}, 5.0, kFloat32);
  WorkPtr w = pg.all_reduce(std::vector<Tensor>{a, b});  // two tensors: packed, then unpacked
  // Unpacked by the step the backend ran at once, not by finish().
  EXPECT_EQ(pg.steps_run, 1);
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{2, 2, 2}));
  EXPECT_EQ(b.to_vector<float>(), (std::vector<float>{10, 10}));
  auto* counting = dynamic_cast<CountingWork*>(w.get());
  ASSERT_NE(counting, nullptr) << "create_work's Work was not used";
  w->wait();
  EXPECT_EQ(counting->waits, 1);
  w->synchronize();  // blocks on the Work's completion, not through the backend's wait()
  EXPECT_EQ(counting->waits, 1);
  EXPECT_TRUE(w->is_success());
  EXPECT_EQ(w->seq(), 1);
}

TEST(DeviceBackend, StridedOutputsAreWrittenBackByTheQueuedSteps) {
  StepsAtQueueTime pg;
  Tensor out = zeros({2, 3}, kFloat32).t();  // not contiguous
  Tensor in = arange(0.0, 6.0, 1.0, kFloat32);
  pg.all_gather(out, in)->wait();
  EXPECT_EQ(pg.steps_run, 1);
  EXPECT_EQ(out.contiguous().view({6}).to_vector<float>(), (std::vector<float>{0, 1, 2, 3, 4, 5}));
  // Object collectives travel on object_device() and come back to the host.
  EXPECT_EQ(to_string(pg.broadcast_object(to_bytes("abc"), 0)), "abc");
  EXPECT_EQ(to_string(pg.all_gather_object(to_bytes("xy"))[0]), "xy");
}

TEST(DeviceBackend, ATensorOnADeviceTheBackendDoesNotMoveNamesTheOneItDoes) {
  StepsAtQueueTime pg(cuda_device(0));
  expect_error([&] { pg.all_reduce(full({2}, 1.0, kFloat32)); },
               {"rank 0/1 (fake): all_reduce: the fake backend cannot move tensors on cpu",
                "it moves tensors on this rank's cuda:0 only", ".to(cuda:0)",
                "host values go through all_reduce_host"});
  EXPECT_EQ(pg.sequence_number(), 0);  // refused before it was numbered
}

TEST(DeviceBackend, TheBaseWorksSynchronizeIsItsWait) {
  WorldOfOneGroup pg;
  Tensor x = full({4}, 3.0, kFloat32);
  WorkPtr w = pg.all_reduce(x, {.op = ReduceOp::avg});
  w->synchronize();
  EXPECT_TRUE(w->is_success());
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{3, 3, 3, 3}));
}

}  // namespace
