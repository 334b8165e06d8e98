// Training checkpoints: every field round-trips bit for bit, the file layout Python sees, the
// SHA-256 catches corrupt data, periodic files and pruning, and a writer killed with SIGKILL at
// random moments never leaves a checkpoint that does not load.
#include <gtest/gtest.h>
#include <openssl/evp.h>

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <thread>

#include "lockstep/io/checkpoint.h"
#include "lockstep/lockstep.h"
#include "lockstep/nn/layers.h"
#include "lockstep/optim/optimizer.h"
#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_error;
using lockstep::testing::TempDir;
namespace fs = std::filesystem;

namespace {

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(),
                     static_cast<size_t>(a.nbytes())) == 0;
}

void expect_same(const io::NamedTensors& a, const io::NamedTensors& b) {
  ASSERT_EQ(a.size(), b.size());
  std::map<std::string, Tensor> bm(b.begin(), b.end());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(bm.count(name)) << name;
    EXPECT_TRUE(same_bits(t, bm[name])) << name;
  }
}

// A model and an optimizer with state: two SGD steps with momentum on a small MLP.
struct Trained {
  Generator gen{3};
  std::shared_ptr<nn::Sequential> model{
      new nn::Sequential{std::make_shared<nn::Linear>(5, 4, gen), std::make_shared<nn::ReLU>(),
                         std::make_shared<nn::Linear>(4, 3, gen)}};
  optim::SGD opt{model->parameters(), {.lr = 0.1, .momentum = 0.9}};
  Trained() {
    Generator data(11);
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      Tensor x = randn({6, 5}, data);
      sum(mul(model->forward(x), model->forward(x))).backward();
      opt.step();
    }
  }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [n, p] : model->named_parameters()) out.push_back(n);
    return out;
  }
  io::TrainingCheckpoint checkpoint() const {
    io::TrainingCheckpoint c;
    c.model = model->state_dict();
    c.optimizer = opt.state_dict();
    c.optimizer_param_names = names();
    c.scaler = {{"scale", 65536.0}, {"growth_factor", 2.0}, {"_growth_tracker", 7}, {"x", 1.0 / 3}};
    c.step = 1234567890123;
    c.epoch = 7;
    c.epoch_samples = 4096;
    c.world_size = 4;
    c.rng["init"] = {42, 99};
    c.rng["dropout"] = {UINT64_MAX, 1ull << 40};
    c.user = {{"model", "mlp"}, {"note", "a b=c"}};
    return c;
  }
};

// The bytes from the start of the data section to the end of the file.
uint64_t data_start(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  unsigned char len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
  return 8 + n;
}

void flip_byte(const std::string& path, uint64_t at) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  f.seekg(static_cast<std::streamoff>(at));
  char c;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x20);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

}  // namespace

TEST(Checkpoint, EveryFieldRoundTripsBitForBit) {
  TempDir dir;
  Trained t;
  const io::TrainingCheckpoint c = t.checkpoint();
  const std::string path = dir.path("sub/dir/ck.safetensors");  // directories are created
  io::save_checkpoint(path, c);
  const io::TrainingCheckpoint back = io::load_checkpoint(path);
  expect_same(back.model, c.model);
  expect_same(back.optimizer, c.optimizer);
  EXPECT_EQ(back.optimizer_param_names, c.optimizer_param_names);
  EXPECT_EQ(back.scaler, c.scaler);  // exact doubles, 1/3 included
  EXPECT_EQ(back.step, c.step);
  EXPECT_EQ(back.epoch, c.epoch);
  EXPECT_EQ(back.epoch_samples, c.epoch_samples);
  EXPECT_EQ(back.world_size, c.world_size);
  EXPECT_EQ(back.rng, c.rng);
  EXPECT_EQ(back.user, c.user);

  // What the state restores into: a fresh model and optimizer continue bit for bit.
  Trained fresh;
  fresh.model->load_state_dict(back.model);
  fresh.opt.load_state_dict(back.optimizer);
  expect_same(fresh.model->state_dict(), t.model->state_dict());
  expect_same(fresh.opt.state_dict(), t.opt.state_dict());
}

