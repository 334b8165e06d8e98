// PowerSGD (powersgd.h): each gradient matrix M (shape[0] x rest) of a bucket is reduced as a
// rank-r approximation P Q^T, found by one step of power iteration per training step.
//
// Note [PowerSGD]
// Per bucket and step, after PyTorch's powerSGD_hook (Vogels et al., 2019):
//   start():  M += error (error feedback), and error := M (this rank's input, kept for below);
//             Q := last step's Q (warm start) or random from the seeded generator, orthogonalized;
//             P := M Q; one average all-reduce of [uncompressed | the reducer's own elements | P].
//   finish(): the uncompressed tensors and the reducer's elements back into the bucket;
//             P orthogonalized; Q := M^T P; an average all-reduce of the bucket's Qs (blocking);
//             M := P Q^T in the bucket; error := input - output.
// P averages to M_avg Q and Q to M_avg^T P, so every rank ends on the same P Q^T. The reducer's
// elements after `numel` go through the same average all-reduce as allreduce_hook's, so they come
// back as that hook returns them (comm_hook.cpp). The error of an uncompressed tensor is its
// gradient minus the average, whose mean over ranks is zero: it cancels in the next average (as
// in PyTorch). The step count advances at bucket 0's start, the first of every step, so all
// buckets of a step agree on whether it compresses; the random Qs are drawn in bucket order from
// one generator seeded alike on every rank, so every rank draws the same ones.
#include "lockstep/distributed/powersgd.h"

#include <mutex>

#include <algorithm>
#include <utility>
#include <vector>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/base/error.h"
#include "lockstep/ops/elementwise.h"
#include "lockstep/ops/linalg.h"
#include "lockstep/ops/reduce.h"

