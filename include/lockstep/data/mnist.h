// MNIST / Fashion-MNIST: locating the four IDX files, validating them, loading a split.
#pragma once

#include <memory>
#include <string>

#include "lockstep/data/dataset.h"

namespace lockstep::data {

// Where the Debian package dataset-fashion-mnist installs the four .gz files.
inline constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// Per-pixel statistics of the training sets (after scaling to [0, 1]), for MnistOptions.
inline constexpr double kFashionMnistMean = 0.2860;
inline constexpr double kFashionMnistStd = 0.3530;
inline constexpr double kMnistMean = 0.1307;
inline constexpr double kMnistStd = 0.3081;

inline constexpr int64_t kMnistRows = 28;
inline constexpr int64_t kMnistCols = 28;
inline constexpr int64_t kMnistClasses = 10;

enum class Split { kTrain, kTest };
// "train" or "test"; anything else is an error.
Split parse_split(const std::string& name);
const char* split_name(Split split);

struct MnistOptions {
  // When set, images are (x - mean) / std after scaling to [0, 1].
  bool normalize = false;
  double mean = kFashionMnistMean;
  double std = kFashionMnistStd;
};

// Images f32 (N, 1, 28, 28) in [0, 1] (or normalized), labels i64 (N) in [0, 10).
// Files: {train,t10k}-{images-idx3,labels-idx1}-ubyte, each with or without ".gz" (the plain
// name wins when both exist).
class MnistDataset : public TensorDataset {
 public:
  MnistDataset(const std::string& dir, Split split, const MnistOptions& options = {});

  const Tensor& images() const { return inputs(); }
  const Tensor& labels() const { return targets(); }
  Split split() const { return split_; }

 private:
  MnistDataset(std::pair<Tensor, Tensor> images_labels, Split split);
  Split split_;
};

std::shared_ptr<MnistDataset> load_mnist(const std::string& dir, Split split,
                                         const MnistOptions& options = {});

}  // namespace lockstep::data