TEST(Checkpoint, FileLayoutNamesTensorsForPython) {
  TempDir dir;
  Trained t;
  io::save_checkpoint(dir.path("ck.safetensors"), t.checkpoint());
  const io::SafetensorsContents raw = io::load_safetensors(dir.path("ck.safetensors"));
  std::set<std::string> names;
  for (const auto& [n, x] : raw.tensors) names.insert(n);
  EXPECT_TRUE(names.count("model.0.weight"));
  EXPECT_TRUE(names.count("model.2.bias"));
  EXPECT_TRUE(names.count("optim.0.weight.momentum_buffer"));  // by parameter name
  EXPECT_TRUE(names.count("optim.step"));
  EXPECT_EQ(raw.metadata.at("format"), "pt");
  EXPECT_EQ(raw.metadata.at("step"), "1234567890123");
  EXPECT_EQ(raw.metadata.at("rng.init"), "42 99");
  EXPECT_EQ(raw.metadata.at("user.note"), "a b=c");
  EXPECT_EQ(raw.metadata.at("sha256").size(), 64u);
  EXPECT_EQ(io::checkpoint_step(dir.path("ck.safetensors")), 1234567890123);
  EXPECT_EQ(io::checkpoint_digest(dir.path("ck.safetensors")), raw.metadata.at("sha256"));
  // The header alone gives the same metadata; a header cut short is an error naming the file.
  EXPECT_EQ(io::load_safetensors_metadata(dir.path("ck.safetensors")), raw.metadata);
  fs::resize_file(dir.path("ck.safetensors"), 100);
  expect_error([&] { io::load_safetensors_metadata(dir.path("ck.safetensors")); },
               {dir.path("ck.safetensors"), "header length"});
  EXPECT_EQ(io::checkpoint_step(dir.path("ck.safetensors")), -1);

  // Without names the optimizer's indices stay.
  io::TrainingCheckpoint c = t.checkpoint();
  c.optimizer_param_names.clear();
  io::save_checkpoint(dir.path("idx.safetensors"), c);
  names.clear();
  for (const auto& [n, x] : io::load_safetensors(dir.path("idx.safetensors")).tensors)
    names.insert(n);
  EXPECT_TRUE(names.count("optim.0.momentum_buffer"));
  expect_same(io::load_checkpoint(dir.path("idx.safetensors")).optimizer, c.optimizer);
}

TEST(Checkpoint, CorruptDataIsAnErrorNamingTheFile) {
  TempDir dir;
  Trained t;
  const std::string path = dir.path("ck.safetensors");
  io::save_checkpoint(path, t.checkpoint());
  // One flipped bit in the last byte of the data: every safetensors check still passes.
  flip_byte(path, fs::file_size(path) - 1);
  expect_error([&] { io::load_checkpoint(path); }, {path, "corrupt", "SHA-256"});
  // And in the first byte of the data.
  io::save_checkpoint(path, t.checkpoint());
  flip_byte(path, data_start(path));
  expect_error([&] { io::load_checkpoint(path); }, {path, "corrupt"});
}

TEST(Checkpoint, WeightsOnlyFileIsNotACheckpoint) {
  TempDir dir;
  Trained t;
  io::save_safetensors(dir.path("w.safetensors"), t.model->state_dict());
  expect_error([&] { io::load_checkpoint(dir.path("w.safetensors")); },
               {dir.path("w.safetensors"), "not a lockstep training checkpoint"});
  EXPECT_EQ(io::checkpoint_step(dir.path("w.safetensors")), -1);
  EXPECT_EQ(io::checkpoint_step(dir.path("missing.safetensors")), -1);
  expect_error([&] { io::load_checkpoint(dir.path("missing.safetensors")); },
               {dir.path("missing.safetensors")});
}

