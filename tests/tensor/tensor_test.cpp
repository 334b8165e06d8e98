// Tensor core: creation, views sharing storage, contiguity, element access, printing, errors.
#include <cmath>
#include <cstdint>

#include "lockstep/tensor/cuda.h"
#include "testing.h"

using namespace lockstep;
using lockstep::testing::expect_error;
using lockstep::testing::values;

TEST(Tensor, UndefinedAndMetadata) {
  Tensor u;
  EXPECT_FALSE(u.defined());
  Tensor t = zeros({2, 3, 4});
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.strides(), (Dims{12, 4, 1}));
  EXPECT_EQ(t.dtype(), kFloat32);
  EXPECT_TRUE(t.device().is_cpu());
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.nbytes(), 96);
  expect_error([&] { (void)t.size(3); }, {"dimension 3 is out of range", "3 dimensions"});
}

TEST(Tensor, CopiesAreHandlesSharingState) {
  Tensor a = zeros({4});
  Tensor b = a;
  b.set_at({2}, 5.0);
  EXPECT_EQ(a.at({2}), 5.0);
  EXPECT_TRUE(a.is_same(b));
}

TEST(Tensor, CreationFunctions) {
  EXPECT_EQ(values(ones({3})), (std::vector<double>{1, 1, 1}));
  EXPECT_EQ(values(full({2}, 2.5, kFloat64)), (std::vector<double>{2.5, 2.5}));
  EXPECT_EQ(values(arange(5)), (std::vector<double>{0, 1, 2, 3, 4}));
  EXPECT_EQ(arange(5).dtype(), kInt64);
  EXPECT_EQ(values(arange(1.0, 2.0, 0.25)), (std::vector<double>{1, 1.25, 1.5, 1.75}));
  EXPECT_EQ(values(arange(3.0, 0.0, -1.0)), (std::vector<double>{3, 2, 1}));
  EXPECT_EQ(arange(0.0, 0.0).numel(), 0);
  Tensor s = scalar_tensor(7.0);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.item(), 7.0);
  for (DType dt : {kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64, kUInt8, kBool}) {
    Tensor z = zeros({3, 5}, dt);
    EXPECT_EQ(z.dtype(), dt);
    EXPECT_EQ(z.element_size(), dtype_size(dt));
    for (double v : values(z)) EXPECT_EQ(v, 0.0);
    for (double v : values(ones({2}, dt))) EXPECT_EQ(v, 1.0);
  }
  expect_error([] { (void)empty({2, -1}); }, {"negative dimension", "[2, -1]"});
}

TEST(Tensor, FromBufferCopiesBorrowShares) {
  std::vector<float> data{1, 2, 3, 4, 5, 6};
  Tensor copied = from_buffer(data.data(), {2, 3}, kFloat32);
  Tensor borrowed = borrow(data.data(), {2, 3}, kFloat32);
  data[4] = 50;
  EXPECT_EQ(copied.at({1, 1}), 5.0);
  EXPECT_EQ(borrowed.at({1, 1}), 50.0);
  borrowed.set_at({0, 0}, -1.0);
  EXPECT_EQ(data[0], -1.0f);
  expect_error([] { (void)from_vector<float>({1, 2, 3}, {2, 2}); }, {"3 values", "[2, 2]"});
}

TEST(Tensor, StorageIs64ByteAligned) {
  for (int64_t n : {1, 3, 17, 1000, 100000}) {
    for (DType dt : {kFloat32, kUInt8, kFloat64}) {
      Tensor t = empty({n}, dt);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t.storage()->data()) % 64, 0u) << n;
    }
  }
}

