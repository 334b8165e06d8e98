// Starting, reading and stopping one worker process.
#include "worker_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "lockstep/base/error.h"

namespace lockstep::launch {

std::string signal_name(int sig) {
  switch (sig) {
    case SIGHUP:
      return "SIGHUP";
    case SIGINT:
      return "SIGINT";
    case SIGQUIT:
      return "SIGQUIT";
    case SIGILL:
      return "SIGILL";
    case SIGTRAP:
      return "SIGTRAP";
    case SIGABRT:
      return "SIGABRT";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGKILL:
      return "SIGKILL";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGSEGV:
      return "SIGSEGV";
    case SIGUSR2:
      return "SIGUSR2";
    case SIGPIPE:
      return "SIGPIPE";
    case SIGALRM:
      return "SIGALRM";
    case SIGTERM:
      return "SIGTERM";
    case SIGXCPU:
      return "SIGXCPU";
    case SIGXFSZ:
      return "SIGXFSZ";
    case SIGSYS:
      return "SIGSYS";
    default:
      return "signal " + std::to_string(sig);
  }
}

std::string ExitStatus::str() const {
  if (signaled) {
    const std::string name = signal_name(signal);
    return name.rfind("SIG", 0) == 0 ? "signal " + name + " (" + std::to_string(signal) + ")"
                                     : name;
  }
  return "exit code " + std::to_string(code);
}

void LineSplitter::feed(const char* data, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const char c = data[i];
    if (c == '\n') {
      sink_(partial_.empty() ? last_segment_ : partial_);
      partial_.clear();
      last_segment_.clear();
      continue;
    }
    if (c == '\r') {  // Note [Carriage returns] in worker_process.h
      if (!partial_.empty()) {
        if (redraw_) redraw_(partial_);
        last_segment_.swap(partial_);
        partial_.clear();
      }
      continue;
    }
    if (partial_.size() == kMaxLine) {  // a full piece, and more of the line follows
      sink_(partial_);
      partial_.clear();
      last_segment_.clear();
    }
    partial_.push_back(c);
  }
}

void LineSplitter::finish() {
  if (!partial_.empty()) {
    sink_(partial_);
  } else if (!last_segment_.empty()) {
    sink_(last_segment_);
  }
  partial_.clear();
  last_segment_.clear();
}

namespace {

// The soft limit the launcher was started with, for its workers; unset until raised.
bool g_nofile_raised = false;
rlimit g_nofile_given{};

// Not counting the one that lists them; -1 when they cannot be listed (listing takes a
// descriptor, which is what is missing).
int open_descriptors() {
  std::error_code ec;
  int n = -1;
  auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
  if (ec) return -1;
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) ++n;
  return ec ? -1 : n;
}

// Why a pipe or a fork failed, in words that say what to do.
std::string start_failure(const char* call, int err) {
  if (err == EMFILE) {
    rlimit lim{};
    ::getrlimit(RLIMIT_NOFILE, &lim);
    const int open = open_descriptors();
    const std::string count = open >= 0 ? std::to_string(open) + " open, limit " : "limit ";
    return std::string(call) + ": the launcher has no file descriptor left (EMFILE, too many " +
           "open files: " + count + std::to_string(lim.rlim_cur) +
           "); raise the limit (ulimit -n) or start fewer workers";
  }
  if (err == ENFILE) {
    return std::string(call) +
           ": the system's table of open files is full (ENFILE); close programs or raise "
           "fs.file-max";
  }
  if (err == EAGAIN && std::strcmp(call, "fork") == 0) {
    return "fork: no process can be created (EAGAIN: the user's process limit, ulimit -u, or the "
           "system's is reached)";
  }
  return std::string(call) + ": " + errno_text(err);
}

// Writes a message to fd 2 from the forked child, where only async-signal-safe calls are
// allowed.
void child_fail(const char* what, const char* path) {
  // errno as digits, with a name for the likely ones: strerror is not async-signal-safe.
  const int saved = errno;
  const char* name = saved == ENOENT    ? " (ENOENT: no such file)"
                     : saved == EACCES  ? " (EACCES: permission denied)"
                     : saved == ENOEXEC ? " (ENOEXEC: not an executable format)"
                     : saved == EMFILE  ? " (EMFILE: too many open files)"
                     : saved == ENOMEM  ? " (ENOMEM: out of memory)"
                     : saved == E2BIG   ? " (E2BIG: arguments and environment too long)"
                                        : "";
  char num[16];
  int err = saved, len = 0;
  char rev[16];
  do {
    rev[len++] = static_cast<char>('0' + err % 10);
    err /= 10;
  } while (err > 0 && len < 15);
  for (int i = 0; i < len; ++i) num[i] = rev[len - 1 - i];
  num[len] = '\0';
  const char* parts[] = {"lockstep run: cannot ", what, " ", path, ": errno ", num, name, "\n"};
  for (const char* p : parts) {
    ssize_t ignored = ::write(2, p, std::strlen(p));
    (void)ignored;
  }
  _exit(127);
}

}  // namespace

