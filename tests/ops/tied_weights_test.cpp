// A weight used twice in one graph, as GPT-2 ties its token embedding to its output head: the
// gradient autograd leaves in it is the sum of the gradients of both uses.
#include <vector>

#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_close;
using lockstep::testing::expect_gradcheck;
using lockstep::testing::values;

namespace {

// logits = gelu_tanh(embedding(w_in, tokens)) @ w_out^T: (N, C) from a (V, C) table, -> (N, V).
Tensor tied_logits(const Tensor& w_in, const Tensor& w_out, const Tensor& tokens) {
  return matmul(gelu(embedding(w_in, tokens), GeluApprox::tanh), w_out.t());
}

}  // namespace

TEST(TiedWeights, GradientIsTheSumOfBothUses) {
  Generator gen(41);
  const int64_t vocab = 11, dim = 6;
  // Token 3 appears three times: the embedding's own gradient rows accumulate too.
  Tensor tokens = from_vector<int64_t>({3, 0, 3, 7, 10, 3, 1}, {7});
  Tensor w0 = randn({vocab, dim}, gen, kFloat64);
  Tensor targets = from_vector<int64_t>({1, 2, 3, 4, 5, 6, 7}, {7});

  Tensor w = w0.clone().requires_grad_();
  cross_entropy(tied_logits(w, w, tokens), targets).backward();

  // The same loss with two separate copies of the table: each gets one use's gradient.
  Tensor w_in = w0.clone().requires_grad_(), w_out = w0.clone().requires_grad_();
  cross_entropy(tied_logits(w_in, w_out, tokens), targets).backward();

  std::vector<double> want = values(add(w_in.grad(), w_out.grad()));
  expect_close(values(w.grad()), want, 1e-12, "tied gradient");
  // Neither use alone is the answer: both contribute (rows never looked up get the head's only).
  EXPECT_GT(max(abs(sub(w.grad(), w_out.grad()))).item(), 1e-3);
  EXPECT_GT(max(abs(sub(w.grad(), w_in.grad()))).item(), 1e-3);
}

TEST(TiedWeights, Gradcheck) {
  Generator gen(42);
  Tensor tokens = from_vector<int64_t>({2, 4, 2, 0}, {4});
  auto fn = [&tokens](const std::vector<Tensor>& in) { return tied_logits(in[0], in[0], tokens); };
  expect_gradcheck(fn, {randn({5, 3}, gen, kFloat64).requires_grad_()});
}