TEST(Checkpoint, ReservedParameterNamesAreRefused) {
  TempDir dir;
  Trained t;
  io::TrainingCheckpoint c = t.checkpoint();
  c.optimizer_param_names[0] = "step";
  expect_error([&] { io::save_checkpoint(dir.path("ck.safetensors"), c); }, {"'step'", "reserved"});
  c.optimizer_param_names.resize(1);
  c.optimizer_param_names[0] = "w";
  expect_error([&] { io::save_checkpoint(dir.path("ck.safetensors"), c); },
               {"optimizer_param_names has 1 names"});
}

TEST(Checkpoint, PeriodicFilesLatestAndPruning) {
  TempDir dir;
  Trained t;
  const std::string base = dir.path("ck.safetensors");
  EXPECT_EQ(io::checkpoint_path_for_step(base, 40), dir.path("ck.step00000040.safetensors"));
  EXPECT_EQ(io::latest_checkpoint(base), "");
  io::TrainingCheckpoint c = t.checkpoint();
  for (int64_t step : {30, 10, 20}) {
    c.step = step;
    io::save_checkpoint(io::checkpoint_path_for_step(base, step), c);
  }
  std::ofstream(dir.path("ck.stepXX.safetensors")) << "not ours";
  std::ofstream(dir.path("other.step00000050.safetensors")) << "another run";
  auto all = io::list_checkpoints(base);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].first, 10);
  EXPECT_EQ(all[2].second, dir.path("ck.step00000030.safetensors"));
  EXPECT_EQ(io::latest_checkpoint(base), dir.path("ck.step00000030.safetensors"));
  // The end-of-run file wins when its header says a later step, and loses when older.
  c.step = 35;
  io::save_checkpoint(base, c);
  EXPECT_EQ(io::latest_checkpoint(base), base);
  c.step = 5;
  io::save_checkpoint(base, c);
  EXPECT_EQ(io::latest_checkpoint(base), dir.path("ck.step00000030.safetensors"));

  // Temporary files: a dead writer's is removed, a running one's (ours) stays.
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  const std::string dead =
      dir.path("ck.step00000040.safetensors.tmp." + std::to_string(child) + ".0");
  const std::string live = dir.path("ck.safetensors.tmp." + std::to_string(::getpid()) + ".3");
  std::ofstream(dead) << "half";
  std::ofstream(live) << "half";
  const auto removed = io::prune_checkpoints(base, 2);
  EXPECT_EQ(removed.size(), 2u);
  EXPECT_FALSE(fs::exists(dir.path("ck.step00000010.safetensors")));
  EXPECT_TRUE(fs::exists(dir.path("ck.step00000020.safetensors")));
  EXPECT_TRUE(fs::exists(dir.path("ck.step00000030.safetensors")));
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(dir.path("other.step00000050.safetensors")));
  EXPECT_TRUE(fs::exists(base));
  EXPECT_TRUE(io::prune_checkpoints(base, 0).empty());  // keep 0: keep all
}

