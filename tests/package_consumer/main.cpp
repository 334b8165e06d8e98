// Uses the installed library: a gradient through matmul must come out right.
#include <cstdio>

#include "lockstep/lockstep.h"

int main() {
  using namespace lockstep;
  Tensor w = full({2, 2}, 1.0).requires_grad_();
  Tensor x = full({3, 2}, 2.0);
  sum(matmul(x, w)).backward();
  const double g = w.grad().at({0, 1});
  std::printf("grad=%g\n", g);
  return g == 6.0 ? 0 : 1;
}
