// Shared test helpers: random inputs, naive strided reads, and message matchers.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "lockstep/lockstep.h"

namespace lockstep::testing {

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->test_suite_name()) + "_" + info->name();
    for (char& c : name)
      if (c == '/') c = '_';
    dir_ = std::filesystem::temp_directory_path() /
           ("lockstep_test_" + std::to_string(::getpid()) + "_" + name);
    std::filesystem::create_directories(dir_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
};

// Row-major multi-index for a flat position.
inline Dims unravel(int64_t flat, const Dims& shape) {
  Dims idx = Dims::filled(shape.size(), 0);
  for (int64_t d = shape.size() - 1; d >= 0; --d) {
    idx[d] = flat % shape[d];
    flat /= shape[d];
  }
  return idx;
}

// Values of `t` read one element at a time through at() (a reference independent of kernels).
inline std::vector<double> values(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = t.at(unravel(i, t.shape()));
  return v;
}

// Builds a tensor of `shape` whose element i is f(i), in dtype `dt`.
inline Tensor make(const Dims& shape, const std::function<double(int64_t)>& f,
                   DType dt = kFloat32) {
  Tensor t = empty(shape, dt);
  for (int64_t i = 0; i < t.numel(); ++i) t.set_at(unravel(i, shape), f(i));
  return t;
}

// The same values as `t` but laid out transposed in memory (a non-contiguous view).
inline Tensor non_contiguous(const Tensor& t) {
  if (t.dim() < 2) {
    Tensor big = empty({t.numel() * 2}, t.dtype());
    Tensor v = big.slice(0, 0, t.numel() * 2, 2).view(t.shape());
    v.copy_(t);
    return v;
  }
  Tensor tt = t.transpose(0, t.dim() - 1).contiguous();
  return tt.transpose(0, t.dim() - 1);
}

// Expects `fn` to throw lockstep::Error whose message contains every string in `parts`.
inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected lockstep::Error";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_THAT(std::string(e.what()), ::testing::HasSubstr(p));
  }
}

// Elementwise |got - want| <= tol * (1 + |want|), naming the first failing position.
inline void expect_close(const std::vector<double>& got, const std::vector<double>& want,
                         double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * (1 + std::abs(want[i]))) << what << " at " << i;
}

inline void expect_near_all(const Tensor& got, const std::vector<double>& want, double tol,
                            const std::string& what) {
  expect_close(got.to_vector<double>(), want, tol, what);
}

inline void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                             const std::vector<Tensor>& inputs,
                             autograd::GradcheckOptions opts = {}) {
  auto r = autograd::gradcheck(fn, inputs, opts);
  EXPECT_TRUE(r.ok) << r.message;
}

// The world sizes of a collective sweep run as separate processes: 1 to 4, or 3 alone in the
// sanitizer build (a world that is not a power of two, the one with the most unequal pieces).
// There the same sweeps also run as threads at every size, on the same code, and a process per
// rank adds no memory the sanitizer could check, only CI's time.
inline std::vector<int> process_sweep_world_sizes(bool with_one) {
#if defined(__SANITIZE_ADDRESS__)
  (void)with_one;
  return {3};
#else
  if (with_one) return {1, 2, 3, 4};
  return {2, 3, 4};
#endif
}

}  // namespace lockstep::testing
