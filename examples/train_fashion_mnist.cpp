// Trains an MLP or a small CNN on Fashion-MNIST in one process: the program a user copies.
//
//   train_fashion_mnist --model cnn --epochs 1 --batch-size 64 --lr 0.05 --momentum 0.9
//
// Each epoch prints the mean training loss, throughput and test accuracy; the last line is
// machine-readable: "final test_accuracy=... train_loss=... steps=... samples_per_s=...".
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "lockstep/data/data.h"
#include "lockstep/io/safetensors.h"
#include "lockstep/lockstep.h"
#include "lockstep/nn/layers.h"
#include "lockstep/optim/optimizer.h"
#include "fashion_mnist_models.h"

using namespace lockstep;

namespace {

// Exit code for bad command-line input (as CLI11 and most tools use).
constexpr int kUsageError = 2;
constexpr int64_t kEvalBatch = 1000;

struct Config {
  std::string data = data::kDefaultFashionMnistDir;
  std::string model = "mlp";
  int64_t epochs = 1;
  int64_t max_steps = 0;
  int64_t batch_size = 64;
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 0.0;
  uint64_t seed = 0;
  int threads = 0;
  int64_t log_every = 100;
  bool eval = true;
  int64_t workers = 1;
  std::string save;
};

double evaluate(nn::Module& model, const data::MnistDataset& test) {
  NoGradGuard no_grad;
  model.eval();
  int64_t correct = 0;
  const Tensor& images = test.images();
  const Tensor& labels = test.labels();
  for (int64_t start = 0; start < test.size(); start += kEvalBatch) {
    const int64_t n = std::min(kEvalBatch, test.size() - start);
    Tensor logits = model.forward(images.narrow(0, start, n));          // (n,10)
    correct += static_cast<int64_t>(sum(eq(argmax(logits, 1), labels.narrow(0, start, n))).item());
  }
  model.train();
  return static_cast<double>(correct) / static_cast<double>(test.size());
}

int run(const Config& cfg) {
  if (cfg.threads > 0) set_num_threads(cfg.threads);
  data::MnistOptions mopts;
  mopts.normalize = true;
  auto train = data::load_mnist(cfg.data, data::Split::kTrain, mopts);
  auto test = cfg.eval ? data::load_mnist(cfg.data, data::Split::kTest, mopts) : nullptr;

  Generator gen(cfg.seed);
  auto model = examples::build_fashion_mnist_model(cfg.model, gen);
  optim::SGD opt(model->parameters(), {.lr = cfg.lr, .momentum = cfg.momentum,
                                       .weight_decay = cfg.weight_decay});
  // One process for now: a world of one. The distributed runtime plugs in rank and world size.
  auto sampler = std::make_shared<data::DistributedSampler>(train->size(), 1, 0, true, cfg.seed);
  data::DataLoader loader(train, sampler,
                          {.batch_size = cfg.batch_size, .num_workers = cfg.workers, .prefetch = 4});
  std::printf("model=%s params=%lld threads=%d train=%lld test=%lld batch=%lld\n",
              cfg.model.c_str(), static_cast<long long>(model->num_parameters()),
              get_num_threads(), static_cast<long long>(train->size()),
              static_cast<long long>(test ? test->size() : 0),
              static_cast<long long>(cfg.batch_size));

  using Clock = std::chrono::steady_clock;
  int64_t steps = 0, samples = 0;
  double train_seconds = 0, last_loss = 0, accuracy = -1;
  bool done = false;
  for (int64_t epoch = 0; epoch < cfg.epochs && !done; ++epoch) {
    loader.set_epoch(epoch);
    double loss_sum = 0;
    int64_t epoch_steps = 0, epoch_samples = 0;
    const auto t0 = Clock::now();
    for (data::Batch& batch : loader) {
      Tensor logits = model->forward(batch.input);              // (B,10)
      Tensor loss = cross_entropy(logits, batch.target);         // ()
      opt.zero_grad();
      loss.backward();
      opt.step();
      const double l = loss.item();
      loss_sum += l;
      ++epoch_steps;
      ++steps;
      epoch_samples += batch.input.size(0);
      if (cfg.log_every > 0 && steps % cfg.log_every == 0)
        std::printf("epoch %lld step %lld loss %.4f\n", static_cast<long long>(epoch),
                    static_cast<long long>(steps), l);
      if (cfg.max_steps > 0 && steps >= cfg.max_steps) {
        done = true;
        break;
      }
    }
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    train_seconds += secs;
    samples += epoch_samples;
    last_loss = epoch_steps ? loss_sum / static_cast<double>(epoch_steps) : 0.0;
    if (test) accuracy = evaluate(*model, *test);
    std::printf("epoch %lld train_loss %.4f samples/s %.1f test_accuracy %.4f data_wait %.1f%%\n",
                static_cast<long long>(epoch), last_loss, epoch_samples / secs, accuracy,
                100.0 * loader.wait_seconds() / secs);
    loader.reset_wait_seconds();
  }
  if (!cfg.save.empty()) {
    io::save_safetensors(cfg.save, model->state_dict(), {{"format", "pt"}, {"model", cfg.model}});
    std::printf("saved %s\n", cfg.save.c_str());
  }
  std::printf("final test_accuracy=%.4f train_loss=%.4f steps=%lld samples_per_s=%.1f\n", accuracy,
              last_loss, static_cast<long long>(steps), samples / train_seconds);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  CLI::App app{"Train an MLP or a CNN on Fashion-MNIST with lockstep."};
  app.add_option("--data", cfg.data, "Directory with the Fashion-MNIST IDX files")->capture_default_str();
  app.add_option("--model", cfg.model, "Model")->check(CLI::IsMember({"mlp", "cnn"}))->capture_default_str();
  app.add_option("--epochs", cfg.epochs, "Epochs")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--max-steps", cfg.max_steps, "Stop after N optimizer steps (0 = no limit)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--batch-size", cfg.batch_size, "Batch size per process")->capture_default_str();
  app.add_option("--lr", cfg.lr, "Learning rate")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--momentum", cfg.momentum, "SGD momentum")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--weight-decay", cfg.weight_decay, "SGD weight decay")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--seed", cfg.seed, "Seed for initialisation and shuffling")->capture_default_str();
  app.add_option("--threads", cfg.threads, "Intra-op threads (0 = OMP_NUM_THREADS or all cores)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--log-every", cfg.log_every, "Print the loss every N steps (0 = never)")->capture_default_str();
  app.add_flag("--eval,!--no-eval", cfg.eval, "Evaluate on the test set after each epoch")->capture_default_str();
  app.add_option("--workers", cfg.workers, "DataLoader worker threads")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--save", cfg.save, "Write the final parameters here (safetensors)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : kUsageError;
  }
  if (cfg.batch_size <= 0) {
    std::fprintf(stderr, "error: --batch-size must be a positive integer, got %lld\n",
                 static_cast<long long>(cfg.batch_size));
    return kUsageError;
  }
  if (!std::filesystem::is_directory(cfg.data)) {
    std::fprintf(stderr,
                 "error: --data %s is not a directory; install the Debian package "
                 "dataset-fashion-mnist or pass the directory holding the IDX files\n",
                 cfg.data.c_str());
    return kUsageError;
  }
  try {
    return run(cfg);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