TEST(Tensor, ViewsShareStorage) {
  Tensor a = arange(0.0, 24.0, 1.0, kFloat32).reshape({2, 3, 4});
  Tensor v = a.view({6, 4});
  Tensor tr = a.transpose(0, 2);
  Tensor p = a.permute({1, 2, 0});
  Tensor n = a.narrow(2, 1, 2);
  Tensor sl = a.slice(1, 0, 3, 2);
  Tensor e = a.select(0, 1).unsqueeze(0).expand({5, 3, 4});
  Tensor sq = a.narrow(0, 0, 1).squeeze(0);
  EXPECT_EQ(tr.shape(), (Dims{4, 3, 2}));
  EXPECT_EQ(p.shape(), (Dims{3, 4, 2}));
  EXPECT_EQ(n.shape(), (Dims{2, 3, 2}));
  EXPECT_EQ(sl.shape(), (Dims{2, 2, 4}));
  EXPECT_EQ(e.shape(), (Dims{5, 3, 4}));
  EXPECT_EQ(sq.shape(), (Dims{3, 4}));
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_FALSE(n.is_contiguous());
  EXPECT_EQ(e.stride(0), 0);
  // Values read through each view match the base at the mapped index.
  EXPECT_EQ(tr.at({3, 2, 1}), a.at({1, 2, 3}));
  EXPECT_EQ(p.at({2, 3, 1}), a.at({1, 2, 3}));
  EXPECT_EQ(n.at({1, 2, 0}), a.at({1, 2, 1}));
  EXPECT_EQ(sl.at({1, 1, 3}), a.at({1, 2, 3}));
  EXPECT_EQ(e.at({4, 2, 3}), a.at({1, 2, 3}));
  // A write through any view is seen by the base.
  n.set_at({0, 0, 0}, -7.0);
  EXPECT_EQ(a.at({0, 0, 1}), -7.0);
  tr.set_at({0, 1, 1}, -8.0);
  EXPECT_EQ(a.at({1, 1, 0}), -8.0);
  v.set_at({5, 3}, -9.0);
  EXPECT_EQ(a.at({1, 2, 3}), -9.0);
  EXPECT_EQ(v.storage(), a.storage());
  EXPECT_EQ(sl.slice(0, -1, 2).shape(), (Dims{1, 2, 4}));
}