void raise_descriptor_limit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  g_nofile_given = lim;
  g_nofile_raised = true;
  if (lim.rlim_cur == lim.rlim_max) return;
  // The kernel refuses RLIM_INFINITY for descriptors: fs.nr_open is the real ceiling.
  rlimit want = lim;
  want.rlim_cur = lim.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &want) != 0 && lim.rlim_max == RLIM_INFINITY) {
    want.rlim_cur = 1 << 20;
    ::setrlimit(RLIMIT_NOFILE, &want);  // best effort: the old limit stays otherwise
  }
}

WorkerProcess::WorkerProcess(const WorkerSpec& spec) {
  int fds[2];
  LS_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "cannot start worker ", spec.program, ": ",
           start_failure("pipe2", errno));
  Fd out_read(fds[0]), out_write(fds[1]);
  LS_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "cannot start worker ", spec.program, ": ",
           start_failure("pipe2", errno));
  Fd err_read(fds[0]), err_write(fds[1]);
  // Everything the child needs is built before fork(): after it, only async-signal-safe calls.
  std::vector<char*> argv, envp;
  std::string program = spec.program;
  std::vector<std::string> args = spec.args, env = spec.env;
  argv.push_back(program.data());
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t parent = ::getpid();
  // Opened here, not in the child, so that running out of descriptors is said in words.
  Fd devnull(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  LS_CHECK(devnull.valid(), "cannot start worker ", spec.program, ": ",
           start_failure("open /dev/null", errno));

  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) _exit(127);  // the launcher died before prctl took effect
    if (::dup2(devnull.get(), 0) < 0 || ::dup2(out_write.get(), 1) < 0 ||
        ::dup2(err_write.get(), 2) < 0) {
      child_fail("set up the output of", argv[0]);
    }
    ::syscall(SYS_close_range, 3u, ~0u, 0u);  // the store's sockets, other workers' pipes
    if (g_nofile_raised) ::setrlimit(RLIMIT_NOFILE, &g_nofile_given);
    // The launcher blocks and ignores signals for its own loop; the program starts clean.
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGPIPE, SIG_DFL);
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::execve(argv[0], argv.data(), envp.data());
    child_fail("run", argv[0]);
  }
  LS_CHECK(pid >= 0, "cannot start worker ", spec.program, ": ", start_failure("fork", errno));
  // The write ends are the child's now (the Fds close the rest on the error path above).
  out_write.reset();
  err_write.reset();
  ::setpgid(pid, pid);  // also from here, so that signal_group() works before the child runs
  pid_ = pid;
  out_ = std::move(out_read);
  err_ = std::move(err_read);
  for (const Fd* fd : {&out_, &err_}) {
    ::fcntl(fd->get(), F_SETFL, ::fcntl(fd->get(), F_GETFL) | O_NONBLOCK);
  }
}

WorkerProcess::~WorkerProcess() {
  out_.reset();
  err_.reset();
  if (!status_ && pid_ > 0) {
    // Not reaped yet: the agent's shutdown path kills before it destroys, so this is a safety
    // net for error paths. Never leave a process behind.
    signal_group(SIGKILL);
    int st = 0;
    ::waitpid(pid_, &st, 0);
  }
}

bool WorkerProcess::drain(int fd, LineSplitter& splitter) {
  char buf[16384];
  // A bounded number of reads per call: a worker that prints without pause must not keep the
  // agent from its signals, its other workers and the store.
  for (int reads = 0; reads < kMaxReadsPerDrain; ++reads) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      splitter.feed(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    // End of file (or an error that ends the stream).
    splitter.finish();
    if (fd == out_.get()) out_.reset();
    if (fd == err_.get()) err_.reset();
    return false;
  }
  return true;
}

std::optional<ExitStatus> WorkerProcess::poll_exit() {
  if (status_) return status_;
  int st = 0;
  rusage ru{};
  const pid_t r = ::wait4(pid_, &st, WNOHANG, &ru);
  if (r != pid_) return std::nullopt;
  ExitStatus s;
  s.max_rss_kib = ru.ru_maxrss;  // Linux: KiB
  if (WIFSIGNALED(st)) {
    s.signaled = true;
    s.signal = WTERMSIG(st);
  } else {
    s.code = WEXITSTATUS(st);
  }
  status_ = s;
  // The worker is gone; its children (same process group) must not outlive it.
  ::kill(-pid_, SIGKILL);
  return status_;
}

void WorkerProcess::signal_group(int sig) {
  if (pid_ > 0) ::kill(-pid_, sig);
}

}  // namespace lockstep::launch