namespace lockstep::dist {

namespace {

// Gram-Schmidt on the columns of an (n, r) matrix, in place (r is small: no QR needed). A column
// of norm 0 stays 0 when epsilon is 0 (PyTorch's would turn into NaN).
void orthogonalize(const Tensor& m, double epsilon) {
  const int64_t r = m.size(1);
  for (int64_t i = 0; i < r; ++i) {
    Tensor col = m.narrow(1, i, 1);  // (n, 1)
    const Tensor norm = sqrt(sum(mul(col, col)));
    if (epsilon == 0) {
      col.copy_(where(gt(norm, 0.0), div(col, norm), col));
    } else {
      col.copy_(div(col, add(norm, epsilon)));
    }
    if (i + 1 < r) {
      Tensor rest = m.narrow(1, i + 1, r - i - 1);                     // (n, r - i - 1)
      const Tensor dots = sum(mul(col, rest), {0}, /*keepdim=*/true);  // (1, r - i - 1)
      rest.add_(mul(col, dots), -1.0);
    }
  }
}

}  // namespace

// A bucket's plan for a compressed step, from start() to finish().
struct PowerSGDState::Pending {
  // A gradient that travels compressed: where it lies in the bucket, its shape as a matrix, and
  // where its P lies in the all-reduced buffer and its Q among the Qs.
  struct Matrix {
    size_t param = 0;
    int64_t offset = 0, n = 0, m = 0, r = 0;
    int64_t p_offset = 0, q_offset = 0;
  };
  ProcessGroup* pg = nullptr;
  std::vector<Matrix> compressed;
  std::vector<std::pair<int64_t, int64_t>> uncompressed;  // (offset in the bucket, numel)
  std::vector<int64_t> offsets;                           // each parameter's, in the bucket
  int64_t uncompressed_numel = 0;
  int64_t own_numel = 0;  // the reducer's elements after `numel`
  int64_t p_numel = 0, q_numel = 0;
};

PowerSGDState::PowerSGDState(PowerSGDOptions opts) : opts_(opts), gen_(opts.seed) {
  LS_CHECK(opts_.matrix_approximation_rank >= 1,
           "PowerSGD: matrix_approximation_rank must be at least 1, got ",
           opts_.matrix_approximation_rank);
  LS_CHECK(opts_.start_powersgd_iter >= 0, "PowerSGD: start_powersgd_iter must be at least 0, got ",
           opts_.start_powersgd_iter);
  LS_CHECK(opts_.min_compression_rate >= 0 && opts_.orthogonalization_epsilon >= 0,
           "PowerSGD: min_compression_rate and orthogonalization_epsilon must be at least 0, got ",
           opts_.min_compression_rate, " and ", opts_.orthogonalization_epsilon);
}

Tensor PowerSGDState::error(const std::string& name) const {
  const auto it = errors_.find(name);
  return it == errors_.end() ? Tensor() : it->second;
}

Tensor PowerSGDState::q(const std::string& name) const {
  const auto it = qs_.find(name);
  return it == qs_.end() ? Tensor() : it->second;
}

WorkPtr PowerSGDState::start(ProcessGroup& pg, GradBucket& b) {
  // Its step count, errors and Qs are one model's on one rank: a hook shared by ranks on
  // threads would count their steps together and mix their errors.
  {
    std::lock_guard<std::mutex> lock(group_mu_);
    const std::shared_ptr<const ProcessGroup> bound = group_.lock();
    if (bound && bound.get() != &pg) {
      LS_THROW("PowerSGD: this hook's state already serves another process group (rank ",
               group_rank_, " of ", group_size_, "), and this is rank ", pg.rank(),
               "'s: give each DDP model its own powersgd_hook()");
    }
    if (!bound) {
      group_ = pg.weak_from_this();
      group_rank_ = pg.rank();
      group_size_ = pg.size();
    }
  }
  // Note [Join]: a rank out of data contributes zeros, and the reducer rescales the average after
  // finish(); error feedback would add a joined rank's error and keep errors against the
  // unscaled average. Refused on every rank alike (contributors comes from the Join's header).
  LS_CHECK(b.contributors <= 0 || b.contributors == pg.size(),
           "PowerSGD: cannot reduce a step to which ", b.contributors, " of ", pg.size(),
           " ranks contribute (a dist::Join after a rank ran out of data); expected all ",
           pg.size(), ": use allreduce_hook() with Join");
  if (b.index == 0) ++started_;
  if (iteration() < opts_.start_powersgd_iter) {
    b.wire_bytes = b.buffer.nbytes();
    return pg.all_reduce(b.buffer, {.op = ReduceOp::avg});
  }
  autograd::NoGradGuard no_grad;
  LS_CHECK(b.parameter_names.size() == b.parameters.size(), "PowerSGD: bucket ", b.index, " has ",
           b.parameters.size(), " parameters but ", b.parameter_names.size(), " names");
  auto plan = std::make_shared<Pending>();
  plan->pg = &pg;
  int64_t offset = 0;
  for (size_t k = 0; k < b.parameters.size(); ++k) {
    const Tensor& p = b.parameters[k];
    plan->offsets.push_back(offset);
    const int64_t n = p.dim() >= 2 ? p.size(0) : 0;
    const int64_t m = n > 0 ? p.numel() / n : 0;
    const int64_t r = std::min({n, m, opts_.matrix_approximation_rank});
    if (n > 0 && m > 0 &&
        static_cast<double>((n + m) * r) * opts_.min_compression_rate <
            static_cast<double>(n * m)) {
      plan->compressed.push_back({k, offset, n, m, r, plan->p_numel, plan->q_numel});
      plan->p_numel += n * r;
      plan->q_numel += m * r;
    } else if (p.numel() > 0) {
      plan->uncompressed.emplace_back(offset, p.numel());
      plan->uncompressed_numel += p.numel();
    }
    offset += p.numel();
  }
  LS_CHECK(offset == b.numel, "PowerSGD: bucket ", b.index, "'s parameters hold ", offset,
           " elements, its gradients ", b.numel, " (PowerSGD is DDP's hook, not a sharding one)");
  plan->own_numel = b.buffer.numel() - b.numel;

  // Error feedback: M += error; the error then holds M until finish() subtracts the output.
  if (opts_.use_error_feedback) {
    for (size_t k = 0; k < b.parameters.size(); ++k) {
      Tensor grad = b.buffer.narrow(0, plan->offsets[k], b.parameters[k].numel());
      Tensor& e = errors_[b.parameter_names[k]];
      if (e.defined() && e.numel() == grad.numel() && e.dtype() == grad.dtype() &&
          e.device() == grad.device()) {
        grad.add_(e);
        e.copy_(grad);
      } else {
        e = grad.clone();
      }
    }
  }

  const int64_t total = plan->uncompressed_numel + plan->own_numel + plan->p_numel;
  const TensorOptions like = TensorOptions(b.buffer.dtype()).with_device(b.buffer.device());
  if (!b.scratch.defined() || b.scratch.numel() != total || b.scratch.dtype() != b.buffer.dtype() ||
      b.scratch.device() != b.buffer.device())
    b.scratch = empty({total}, like);
  int64_t at = 0;
  for (const auto& [off, len] : plan->uncompressed) {
    b.scratch.narrow(0, at, len).copy_(b.buffer.narrow(0, off, len));
    at += len;
  }
  if (plan->own_numel > 0)
    b.scratch.narrow(0, at, plan->own_numel).copy_(b.buffer.narrow(0, b.numel, plan->own_numel));
  const int64_t p_start = plan->uncompressed_numel + plan->own_numel;
  for (const Pending::Matrix& c : plan->compressed) {
    const std::string& name = b.parameter_names[c.param];
    Tensor& q = qs_[name];
    if (!opts_.warm_start || !q.defined() || q.size(0) != c.m || q.size(1) != c.r ||
        q.dtype() != b.buffer.dtype() || q.device() != b.buffer.device()) {
      // Drawn on the CPU in f32 whatever the bucket, so that every rank and device draws alike.
      q = randn({c.m, c.r}, gen_).to(b.buffer.dtype()).to(b.buffer.device());
    }
    orthogonalize(q, opts_.orthogonalization_epsilon);
    const Tensor grad = b.buffer.narrow(0, c.offset, c.n * c.m).view({c.n, c.m});
    b.scratch.narrow(0, p_start + c.p_offset, c.n * c.r).view({c.n, c.r}).copy_(matmul(grad, q));
  }
  b.wire_bytes = (total + plan->q_numel) * b.buffer.element_size();
  pending_[b.index] = std::move(plan);
  return pg.all_reduce(b.scratch, {.op = ReduceOp::avg});
}

void PowerSGDState::finish(GradBucket& b) {
  const auto it = pending_.find(b.index);
  if (it == pending_.end()) return;  // a plain all-reduce
  const std::shared_ptr<Pending> plan = std::move(it->second);
  pending_.erase(it);
  autograd::NoGradGuard no_grad;
  int64_t at = 0;
  for (const auto& [off, len] : plan->uncompressed) {
    b.buffer.narrow(0, off, len).copy_(b.scratch.narrow(0, at, len));
    at += len;
  }
  if (plan->own_numel > 0)
    b.buffer.narrow(0, b.numel, plan->own_numel).copy_(b.scratch.narrow(0, at, plan->own_numel));
  const int64_t p_start = plan->uncompressed_numel + plan->own_numel;

  if (!plan->compressed.empty()) {
    const TensorOptions like = TensorOptions(b.buffer.dtype()).with_device(b.buffer.device());
    Tensor qs = empty({plan->q_numel}, like);
    std::vector<Tensor> ps;
    for (const Pending::Matrix& c : plan->compressed) {
      Tensor p = b.scratch.narrow(0, p_start + c.p_offset, c.n * c.r).view({c.n, c.r});
      orthogonalize(p, opts_.orthogonalization_epsilon);
      const Tensor grad = b.buffer.narrow(0, c.offset, c.n * c.m).view({c.n, c.m});
      qs.narrow(0, c.q_offset, c.m * c.r).view({c.m, c.r}).copy_(matmul(grad.t(), p));
      ps.push_back(std::move(p));
    }
    // Blocking: the other buckets' reductions may still run behind it on the backend's thread.
    plan->pg->all_reduce(qs, {.op = ReduceOp::avg})->wait();
    for (size_t i = 0; i < plan->compressed.size(); ++i) {
      const Pending::Matrix& c = plan->compressed[i];
      const Tensor q = qs.narrow(0, c.q_offset, c.m * c.r).view({c.m, c.r});
      qs_[b.parameter_names[c.param]] = q;
      b.buffer.narrow(0, c.offset, c.n * c.m).view({c.n, c.m}).copy_(matmul(ps[i], q.t()));
    }
  }

  if (opts_.use_error_feedback) {
    for (size_t k = 0; k < b.parameters.size(); ++k) {
      const Tensor out = b.buffer.narrow(0, plan->offsets[k], b.parameters[k].numel());
      errors_.at(b.parameter_names[k]).add_(out, -1.0);
    }
  }
}

CommHook powersgd_hook(std::shared_ptr<PowerSGDState> state) {
  LS_CHECK(state != nullptr, "powersgd_hook: the state is null");
  return {"powersgd", [state](ProcessGroup& pg, GradBucket& b) { return state->start(pg, b); },
          [state](GradBucket& b) { state->finish(b); }, nullptr, nullptr};
}

CommHook powersgd_hook(PowerSGDOptions opts) {
  return powersgd_hook(std::make_shared<PowerSGDState>(opts));
}

}  // namespace lockstep::dist
