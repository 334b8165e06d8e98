// The "nccl" backend of emulated GPUs: NCCL's contract over the CPU transport.
#include <memory>

#include "distributed/emulated_nccl/register.h"
#include "lockstep/distributed/process_group.h"
#include "lockstep/distributed/store/prefix_store.h"
#include "lockstep/tensor/cuda.h"
#include "tensor/cuda_emulated.h"

namespace lockstep::dist {

namespace {

// Note [Emulated NCCL]
// On emulated GPUs (Note [Emulated CUDA devices] in src/tensor/cuda_emulated.cpp) the backend
// named "nccl" is this group. It keeps the contract ProcessGroupNCCL has, so that whatever breaks
// on a real GPU breaks here first:
// - tensors on this rank's own device only (the current device when the group is built, which
//   init_process_group has bound to cuda:LOCAL_RANK): a host tensor, or one on another GPU, is
//   refused by the public calls with the same words as on NCCL, and nothing is staged through
//   host memory (supports() is NCCL's; stages() is false, as the group does not move CPU tensors);
// - the object collectives travel on the device (object_device());
// - NCCL's dtypes and ops are ProcessGroup's checks, the same for both.
// The data moves through the CPU backend the machine layout calls for ("auto": shm on one
// machine), given the device tensors' host memory as the CPU tensors it is; each collective is
// complete when its call returns, as shm's are. Reductions therefore add in the CPU backend's
// order, and an emulated run gives the bits of the same run on CPUs.
class EmulatedNcclGroup final : public ProcessGroup {
 public:
  explicit EmulatedNcclGroup(const BackendConfig& config)
      : ProcessGroup(config.rank, config.size, config.timeout), device_(cuda::current_device()) {
    BackendConfig inner = config;
    inner.store = std::make_shared<PrefixStore>("emulated_nccl", config.store);
    transport_ = create_process_group("auto", inner);
  }

  std::string_view backend() const override { return "nccl"; }

 protected:
  void do_all_reduce(Tensor tensor, ReduceOp op, std::chrono::milliseconds timeout,
                     const WorkPtr& work) override {
    run(work, [&] { return transport_->all_reduce(host(tensor), {.op = op, .timeout = timeout}); });
  }
  void do_broadcast(Tensor tensor, int root, std::chrono::milliseconds timeout,
                    const WorkPtr& work) override {
    run(work,
        [&] { return transport_->broadcast(host(tensor), {.root = root, .timeout = timeout}); });
  }
  void do_all_gather(Tensor output, Tensor input, std::chrono::milliseconds timeout,
                     const WorkPtr& work) override {
    run(work,
        [&] { return transport_->all_gather(host(output), host(input), {.timeout = timeout}); });
  }
  void do_reduce_scatter(Tensor output, Tensor input, ReduceOp op,
                         std::chrono::milliseconds timeout, const WorkPtr& work) override {
    run(work, [&] {
      return transport_->reduce_scatter(host(output), host(input),
                                        {.op = op, .timeout = timeout});
    });
  }
  void do_barrier(std::chrono::milliseconds timeout, const WorkPtr& work) override {
    run(work, [&] { return transport_->barrier({.timeout = timeout}); });
  }
  bool supports(Device device) const override {
    return device.is_cuda() && device.index == device_;
  }
  Device object_device() const override { return cuda_device(device_); }

 private:
  static Tensor host(const Tensor& t) { return lockstep::detail::emulated_as_host(t); }

  // Runs the transport's collective to completion and finishes `work` with its outcome.
  template <typename Start>
  void run(const WorkPtr& work, Start start) {
    work_start(*work);
    try {
      start()->wait();
    } catch (...) {
      work_finish(*work, std::current_exception());
      return;
    }
    work_finish(*work);
  }

  const int device_;
  ProcessGroupPtr transport_;
};

}  // namespace

void register_emulated_nccl_backend() {
  register_backend("nccl", [](const BackendConfig& config) -> ProcessGroupPtr {
    return std::make_shared<EmulatedNcclGroup>(config);
  });
}

}  // namespace lockstep::dist