// Note [Killing the writer]
// A child process saves checkpoints to one path in a loop, each a few MiB whose every value is
// the step it records, and reports each completed save through a pipe; the parent waits for one
// report, then kills the child with SIGKILL after a random delay within about one save's
// duration (measured at the start, so the delays follow the machine's speed, sanitizers and
// load included), again and again. After every kill the path must hold a complete checkpoint:
// it loads, its SHA-256 matches, and its values agree with its step.
TEST(Checkpoint, SigkillAtRandomMomentsNeverLeavesAHalfWrittenFile) {
  TempDir dir;
  const std::string path = dir.path("ck.safetensors");
  constexpr int64_t kValues = 1 << 20;  // 4 MiB of f32
  Tensor data = empty({kValues});
  auto* values = static_cast<float*>(data.data_ptr());
  auto save = [&](int64_t step) {
    for (int64_t i = 0; i < kValues; ++i) values[i] = static_cast<float>(step);
    io::TrainingCheckpoint c;
    c.model = {{"w", data}};
    c.step = step;
    io::save_checkpoint(path, c);
  };
  save(0);  // also initialises libcrypto before any fork
  using Clock = std::chrono::steady_clock;
  // Waits for the child's next "saved" byte; false after a minute without one.
  auto saved = [](int fd) {
    pollfd p{fd, POLLIN, 0};
    char byte;
    return ::poll(&p, 1, 60000) == 1 && ::read(fd, &byte, 1) == 1;
  };
  std::mt19937 rng(7);
  double save_s = -1;  // one save's duration, measured in the first round
  int with_temp = 0;
  int64_t last_step = 0;
  constexpr int kKills = 20;
  for (int k = 0; k < kKills; ++k) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      for (int64_t step = last_step + 1;; ++step) {
        save(step);
        if (::write(fds[1], "s", 1) != 1) ::_exit(1);
      }
    }
    ::close(fds[1]);
    ASSERT_TRUE(saved(fds[0])) << "the writer completed no save in a minute";
    if (save_s < 0) {
      const auto t0 = Clock::now();
      ASSERT_TRUE(saved(fds[0]));
      save_s = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    const double delay = save_s * 1.5 * std::uniform_real_distribution<double>(0, 1)(rng);
    std::this_thread::sleep_for(std::chrono::duration<double>(delay));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(fds[0]);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    for (const auto& e : fs::directory_iterator(dir.dir()))
      if (e.path().string().find(".tmp.") != std::string::npos) ++with_temp;
    ASSERT_TRUE(fs::exists(path)) << "the checkpoint vanished";
    const io::TrainingCheckpoint c = io::load_checkpoint(path);  // throws if half-written
    ASSERT_EQ(c.model.size(), 1u);
    const Tensor& w = c.model[0].second;
    ASSERT_EQ(w.numel(), kValues);
    const auto* v = static_cast<const float*>(w.data_ptr());
    for (int64_t i = 0; i < kValues; i += 4099) ASSERT_EQ(v[i], static_cast<float>(c.step));
    ASSERT_GT(c.step, last_step);  // the reported save is on disk
    last_step = c.step;
    io::prune_checkpoints(path, 0);  // clears the killed writer's temporary file
  }
  // Kills landed while a file was being written (else this test proved nothing).
  EXPECT_GT(with_temp, 0) << "one save takes " << save_s << " s";
}

TEST(Checkpoint, PruningFromAPeriodicPathPrunesItsSeries) {
  TempDir dir;
  const std::string base = dir.path("ck.safetensors");
  EXPECT_EQ(io::checkpoint_series(io::checkpoint_path_for_step(base, 7)), base);
  EXPECT_EQ(io::checkpoint_series(base), base);
  EXPECT_EQ(io::checkpoint_series(dir.path("a.stepx.safetensors")),
            dir.path("a.stepx.safetensors"));
  io::TrainingCheckpoint c;
  c.model = {{"w", zeros({2})}};
  for (int64_t step : {1, 2, 3}) io::save_checkpoint(io::checkpoint_path_for_step(base, step), c);
  EXPECT_EQ(io::prune_checkpoints(io::checkpoint_path_for_step(base, 3), 1).size(), 2u);
  ASSERT_EQ(io::list_checkpoints(base).size(), 1u);
  EXPECT_EQ(io::list_checkpoints(base)[0].first, 3);
}

TEST(Checkpoint, SeriesWithoutExtensionPruneUpToTheStepAndOnlyOwnTemporaries) {
  TempDir dir;
  const std::string base = dir.path("ckpt");  // no extension
  EXPECT_EQ(io::checkpoint_path_for_step(base, 4), dir.path("ckpt.step00000004"));
  EXPECT_EQ(io::checkpoint_series(dir.path("ckpt.step00000004")), base);
  io::TrainingCheckpoint c;
  c.model = {{"w", zeros({2})}};
  for (int64_t step : {1, 2, 3, 9})
    io::save_checkpoint(io::checkpoint_path_for_step(base, step), c);
  ASSERT_EQ(io::list_checkpoints(base).size(), 4u);
  // Pruning after writing step 3 keeps 2 of steps <= 3 and leaves step 9 (not this run's past).
  const auto removed = io::prune_checkpoints(io::checkpoint_path_for_step(base, 3), 2);
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0], dir.path("ckpt.step00000001"));
  EXPECT_TRUE(fs::exists(dir.path("ckpt.step00000009")));
  // A dead writer's temporary file of another series stays.
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  const std::string other = dir.path("ckpt_best.tmp." + std::to_string(child) + ".0");
  const std::string mine = dir.path("ckpt.step00000004.tmp." + std::to_string(child) + ".0");
  std::ofstream(other) << "x";
  std::ofstream(mine) << "x";
  io::prune_checkpoints(base, 0);
  EXPECT_TRUE(fs::exists(other));
  EXPECT_FALSE(fs::exists(mine));
}

