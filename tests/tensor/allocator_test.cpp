// The caching CPU allocator: alignment, reuse, no OS allocations in a steady state, and its
// LOCKSTEP_CPU_CACHE_MB checked.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "lockstep/base/worker_env.h"
#include "testing.h"

extern char** environ;

using namespace lockstep;

TEST(Allocator, SteadyStateAsksTheOsForNothing) {
  auto step = [] {
    Tensor a = ones({256, 1024});
    Tensor b = ones({1024});
    Tensor c = add(a, b);
    Tensor d = mul(c, c);
    (void)sum(d).item();
  };
  step();
  step();
  const AllocatorStats before = cpu_allocator_stats();
  for (int i = 0; i < 20; ++i) step();
  const AllocatorStats after = cpu_allocator_stats();
  EXPECT_GT(after.allocations, before.allocations);
  EXPECT_EQ(after.os_allocations, before.os_allocations);
}

TEST(Allocator, ReusesFreedBlocksOfTheSameClass) {
  void* first;
  {
    Tensor a = empty({12345});
    first = a.storage()->data();
  }
  Tensor b = empty({12340});  // same size class
  EXPECT_EQ(b.storage()->data(), first);
}

TEST(Allocator, EmptyCacheReleasesMemory) {
  { Tensor a = empty({1 << 20}); }
  EXPECT_GT(cpu_allocator_stats().cached_bytes, 0);
  cpu_allocator_empty_cache();
  EXPECT_EQ(cpu_allocator_stats().cached_bytes, 0);
}

namespace {

struct Child {
  int status = 0;
  std::string output;
};

// This test binary again, running only `test` with LOCKSTEP_CPU_CACHE_MB=`cache_mb`: the
// allocator is made afresh there, reading the variable.
Child run_with_cache_mb(const std::string& test, const std::string& cache_mb) {
  const std::string out =
      ::testing::TempDir() + "allocator_env_" + std::to_string(::getpid()) + ".txt";
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) {
    if (std::string(*e).rfind(env::kCpuCacheMb, 0) != 0) env_s.emplace_back(*e);
  }
  env_s.push_back(std::string(env::kCpuCacheMb) + "=" + cache_mb);
  std::vector<char*> envp;
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", filter = "--gtest_filter=" + test;
  char* argv[] = {exe.data(), filter.data(), nullptr};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = 0;
  Child c;
  const int rc = ::posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&fa);
  LS_CHECK(rc == 0, "posix_spawn: ", rc);
  LS_CHECK(::waitpid(pid, &c.status, 0) == pid, "waitpid");
  std::ifstream in(out);
  c.output.assign(std::istreambuf_iterator<char>(in), {});
  std::remove(out.c_str());
  return c;
}

}  // namespace

// Note [CPU cache limit from the environment]: the bad value throws from the first allocation,
// to the test body that made it (gtest reports the exception and exits 1), not from a static
// initializer to std::terminate (SIGABRT).
TEST(AllocatorEnv, ABadCacheSizeIsAClearErrorFromTheFirstAllocation) {
  const Child c = run_with_cache_mb("Allocator.ReusesFreedBlocksOfTheSameClass", "abc");
  ASSERT_TRUE(WIFEXITED(c.status)) << "killed by signal " << WTERMSIG(c.status) << ":\n"
                                   << c.output;
  EXPECT_EQ(WEXITSTATUS(c.status), 1) << c.output;
  EXPECT_THAT(c.output, ::testing::HasSubstr("LOCKSTEP_CPU_CACHE_MB='abc' is not an integer: "
                                             "expected one from 0 to 1048576 MiB"));
  EXPECT_THAT(c.output, ::testing::Not(::testing::HasSubstr("terminate called")));
}

TEST(AllocatorEnv, OutOfRangeAndGarbledSizesAreErrorsAndAGoodOneRuns) {
  const Child c = run_with_cache_mb("Allocator.ReusesFreedBlocksOfTheSameClass", "8");
  ASSERT_TRUE(WIFEXITED(c.status)) << c.output;
  EXPECT_EQ(WEXITSTATUS(c.status), 0) << c.output;
  // Out of range and garbled numbers: the old strtoull read "-5" as 2^64 - 5 MiB.
  for (const auto& [bad, said] : std::vector<std::pair<std::string, std::string>>{
           {"-5", "=-5 is out of range"},
           {"99999999999999999999", "=99999999999999999999 is out of range"},
           {"64GB", "='64GB' is not an integer"}}) {
    const Child b = run_with_cache_mb("Allocator.ReusesFreedBlocksOfTheSameClass", bad);
    EXPECT_TRUE(WIFEXITED(b.status) && WEXITSTATUS(b.status) == 1) << bad << ":\n" << b.output;
    EXPECT_THAT(b.output, ::testing::HasSubstr("LOCKSTEP_CPU_CACHE_MB" + said)) << b.output;
  }
}

// Note [CPU memory limit]: an allocation beyond the limit fails with a message naming the size,
// the total it would reach, the limit and what the innermost AllocationScope says it was for;
// within the limit allocations go on, and the peak counts them.
TEST(CpuAllocator, AMemoryLimitFailsTheAllocationThatWouldPassItNamingWhatItWasFor) {
  reset_cpu_allocator_peak();
  const int64_t before = cpu_allocator_stats().allocated_bytes;
  set_cpu_memory_limit(static_cast<size_t>(before) + (size_t{4} << 20));
  {
    Tensor fits = empty({int64_t{1} << 19}, kFloat32);  // 2 MiB
    EXPECT_GE(cpu_allocator_stats().peak_allocated_bytes, before + (int64_t{2} << 20));
    try {
      AllocationScope scope("the test's big block");
      Tensor big = empty({int64_t{1} << 20}, kFloat32);  // 4 MiB more: over
      ADD_FAILURE() << "an allocation over the limit succeeded";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(),
                  ::testing::HasSubstr("out of memory: allocating 4.00 MiB for the test's "
                                       "big block"));
      EXPECT_THAT(e.what(), ::testing::HasSubstr("LOCKSTEP_CPU_MEMORY_LIMIT_MB"));
    }
    EXPECT_EQ(AllocationScope::current(), nullptr);
  }
  set_cpu_memory_limit(0);
  Tensor after = empty({int64_t{1} << 20}, kFloat32);  // no limit: fine
  EXPECT_EQ(after.numel(), int64_t{1} << 20);
}
