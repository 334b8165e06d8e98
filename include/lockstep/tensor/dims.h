// Dims: a small inline vector of int64 used for shapes, strides and dimension lists.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace lockstep {

// Shapes live inline (no heap allocation) because every op creates a few of them; keeping them
// off the heap is most of what makes a tiny op cheap. kMaxDims bounds the rank of a tensor.
class Dims {
 public:
  static constexpr int64_t kMaxDims = 8;

  Dims() = default;
  Dims(std::initializer_list<int64_t> values);
  explicit Dims(const std::vector<int64_t>& values);
  static Dims filled(int64_t n, int64_t value);

  int64_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  int64_t operator[](int64_t i) const { return d_[i]; }
  int64_t& operator[](int64_t i) { return d_[i]; }
  int64_t back() const { return d_[n_ - 1]; }
  const int64_t* begin() const { return d_; }
  const int64_t* end() const { return d_ + n_; }
  int64_t* begin() { return d_; }
  int64_t* end() { return d_ + n_; }
  const int64_t* data() const { return d_; }

  void push_back(int64_t v);
  void insert(int64_t pos, int64_t v);
  void erase(int64_t pos);
  void resize(int64_t n, int64_t value = 0);

  // Product of the entries (1 for an empty Dims).
  int64_t numel() const;
  std::vector<int64_t> vec() const { return {begin(), end()}; }
  // "[64, 784]"
  std::string str() const;

  friend bool operator==(const Dims& a, const Dims& b);
  friend bool operator!=(const Dims& a, const Dims& b) { return !(a == b); }

 private:
  int64_t d_[kMaxDims] = {};
  int64_t n_ = 0;
};

std::ostream& operator<<(std::ostream& os, const Dims& d);

}  // namespace lockstep