TEST(Checkpoint, CorruptMetadataIsCaughtByTheDigest) {
  TempDir dir;
  Trained t;
  const std::string path = dir.path("ck.safetensors");
  io::save_checkpoint(path, t.checkpoint());
  // "step":"1234567890123" -> "...124": still valid JSON and a valid number.
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const size_t at = bytes.find("1234567890123");
  ASSERT_NE(at, std::string::npos);
  bytes[at + 12] = '4';
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  expect_error([&] { io::load_checkpoint(path); }, {path, "corrupt"});
}

namespace {
std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
}  // namespace

// --resume auto's choice: a corrupt newest checkpoint (one flipped bit, every safetensors check
// still passing) is passed over with its reason for the newest one that verifies, and no file is
// changed; with none that verifies the choice is empty and lists them all.
TEST(Checkpoint, LatestValidCheckpointSkipsCorruptNewerOnesAndTouchesNothing) {
  TempDir dir;
  const std::string base = dir.path("ck.safetensors");
  EXPECT_EQ(io::latest_valid_checkpoint(base).path, "");
  EXPECT_TRUE(io::latest_valid_checkpoint(base).skipped.empty());
  io::TrainingCheckpoint c;
  c.model = {{"w", arange(0, 64, 1, kFloat32)}};
  for (int64_t step : {10, 20, 30}) {
    c.step = step;
    io::save_checkpoint(io::checkpoint_path_for_step(base, step), c);
  }
  const std::string newest = io::checkpoint_path_for_step(base, 30);
  flip_byte(newest, fs::file_size(newest) - 1);
  const std::string corrupt_bytes = file_bytes(newest);
  EXPECT_EQ(io::latest_checkpoint(base), newest);  // by the header alone, it looks fine

  io::CheckpointChoice choice = io::latest_valid_checkpoint(base);
  EXPECT_EQ(choice.path, io::checkpoint_path_for_step(base, 20));
  ASSERT_EQ(choice.skipped.size(), 1u);
  EXPECT_EQ(choice.skipped[0].path, newest);
  EXPECT_THAT(choice.skipped[0].reason, ::testing::HasSubstr("corrupt"));
  EXPECT_EQ(file_bytes(newest), corrupt_bytes);
  EXPECT_EQ(io::checkpoint_problem(newest), choice.skipped[0].reason);
  EXPECT_EQ(io::checkpoint_problem(choice.path), "");

  // An end-of-run file whose header cannot be read is tried (and reported) first.
  std::ofstream(base) << "not a checkpoint";
  choice = io::latest_valid_checkpoint(base);
  EXPECT_EQ(choice.path, io::checkpoint_path_for_step(base, 20));
  ASSERT_EQ(choice.skipped.size(), 2u);
  EXPECT_EQ(choice.skipped[0].path, base);
  EXPECT_EQ(choice.skipped[1].path, newest);

  // None verifies: no choice, every file listed, newest first, all still there.
  for (int64_t step : {10, 20}) {
    const std::string p = io::checkpoint_path_for_step(base, step);
    flip_byte(p, data_start(p));
  }
  choice = io::latest_valid_checkpoint(base);
  EXPECT_EQ(choice.path, "");
  ASSERT_EQ(choice.skipped.size(), 4u);
  EXPECT_EQ(choice.skipped[3].path, io::checkpoint_path_for_step(base, 10));
  EXPECT_EQ(io::list_checkpoints(base).size(), 3u);
  EXPECT_TRUE(fs::exists(base));
}

