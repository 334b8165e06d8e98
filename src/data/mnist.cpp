// MNIST / Fashion-MNIST loading: finding the files, checking them against each other, scaling.
#include "lockstep/data/mnist.h"

#include <filesystem>
#include <utility>

#include "lockstep/data/idx.h"

namespace lockstep::data {

namespace {

namespace fs = std::filesystem;

constexpr double kPixelMax = 255.0;
constexpr const char* kGzSuffix = ".gz";

struct SplitFiles {
  const char* images;
  const char* labels;
};

SplitFiles file_names(Split split) {
  return split == Split::kTrain ? SplitFiles{"train-images-idx3-ubyte", "train-labels-idx1-ubyte"}
                                : SplitFiles{"t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"};
}

std::string looked_for(const SplitFiles& names) {
  return std::string(names.images) + ", " + names.images + kGzSuffix + ", " + names.labels + ", " +
         names.labels + kGzSuffix;
}

// The plain file when present, else the .gz one.
std::string find_file(const std::string& dir, const char* name) {
  fs::path plain = fs::path(dir) / name;
  fs::path gz = fs::path(dir) / (std::string(name) + kGzSuffix);
  std::error_code ec;
  if (fs::is_regular_file(plain, ec)) return plain.string();
  if (fs::is_regular_file(gz, ec)) return gz.string();
  LS_THROW("load_mnist: neither ", plain.string(), " nor ", gz.string(), " exists (looked for ",
           name, " and ", name, kGzSuffix, " in ", dir, ")");
}

std::pair<Tensor, Tensor> load_files(const std::string& dir, Split split,
                                     const MnistOptions& options) {
  const SplitFiles names = file_names(split);
  std::error_code ec;
  LS_CHECK(fs::is_directory(dir, ec), "load_mnist: directory ", dir,
           " does not exist (looked there for ", looked_for(names),
           "); install the Debian package dataset-fashion-mnist for ", kDefaultFashionMnistDir,
           " or pass the directory that holds the files");
  const std::string images_path = find_file(dir, names.images);
  const std::string labels_path = find_file(dir, names.labels);

  Tensor raw_images = read_idx(images_path);
  LS_CHECK(raw_images.dtype() == DType::u8 && raw_images.dim() == 3, "load_mnist: ", images_path,
           ": expected u8 images with 3 dims (magic 0x00000803), found ",
           dtype_name(raw_images.dtype()), " with dims ", raw_images.shape().str());
  LS_CHECK(raw_images.size(1) == kMnistRows && raw_images.size(2) == kMnistCols,
           "load_mnist: ", images_path, ": expected ", kMnistRows, "x", kMnistCols,
           " images, found ", raw_images.size(1), "x", raw_images.size(2), " (dims ",
           raw_images.shape().str(), ")");
  Tensor raw_labels = read_idx(labels_path);
  LS_CHECK(raw_labels.dtype() == DType::u8 && raw_labels.dim() == 1, "load_mnist: ", labels_path,
           ": expected u8 labels with 1 dim (magic 0x00000801), found ",
           dtype_name(raw_labels.dtype()), " with dims ", raw_labels.shape().str());
  const int64_t n = raw_images.size(0);
  LS_CHECK(raw_labels.size(0) == n, "load_mnist: image and label counts differ: ", images_path,
           " holds ", n, " images but ", labels_path, " holds ", raw_labels.size(0), " labels");

  Tensor labels = empty({n}, DType::i64);
  const uint8_t* lp = raw_labels.data<uint8_t>();
  int64_t* lo = labels.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    LS_CHECK(lp[i] < kMnistClasses, "load_mnist: ", labels_path, ": label ", int(lp[i]),
             " at index ", i, " is outside [0, ", kMnistClasses, ")");
    lo[i] = lp[i];
  }

  if (options.normalize)
    LS_CHECK(options.std != 0.0, "load_mnist: MnistOptions::std must be non-zero");
  // x / 255, then (x - mean) / std folded into one multiply-add.
  const float scale =
      static_cast<float>(options.normalize ? 1.0 / (kPixelMax * options.std) : 1.0 / kPixelMax);
  const float shift = options.normalize ? static_cast<float>(-options.mean / options.std) : 0.0f;
  Tensor images = empty({n, 1, kMnistRows, kMnistCols}, DType::f32);
  const uint8_t* ip = raw_images.data<uint8_t>();
  float* io = images.data<float>();
  const int64_t total = images.numel();
  for (int64_t i = 0; i < total; ++i) io[i] = static_cast<float>(ip[i]) * scale + shift;
  return {images, labels};
}

}  // namespace

Split parse_split(const std::string& name) {
  if (name == "train") return Split::kTrain;
  if (name == "test") return Split::kTest;
  LS_THROW("parse_split: expected \"train\" or \"test\", got \"", name, "\"");
}

const char* split_name(Split split) { return split == Split::kTrain ? "train" : "test"; }

MnistDataset::MnistDataset(std::pair<Tensor, Tensor> images_labels, Split split)
    : TensorDataset(std::move(images_labels.first), std::move(images_labels.second)),
      split_(split) {}

MnistDataset::MnistDataset(const std::string& dir, Split split, const MnistOptions& options)
    : MnistDataset(load_files(dir, split, options), split) {}

std::shared_ptr<MnistDataset> load_mnist(const std::string& dir, Split split,
                                         const MnistOptions& options) {
  return std::make_shared<MnistDataset>(dir, split, options);
}

}  // namespace lockstep::data
