// Models and data shared by the DDP tests (threads and processes).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "lockstep/lockstep.h"

namespace lockstep::testing::ddp {

constexpr int64_t kIn = 6, kHidden = 32, kClasses = 3;

inline std::shared_ptr<nn::Module> mlp(uint64_t seed, int64_t hidden = kHidden) {
  Generator gen(seed);
  return std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(kIn, hidden, gen), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(hidden, hidden, gen), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(hidden, kClasses, gen)});
}

// Two heads; forward uses only the first (the second's parameters get no gradient).
class OneHeadUsed : public nn::Module {
 public:
  explicit OneHeadUsed(uint64_t seed) : nn::Module("OneHeadUsed") {
    Generator gen(seed);
    used_ = register_module("used", std::make_shared<nn::Linear>(kIn, kClasses, gen));
    unused_ = register_module("unused", std::make_shared<nn::Linear>(kIn, kClasses, gen));
  }
  Tensor forward(const Tensor& x) override { return used_->forward(x); }

 private:
  std::shared_ptr<nn::Linear> used_, unused_;
};

struct Data {
  Tensor x;  // (N, kIn)
  Tensor y;  // (N)
};

inline Data make_data(int64_t n, uint64_t seed) {
  Generator gen(seed);
  return {randn({n, kIn}, gen), randint(0, kClasses, {n}, gen)};
}

// Rows [r * n / world, (r + 1) * n / world): rank r's share.
inline Data shard(const Data& d, int r, int world) {
  const int64_t n = d.x.size(0) / world;
  return {d.x.narrow(0, r * n, n).contiguous(), d.y.narrow(0, r * n, n).contiguous()};
}

inline std::vector<std::vector<double>> param_values(const nn::Module& m) {
  std::vector<std::vector<double>> v;
  for (const auto& p : m.parameters()) v.push_back(p.to_vector<double>());
  return v;
}

}  // namespace lockstep::testing::ddp