// The file save_checkpoint wrote before it refused NaN (Note [No NaN in a checkpoint]): the
// contents of a finite checkpoint with `t` put in place of tensor `name`, its SHA-256 recomputed
// as the writer does (the metadata's keys and values with their NULs, then the tensors' bytes).
void save_as_an_older_build(const std::string& path, const io::TrainingCheckpoint& finite,
                            const std::string& name, const Tensor& t) {
  io::SafetensorsContents c = io::checkpoint_contents(finite);
  for (auto& [n, tensor] : c.tensors)
    if (n == name) tensor = t.contiguous();
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  ASSERT_EQ(EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr), 1);
  for (const auto& [k, v] : c.metadata) {
    if (k == "sha256") continue;
    EVP_DigestUpdate(ctx.get(), k.c_str(), k.size() + 1);
    EVP_DigestUpdate(ctx.get(), v.c_str(), v.size() + 1);
  }
  for (const auto& [n, tensor] : c.tensors)
    EVP_DigestUpdate(ctx.get(), tensor.data_ptr(), static_cast<size_t>(tensor.nbytes()));
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  ASSERT_EQ(EVP_DigestFinal_ex(ctx.get(), md, &len), 1);
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) {
    hex += "0123456789abcdef"[md[i] >> 4];
    hex += "0123456789abcdef"[md[i] & 15];
  }
  c.metadata["sha256"] = hex;
  io::save_safetensors(path, c.tensors, c.metadata);
}

TEST(Checkpoint, NaNOrInfIsNeverWrittenAndTheFilesBeforeStay) {
  TempDir dir;
  const std::string path = dir.path("ck.safetensors");
  Trained t;
  io::save_checkpoint(path, t.checkpoint());
  const std::string before = file_bytes(path);

  for (double bad : {NAN, INFINITY, -INFINITY}) {
    for (DType dtype : {kFloat32, kFloat64, kBFloat16, kFloat16}) {
      io::TrainingCheckpoint c = t.checkpoint();
      Tensor w = zeros({3, 4}, dtype);
      w.set_at({2, 1}, bad);
      c.model.emplace_back("diverged", w);
      expect_error([&] { io::save_checkpoint(path, c); },
                   {"save_checkpoint: step 1234567890123", "tensor 'model.diverged'",
                    "1 of its 12 values are not finite", std::isnan(bad) ? "1 NaN" : "1 Inf",
                    "diverged", "not written"});
      EXPECT_EQ(file_bytes(path), before);
    }
  }
  // Optimizer state too (a momentum buffer full of NaN after a NaN gradient).
  io::TrainingCheckpoint c = t.checkpoint();
  c.optimizer[0].second = full(c.optimizer[0].second.shape(), NAN);
  expect_error([&] { io::save_checkpoint(path, c); }, {"tensor 'optim.", "NaN"});
  EXPECT_EQ(file_bytes(path), before);
  // Integers cannot hold NaN: an int64 buffer is written as it is.
  c = t.checkpoint();
  c.model.emplace_back("count", full({2}, 7.0, kInt64));
  io::save_checkpoint(path, c);
  EXPECT_EQ(io::checkpoint_problem(path), "");
}

TEST(Checkpoint, ResumeAutoPassesOverACheckpointHoldingNaN) {
  TempDir dir;
  const std::string base = dir.path("ck.safetensors");
  Trained t;
  io::TrainingCheckpoint c = t.checkpoint();
  c.step = 10;
  io::save_checkpoint(io::checkpoint_path_for_step(base, 10), c);
  c.step = 20;
  const std::string newest = io::checkpoint_path_for_step(base, 20);
  Tensor w = t.model->state_dict()[0].second.clone();
  w.set_at({0, 0}, NAN);
  save_as_an_older_build(newest, c, "model." + t.model->state_dict()[0].first, w);
  ASSERT_EQ(io::checkpoint_step(newest), 20);

  expect_error([&] { io::load_checkpoint(newest); },
               {newest, "1 NaN", "diverged", "cannot be resumed from"});
  const io::CheckpointChoice choice = io::latest_valid_checkpoint(base);
  EXPECT_EQ(choice.path, io::checkpoint_path_for_step(base, 10));
  ASSERT_EQ(choice.skipped.size(), 1u);
  EXPECT_EQ(choice.skipped[0].path, newest);
  EXPECT_THAT(choice.skipped[0].reason, ::testing::HasSubstr("not finite"));
  EXPECT_TRUE(fs::exists(newest));  // left for the user to look at
}

