// The system-call check, the owning file descriptor and the file written whole
// (include/lockstep/base/syscall.h).
#include "lockstep/base/syscall.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace lockstep {
namespace {

bool fd_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(Syscall, CheckReturnsTheResultOfASuccessfulCall) {
  int fds[2];
  EXPECT_EQ(LS_SYSCHECK(::pipe(fds)), 0);
  Fd r(fds[0]), w(fds[1]);
  EXPECT_EQ(LS_SYSCHECK(::write(w.get(), "ab", 2)), 2);
}

TEST(Syscall, FailureThrowsNamingTheCallAndErrno) {
  try {
    LS_SYSCHECK(::close(-1));
    FAIL() << "close(-1) did not throw";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("::close(-1) failed"), std::string::npos) << what;
    EXPECT_NE(what.find("Bad file descriptor (errno " + std::to_string(EBADF) + ")"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("syscall_test.cpp:"), std::string::npos) << what;
  }
}

TEST(Syscall, AllowedErrnoIsReturnedNotThrown) {
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_NONBLOCK), 0);
  Fd r(fds[0]), w(fds[1]);
  char c;
  errno = 0;
  EXPECT_EQ(LS_SYSCHECK(::read(r.get(), &c, 1), EAGAIN, EWOULDBLOCK), -1);
  EXPECT_EQ(errno, EAGAIN);
  EXPECT_THROW(LS_SYSCHECK(::read(r.get(), &c, 1), EINTR), Error);  // EAGAIN not allowed here
}

TEST(Syscall, MessageVariantPutsTheCallersWordsFirst) {
  try {
    LS_SYSCHECK_MSG(::open("/nonexistent-dir/x", O_RDONLY), "cannot open ", "/nonexistent-dir/x");
    FAIL() << "open did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "cannot open /nonexistent-dir/x: No such file or directory (errno " +
                               std::to_string(ENOENT) + ")");
  }
}

TEST(Syscall, RetryOnEintrStopsAtTheFirstOtherResult) {
  int calls = 0;
  auto r = retry_on_eintr([&] {
    ++calls;
    errno = calls < 3 ? EINTR : 0;
    return calls < 3 ? -1 : 7;
  });
  EXPECT_EQ(r, 7);
  EXPECT_EQ(calls, 3);
  calls = 0;
  r = retry_on_eintr([&] {
    ++calls;
    errno = EIO;
    return -1;
  });
  EXPECT_EQ(r, -1);
  EXPECT_EQ(errno, EIO);
  EXPECT_EQ(calls, 1);
}

TEST(Syscall, WriteBestEffortWritesEverythingAndReportsADeadReader) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  Fd r(fds[0]), w(fds[1]);
  EXPECT_TRUE(write_best_effort(w.get(), "hello"));
  char buf[8] = {};
  ASSERT_EQ(::read(r.get(), buf, sizeof buf), 5);
  EXPECT_STREQ(buf, "hello");
  r.reset();
  // A reader gone: EPIPE, reported as false (SIGPIPE ignored here, as a launcher does).
  struct sigaction ignore {}, old {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGPIPE, &ignore, &old), 0);
  EXPECT_FALSE(write_best_effort(w.get(), "lost"));
  ::sigaction(SIGPIPE, &old, nullptr);
  EXPECT_FALSE(write_best_effort(-1, "x"));
  EXPECT_TRUE(write_best_effort(-1, ""));  // nothing to write: nothing fails
}

TEST(Fd, ClosesOnDestructionAndMovesOwnership) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ::close(fds[1]);
  {
    Fd a(fds[0]);
    EXPECT_TRUE(a.valid());
    Fd b(std::move(a));
    EXPECT_FALSE(a.valid());
    EXPECT_EQ(b.get(), fds[0]);
    EXPECT_TRUE(fd_open(fds[0]));
  }
  EXPECT_FALSE(fd_open(fds[0]));
}

TEST(Fd, ReleaseGivesUpOwnershipAndCloseReportsErrors) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  int raw;
  {
    Fd a(fds[0]);
    raw = a.release();
    EXPECT_FALSE(a.valid());
  }
  EXPECT_TRUE(fd_open(raw));
  ::close(raw);
  Fd w(fds[1]);
  EXPECT_EQ(w.close(), 0);
  EXPECT_FALSE(w.valid());
  EXPECT_FALSE(fd_open(fds[1]));
  EXPECT_EQ(w.close(), 0);  // closing an empty Fd is a no-op
}

namespace fs = std::filesystem;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The files in `dir` other than `keep`: what a write left behind.
std::vector<std::string> others_in(const fs::path& dir, const std::string& keep) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename() != keep) out.push_back(e.path().filename().string());
  return out;
}

TEST(AtomicFile, CommitReplacesTheFileWholeAndLeavesNoTemporaryFile) {
  const fs::path dir = fs::temp_directory_path() / ("atomic_file_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path path = dir / "out.bin";
  std::ofstream(path) << "old";  // a temporary: closed at the end of the statement
  {
    AtomicFile f(path.string(), "test");
    f.write("new ", 4);
    f.write("bytes", 5);
    EXPECT_EQ(read_text(path), "old");  // nothing reaches the file before commit()
    f.commit();
  }
  EXPECT_EQ(read_text(path), "new bytes");
  EXPECT_TRUE(others_in(dir, "out.bin").empty());
  fs::remove_all(dir);
}

TEST(AtomicFile, AnAbandonedWriteKeepsTheOldFileAndRemovesItsTemporaryFile) {
  const fs::path dir = fs::temp_directory_path() / ("atomic_file_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path path = dir / "out.bin";
  std::ofstream(path) << "old";  // a temporary: closed at the end of the statement
  try {
    AtomicFile f(path.string(), "test");
    f.write("half", 4);
    throw std::runtime_error("the writer failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(read_text(path), "old");
  EXPECT_TRUE(others_in(dir, "out.bin").empty());
  EXPECT_THROW(AtomicFile((dir / "no" / "such" / "dir").string(), "test"), Error);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace lockstep