TEST(Tensor, ViewVersusReshape) {
  Tensor a = arange(0.0, 12.0, 1.0).reshape({3, 4});
  Tensor t = a.t();
  expect_error([&] { (void)t.view({12}); }, {"cannot be viewed", "reshape"});
  Tensor r = t.reshape({12});
  EXPECT_NE(r.storage(), a.storage());  // needed a copy
  EXPECT_EQ(values(r), (std::vector<double>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  Tensor r2 = a.reshape({2, -1});
  EXPECT_EQ(r2.shape(), (Dims{2, 6}));
  EXPECT_EQ(r2.storage(), a.storage());  // a view
  // A non-contiguous tensor can still be viewed when the split dims stay contiguous.
  Tensor b = arange(0.0, 24.0, 1.0).reshape({2, 3, 4}).narrow(0, 1, 1);
  EXPECT_EQ(b.view({3, 2, 2}).storage(), b.storage());
  expect_error([&] { (void)a.reshape({5, -1}); }, {"invalid for a tensor of 12 elements"});
  expect_error([&] { (void)a.view({-1, -1}); }, {"only one dimension can be -1"});
  EXPECT_EQ(a.flatten().shape(), (Dims{12}));
  EXPECT_EQ(zeros({2, 3, 4, 5}).flatten(1, 2).shape(), (Dims{2, 12, 5}));
}

TEST(Tensor, ContiguousCopiesOnlyWhenNeeded) {
  Tensor a = arange(0.0, 6.0, 1.0).reshape({2, 3});
  EXPECT_TRUE(a.contiguous().is_same(a));
  Tensor c = a.t().contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(values(c), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  // Size-1 dims with odd strides still count as contiguous.
  Tensor one = a.narrow(0, 1, 1);
  EXPECT_TRUE(one.is_contiguous());
}

TEST(Tensor, ExpandErrors) {
  Tensor a = zeros({3, 1});
  EXPECT_EQ(a.expand({2, 3, 4}).shape(), (Dims{2, 3, 4}));
  EXPECT_EQ(a.expand({-1, 5}).shape(), (Dims{3, 5}));
  expect_error([&] { (void)a.expand({4, 4}); }, {"cannot expand [3, 1] to [4, 4]"});
  expect_error([&] { (void)a.narrow(0, 2, 2); }, {"out of bounds", "size 3"});
  expect_error([&] { (void)a.permute({0, 0}); }, {"repeated"});
}

TEST(Tensor, DtypeConversions) {
  Tensor f = from_vector<float>({-2.5f, -0.5f, 0.0f, 1.5f, 2.5f, 300.0f}, {6});
  EXPECT_EQ(values(f.to(kInt32)), (std::vector<double>{-2, 0, 0, 1, 2, 300}));  // truncation
  EXPECT_EQ(values(f.to(kBool)), (std::vector<double>{1, 1, 0, 1, 1, 1}));
  EXPECT_EQ(values(f.to(kFloat64)), values(f));
  EXPECT_EQ(values(f.to(kBFloat16)), (std::vector<double>{-2.5, -0.5, 0, 1.5, 2.5, 300}));
  Tensor i = from_vector<int64_t>({int64_t{1} << 53, 3, -4}, {3});
  EXPECT_EQ(i.to(kFloat64).at({0}), 9007199254740992.0);
  EXPECT_EQ(values(i.to(kInt32)), (std::vector<double>{0, 3, -4}));
  // Every pair of dtypes converts.
  for (DType a : {kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64, kUInt8, kBool}) {
    for (DType b : {kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64, kUInt8, kBool}) {
      Tensor x = arange(0.0, 3.0, 1.0, a);
      Tensor y = x.to(b);
      EXPECT_EQ(y.dtype(), b);
      EXPECT_EQ(values(y), (b == kBool || a == kBool ? std::vector<double>{0, 1, 1}
                                       : std::vector<double>{0, 1, 2}))
          << dtype_name(a) << "->" << dtype_name(b);
    }
  }
  EXPECT_EQ(parse_dtype("bfloat16"), kBFloat16);
  expect_error([] { (void)parse_dtype("f8"); }, {"unknown dtype 'f8'"});
}

TEST(Tensor, ElementAccessChecksBounds) {
  Tensor a = zeros({2, 3});
  expect_error([&] { (void)a.at({2, 0}); }, {"out of bounds", "[2, 3]"});
  expect_error([&] { (void)a.at({0}); }, {"1 entries", "2 dimensions"});
  expect_error([&] { (void)a.item(); }, {"one element", "[2, 3]"});
  expect_error([&] { (void)a.data<double>(); }, {"dtype f32", "f64"});
  EXPECT_EQ(a.to_vector<float>().size(), 6u);
}

TEST(Tensor, Printing) {
  Tensor a = arange(0.0, 6.0, 1.0, kFloat32).reshape({2, 3});
  const std::string s = a.to_string();
  EXPECT_THAT(s, ::testing::HasSubstr("dtype=f32"));
  EXPECT_THAT(s, ::testing::HasSubstr("device=cpu"));
  EXPECT_THAT(s, ::testing::HasSubstr("shape=[2, 3]"));
  EXPECT_THAT(s, ::testing::HasSubstr("[[0, 1, 2],\n [3, 4, 5]]"));
  EXPECT_THAT(arange(5000).to_string(), ::testing::HasSubstr("[0, 1, 2, ..., 4997, 4998, 4999]"));
  EXPECT_EQ(Tensor().to_string(), "tensor(undefined)");
}

TEST(Tensor, CudaWithoutSupportIsAClearError) {
  EXPECT_EQ(Device::parse("cuda:3").index, 3);
  EXPECT_TRUE(Device::parse("cuda:3").is_cuda());
  EXPECT_EQ(Device::parse("cuda:1").str(), "cuda:1");
  expect_error([] { (void)Device::parse("gpu"); }, {"invalid device 'gpu'"});
  // A CUDA build without a GPU fails in the CUDA runtime instead (tests/cuda/ covers both).
  if (!cuda::compiled_with_cuda()) {
    expect_error([] { (void)empty({2}, cuda_device(0)); }, {"cuda:0", "no CUDA support"});
    expect_error([] { (void)zeros({2}).to(cuda_device(0)); }, {"cuda:0", "no cuda:0 support"});
  }
}

TEST(Tensor, TooManyDimensions) {
  expect_error([] { (void)Dims({1, 1, 1, 1, 1, 1, 1, 1, 1}); }, {"at most 8 dimensions"});
}

TEST(Tensor, FromVectorOfBool) {
  Tensor b = from_vector<bool>({true, false, true}, {3});
  EXPECT_EQ(b.dtype(), kBool);
  EXPECT_EQ(values(b), (std::vector<double>{1, 0, 1}));
}

TEST(Tensor, ShapesWhoseSizeOverflowAreErrors) {
  expect_error([] { (void)empty({int64_t{1} << 62, 4}); }, {"more elements than fit in 64 bits"});
  expect_error([] { (void)empty({int64_t{1} << 61, 2}, kFloat64); }, {"more bytes than fit"});
  expect_error([] { (void)scalar_tensor(1.0).size(0); }, {"0-dim tensor has no dimensions"});
  expect_error([] { (void)ones({7, 3}).select(0, 1).select(0, 2).stride(0); }, {"0-dim"});
}