TEST(Checkpoint, EndOfRunFileComesBeforeAPeriodicFileOfItsStep) {
  TempDir dir;
  const std::string base = dir.path("ck.safetensors");
  io::TrainingCheckpoint c;
  c.model = {{"w", zeros({2})}};
  for (int64_t step : {10, 20}) {
    c.step = step;
    io::save_checkpoint(io::checkpoint_path_for_step(base, step), c);
  }
  c.step = 20;
  io::save_checkpoint(base, c);
  EXPECT_EQ(io::latest_valid_checkpoint(base).path, base);
  c.step = 15;
  io::save_checkpoint(base, c);
  const std::string periodic20 = io::checkpoint_path_for_step(base, 20);
  flip_byte(periodic20, data_start(periodic20));
  const io::CheckpointChoice choice = io::latest_valid_checkpoint(base);
  EXPECT_EQ(choice.path, base);
  ASSERT_EQ(choice.skipped.size(), 1u);
  EXPECT_EQ(choice.skipped[0].path, io::checkpoint_path_for_step(base, 20));
}

TEST(Checkpoint, PruningSparesTheGivenFilesAndDoesNotCountThem) {
  TempDir dir;
  const std::string base = dir.path("ck.safetensors");
  io::TrainingCheckpoint c;
  c.model = {{"w", zeros({2})}};
  for (int64_t step : {1, 2, 3, 4})
    io::save_checkpoint(io::checkpoint_path_for_step(base, step), c);
  const std::string spared = io::checkpoint_path_for_step(base, 2);
  const auto removed = io::prune_checkpoints(io::checkpoint_path_for_step(base, 4), 2, {spared});
  EXPECT_EQ(removed, std::vector<std::string>{io::checkpoint_path_for_step(base, 1)});
  EXPECT_TRUE(fs::exists(spared));
  EXPECT_TRUE(fs::exists(io::checkpoint_path_for_step(base, 3)));
  EXPECT_TRUE(fs::exists(io::checkpoint_path_for_step(base, 4)));
}

// --save is checked before a run: a writable place (its directory created if need be) passes, and
// a directory, a directory under a regular file or an unwritable one fail with the reason. (Tests
// run as root, which chmod does not stop: a path under a file, and /proc, fail for root too.)
TEST(Checkpoint, CheckpointPathProblemSaysWhyAPathCannotBeWritten) {
  TempDir dir;
  EXPECT_EQ(io::checkpoint_path_problem(dir.path("ck.safetensors")), "");
  EXPECT_EQ(io::checkpoint_path_problem(dir.path("new/sub/ck.safetensors")), "");
  EXPECT_TRUE(fs::is_directory(dir.path("new/sub")));
  EXPECT_TRUE(fs::is_empty(dir.path("new/sub")));  // the probe file is gone again
  std::ofstream(dir.path("file")) << "x";
  EXPECT_THAT(io::checkpoint_path_problem(dir.path("file/sub/ck.safetensors")),
              ::testing::HasSubstr("cannot create the directory " + dir.path("file/sub")));
  EXPECT_THAT(io::checkpoint_path_problem(dir.path("new")), ::testing::HasSubstr("is a directory"));
  EXPECT_THAT(io::checkpoint_path_problem("/proc/ck.safetensors"),
              ::testing::HasSubstr("cannot create a file in /proc"));
  EXPECT_NE(io::checkpoint_path_problem(""), "");
}
