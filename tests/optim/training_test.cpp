// A short training run on synthetic data: the loss must fall, for both optimizers.
#include "lockstep/nn/layers.h"
#include "lockstep/optim/optimizer.h"
#include "lockstep/optim/schedule.h"
#include "testing.h"

using namespace lockstep;

namespace {
// Two Gaussian blobs per class in 8-D, labels from the blob: learnable, not trivially linear.
std::pair<Tensor, Tensor> blobs(int64_t n, Generator& gen) {
  Tensor centers = mul(randn({4, 8}, gen), 3.0);
  Tensor which = randint(0, 4, {n}, gen);
  Tensor x = add(index_select(centers, 0, which), randn({n, 8}, gen));
  Tensor y = sub(which, mul(ge(which, 2.0).to(kInt64), 2.0));  // blobs {0,2} -> 0, {1,3} -> 1
  return {x, y.to(kInt64)};
}

double train(optim::Optimizer& opt, nn::Module& model, const Tensor& x, const Tensor& y,
             int steps, double* first_loss) {
  double loss_v = 0;
  for (int s = 0; s < steps; ++s) {
    Tensor loss = cross_entropy(model.forward(x), y);
    if (s == 0) *first_loss = loss.item();
    opt.zero_grad();
    loss.backward();
    opt.step();
    loss_v = loss.item();
  }
  return loss_v;
}
}  // namespace

TEST(Training, LossFallsWithSgdAndAdamW) {
  for (int which = 0; which < 2; ++which) {
    Generator gen(11);
    auto [x, y] = blobs(256, gen);
    nn::Sequential model({std::make_shared<nn::Linear>(8, 32, gen), std::make_shared<nn::ReLU>(),
                          std::make_shared<nn::Linear>(32, 2, gen)});
    std::unique_ptr<optim::Optimizer> opt;
    if (which == 0) opt = std::make_unique<optim::SGD>(model.parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
    else opt = std::make_unique<optim::AdamW>(model.parameters(), optim::AdamWOptions{.lr = 0.01});
    double first = 0;
    const double last = train(*opt, model, x, y, 100, &first);
    EXPECT_LT(last, 0.25 * first) << (which == 0 ? "SGD" : "AdamW");
    Tensor acc = mean(eq(argmax(model.forward(x), 1), y).to(kFloat32));
    EXPECT_GT(acc.item(), 0.95);
  }
}
