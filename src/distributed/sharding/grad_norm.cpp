// sharded_grad_norm: one exact sum per rank, added across ranks as integers.
#include "distributed/sharding/grad_norm.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "lockstep/autograd/grad_mode.h"
#include "lockstep/optim/exact_sum.h"
#include "lockstep/optim/optimizer.h"

namespace lockstep::dist {

double sharded_grad_norm(ProcessGroup& pg, const std::vector<Tensor>& shards) {
  autograd::NoGradGuard no_grad;
  optim::ExactSum acc;
  for (const Tensor& g : shards)
    if (g.defined()) optim::add_squares(acc, g);
  // The limbs of every rank add as integers (Note [Exact norm]); an inf or NaN anywhere is
  // every rank's, by a max over a flag.
  const optim::ExactSum::Limbs mine = acc.limbs();
  Tensor limbs = from_buffer(mine.data(), {optim::ExactSum::kLimbs}, kInt64);
  const double local = acc.value();
  Tensor special = full({1}, std::isnan(local) ? 2.0 : std::isinf(local) ? 1.0 : 0.0, kFloat64);
  pg.all_reduce_host(limbs, {.op = ReduceOp::sum});
  pg.all_reduce_host(special, {.op = ReduceOp::max});
  if (special.item() >= 2) return std::numeric_limits<double>::quiet_NaN();
  if (special.item() >= 1) return std::numeric_limits<double>::infinity();
  optim::ExactSum::Limbs summed{};
  std::copy_n(limbs.data<int64_t>(), optim::ExactSum::kLimbs, summed.begin());
  return std::sqrt(optim::ExactSum::from_limbs(summed).value());
}

}  // namespace lockstep::dist
