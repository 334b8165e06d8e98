// The two Fashion-MNIST models, shared by the training example and the training benchmark.
#pragma once

#include <memory>
#include <string>

#include "lockstep/nn/layers.h"

namespace lockstep::examples {

// "mlp": 784-1024-1024-10 with ReLU.
// "cnn": conv 1->32 3x3, ReLU, maxpool 2, conv 32->64 3x3, ReLU, maxpool 2, flatten,
//        linear 1600->128, ReLU, linear 128->10.
// "cnn-bn": the CNN with BatchNorm2d after each conv and BatchNorm1d after the 128-wide linear
//        (before their ReLU); the convolutions and that linear then have no bias (BatchNorm's
//        shift replaces it).
inline std::shared_ptr<nn::Module> build_fashion_mnist_model(const std::string& kind,
                                                             Generator& gen) {
  using namespace nn;
  if (kind == "mlp") {
    return std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
        std::make_shared<Flatten>(), std::make_shared<Linear>(784, 1024, gen),
        std::make_shared<ReLU>(), std::make_shared<Linear>(1024, 1024, gen),
        std::make_shared<ReLU>(), std::make_shared<Linear>(1024, 10, gen)});
  }
  if (kind == "cnn-bn") {
    return std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
        std::make_shared<Conv2d>(Conv2dConfig{.in_channels = 1, .out_channels = 32, .bias = false},
                                 gen),
        std::make_shared<BatchNorm2d>(32), std::make_shared<ReLU>(),  // (B,32,26,26)
        std::make_shared<MaxPool2d>(2),                               // (B,32,13,13)
        std::make_shared<Conv2d>(Conv2dConfig{.in_channels = 32, .out_channels = 64, .bias = false},
                                 gen),
        std::make_shared<BatchNorm2d>(64), std::make_shared<ReLU>(),  // (B,64,11,11)
        std::make_shared<MaxPool2d>(2),                               // (B,64,5,5)
        std::make_shared<Flatten>(),                                  // (B,1600)
        std::make_shared<Linear>(1600, 128, gen, /*bias=*/false),
        std::make_shared<BatchNorm1d>(128), std::make_shared<ReLU>(),
        std::make_shared<Linear>(128, 10, gen)});  // (B,10)
  }
  LS_CHECK(kind == "cnn", "unknown model '", kind, "': expected mlp, cnn or cnn-bn");
  return std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(1, 32, 3, gen), std::make_shared<ReLU>(),   // (B,32,26,26)
      std::make_shared<MaxPool2d>(2),                                      // (B,32,13,13)
      std::make_shared<Conv2d>(32, 64, 3, gen), std::make_shared<ReLU>(),  // (B,64,11,11)
      std::make_shared<MaxPool2d>(2),                                      // (B,64,5,5)
      std::make_shared<Flatten>(),                                         // (B,1600)
      std::make_shared<Linear>(1600, 128, gen), std::make_shared<ReLU>(),
      std::make_shared<Linear>(128, 10, gen)});  // (B,10)
}

}  // namespace lockstep::examples
