// TCPStore: the client side of every request, and the server a TCPStore with is_server starts.
#include "lockstep/distributed/store/tcp_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include "distributed/store/kv_table.h"
#include "distributed/store/tcp_store_client.h"
#include "distributed/store/tcp_store_server.h"
#include "lockstep/base/env_var.h"

namespace lockstep::dist {

namespace detail {

namespace {
// A server answers a timed-out get()/wait() itself at its deadline; the client waits this much
// longer before it declares the server unresponsive and drops the connection.
constexpr std::chrono::milliseconds kReplyGrace{5000};
// Connections closed during the handshake before the client gives up, and the pause between.
constexpr int kHandshakeAttempts = 5;
constexpr std::chrono::milliseconds kHandshakeRetryPause{50};
}  // namespace

TCPStoreClient::TCPStoreClient(std::string host, uint16_t port, std::string token,
                               std::chrono::milliseconds timeout)
    : host_(std::move(host)), port_(port), token_(std::move(token)) {
  connect(timeout);
}

void TCPStoreClient::connect(std::chrono::milliseconds timeout) {
  LS_CHECK(token_.size() <= kMaxTokenBytes, "store token of ", token_.size(),
           " bytes: expected at most ", kMaxTokenBytes, " bytes (from ", env::kStoreToken,
           " or TCPStoreOptions::token)");
  ConnectAttempts attempts(where(), timeout);
  for (int closed = 0;; ++closed) {
    fd_ = connect_to(host_, port_, attempts);
    const auto hello = FrameWriter(static_cast<uint8_t>(Op::kHello))
                           .field(token_)
                           .field(int64_t{counted_ ? 0 : 1})
                           .finish();
    std::optional<Reply> r;
    try {
      LS_CHECK(send_all(fd_.get(), hello.data(), hello.size(), attempts.deadline()),
               "timed out sending the handshake");
      r = read_reply(attempts.deadline());
      LS_CHECK(r.has_value(), "no handshake reply within ", duration_text(timeout));
    } catch (const Error& e) {
      fd_.reset();
      // A server under a flood of connections may drop a new one before it reads its hello
      // (Note [Store under attack]): try again a few times. A server that speaks another
      // protocol version closes every attempt, and is reported after those.
      if (closed + 1 < kHandshakeAttempts && !attempts.expired()) {
        attempts.failed("the server closed the connection during the handshake: " + e.message());
        std::this_thread::sleep_for(kHandshakeRetryPause);
        continue;
      }
      LS_THROW("the store at ", where(),
               " closed the connection during the handshake (a server that wants a token, or one "
               "speaking another protocol version): ",
               e.message());
    }
    if (r->status == Status::kRejected) {
      fd_.reset();
      throw StoreTokenRejected(
          lockstep::detail::str_cat("store rejected the connection: bad or missing token (the "
                                    "store at ",
                                    where(), " wants the token it was started with, from ",
                                    env::kStoreToken, " or TCPStoreOptions::token)"),
          __FILE__, __LINE__);
    }
    if (r->status != Status::kOk) {
      fd_.reset();
      LS_THROW("the store at ", where(), " answered the handshake with an unexpected reply");
    }
    counted_ = true;
    return;
  }
}

std::optional<TCPStoreClient::Reply> TCPStoreClient::read_reply(Clock::time_point deadline) {
  uint8_t header[kHeaderBytes];
  if (!recv_exact(fd_.get(), header, kHeaderBytes, deadline)) return std::nullopt;
  auto h = parse_header(header);
  LS_CHECK(h && h->opcode >= static_cast<uint8_t>(Status::kOk) &&
               h->opcode <= static_cast<uint8_t>(Status::kRejected),
           "malformed reply header from the store at ", where(), " (expected protocol version ",
           int(kProtocolVersion), ")");
  std::vector<uint8_t> payload(h->length);
  if (!recv_exact(fd_.get(), payload.data(), payload.size(), deadline)) return std::nullopt;
  auto fields = parse_fields(payload.data(), payload.size());
  LS_CHECK(fields.has_value(), "malformed reply payload from the store at ", where());
  return Reply{static_cast<Status>(h->opcode), std::move(*fields)};
}

TCPStoreClient::Reply TCPStoreClient::request(const std::vector<uint8_t>& frame,
                                              std::chrono::milliseconds reply_within,
                                              std::chrono::milliseconds connect_within) {
  if (!fd_.valid()) connect(connect_within);
  const auto deadline = Clock::now() + reply_within + kReplyGrace;
  std::optional<Reply> r;
  try {
    LS_CHECK(send_all(fd_.get(), frame.data(), frame.size(), deadline),
             "timed out sending a request");
    r = read_reply(deadline);
  } catch (const Error& e) {
    fd_.reset();  // the stream is out of step now: the next request reconnects
    LS_THROW("lost the connection to the store at ", where(), ": ", e.message());
  }
  if (!r) {
    fd_.reset();
    LS_THROW("the store at ", where(), " did not reply within ",
             (reply_within + kReplyGrace).count(), " ms");
  }
  return std::move(*r);
}

}  // namespace detail

namespace {
using detail::FrameWriter;
using detail::Op;
using detail::Status;

FrameWriter request(Op op) { return FrameWriter(static_cast<uint8_t>(op)); }

std::string resolve_token(const TCPStoreOptions& opts) {
  if (opts.token) return *opts.token;
  return env_string(env::kStoreToken).value_or("");
}

std::string octal_mode(mode_t m) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(m & 07777));
  return buf;
}

int64_t field_i64(const detail::TCPStoreClient::Reply& r, size_t i, const std::string& where) {
  auto v = i < r.fields.size() ? detail::as_i64(r.fields[i]) : std::nullopt;
  LS_CHECK(v.has_value(), "malformed reply from the store at ", where);
  return *v;
}
}  // namespace

std::string read_store_token_file(const std::string& path, const std::string& what) {
  // O_NONBLOCK: a FIFO must not block the reader; it is refused below as not a regular file.
  const int raw_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (raw_fd < 0) LS_THROW(what, ": cannot open it: ", errno_text(errno));
  const Fd fd(raw_fd);
  struct stat st {};
  LS_SYSCHECK_MSG(::fstat(fd.get(), &st), "cannot stat ", path);
  if (!S_ISREG(st.st_mode)) LS_THROW(what, " is not a regular file");
  if (st.st_uid != ::geteuid()) {
    LS_THROW(what, " belongs to uid ", st.st_uid, ", not to the user running the job (uid ",
             ::geteuid(), "); the token must be a file of your own that only you can read");
  }
  if ((st.st_mode & 077) != 0) {
    LS_THROW(what, " has mode ", octal_mode(st.st_mode),
             ": other users can read or change the token; it must be readable only by its owner "
             "(chmod 600 ",
             path, ")");
  }
  std::string text(detail::kMaxTokenBytes + 2, '\0');
  size_t n = 0;
  for (;;) {
    const ssize_t r = ::read(fd.get(), text.data() + n, text.size() - n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) LS_THROW(what, ": cannot read it: ", errno_text(errno));
    if (r == 0 || (n += static_cast<size_t>(r)) == text.size()) break;
  }
  text.resize(n);
  const auto first = text.find_first_not_of(" \t\r\n");
  text = first == std::string::npos
             ? std::string()
             : text.substr(first, text.find_last_not_of(" \t\r\n") - first + 1);
  if (text.empty()) LS_THROW(what, " is empty; it must hold the job's secret");
  if (text.size() > detail::kMaxTokenBytes) {
    LS_THROW(what, " holds more than ", detail::kMaxTokenBytes,
             " bytes; a token is a short secret (is this the right file?)");
  }
  if (text.find('\0') != std::string::npos) {
    LS_THROW(what, " contains a NUL byte; a token is text (it reaches the workers in ",
             env::kStoreToken, ")");
  }
  return text;
}

std::string store_token_from_env(
    const std::function<std::optional<std::string>(const std::string&)>& lookup) {
  const auto token = lookup(env::kStoreToken);
  const auto file = lookup(env::kStoreTokenFile);
  const bool has_token = token && !token->empty(), has_file = file && !file->empty();
  LS_CHECK(!(has_token && has_file), env::kStoreToken, " and ", env::kStoreTokenFile,
           " both give the store's token; set only one");
  if (has_file) {
    return read_store_token_file(*file, std::string(env::kStoreTokenFile) + "=" + *file);
  }
  return has_token ? *token : std::string();
}

TCPStore::TCPStore(TCPStoreOptions opts) : Store(opts.timeout), opts_(std::move(opts)) {
  LS_CHECK(!opts_.num_workers || *opts_.num_workers >= 1,
           "TCPStore: expected num_workers >= 1, got ", opts_.num_workers.value_or(0));
  const std::string token = resolve_token(opts_);
  if (opts_.is_server) {
    server_ = std::make_unique<detail::TCPStoreServer>(opts_.port, token, opts_.server);
    port_ = server_->port();
  } else {
    LS_CHECK(opts_.port != 0, "TCPStore client for ", opts_.host,
             ": expected the server's port, got 0 (only a server may pick a free port)");
    port_ = opts_.port;
  }
  // The server's own store talks to it over loopback like every other client.
  // A server bound to one address is reached there.
  std::string connect_host = opts_.host;
  if (opts_.is_server) {
    const std::string& bound = opts_.server.bind_address;
    const bool wildcard = bound.empty() || bound == "0.0.0.0" || bound == "::";
    connect_host = wildcard ? "127.0.0.1" : bound;
  }
  client_ = std::make_unique<detail::TCPStoreClient>(connect_host, port_, token, timeout());
  if (opts_.is_server && opts_.num_workers && opts_.wait_for_workers) {
    const int64_t n =
        server_->wait_for_workers(*opts_.num_workers, detail::Clock::now() + timeout());
    LS_CHECK(n >= *opts_.num_workers, "store server on port ", port_, ": timed out after ",
             timeout().count(), " ms waiting for workers: ", n, " of ", *opts_.num_workers,
             " connected");
  }
}

TCPStore::~TCPStore() = default;

void TCPStore::do_set(const std::string& key, const Bytes& value) {
  auto frame = request(Op::kSet).field(key).field(value).finish();
  std::lock_guard<std::mutex> lock(mu_);
  auto r = client_->request(frame, timeout(), timeout());
  LS_CHECK(r.status == Status::kOk, "store set(\"", key, "\"): unexpected reply from ",
           client_->where());
}

Bytes TCPStore::do_get(const std::string& key) {
  const auto t = timeout();
  auto frame = request(Op::kGet).field(key).field(int64_t{t.count()}).finish();
  std::lock_guard<std::mutex> lock(mu_);
  auto r = client_->request(frame, t, t);
  LS_CHECK(r.status != Status::kTimeout, "store get(\"", key, "\") timed out after ", t.count(),
           " ms: the key was never set");
  LS_CHECK(r.status == Status::kOk && r.fields.size() == 1, "store get(\"", key,
           "\"): unexpected reply from ", client_->where());
  return Bytes(r.fields[0].begin(), r.fields[0].end());
}

int64_t TCPStore::do_add(const std::string& key, int64_t delta) {
  auto frame = request(Op::kAdd).field(key).field(delta).finish();
  std::lock_guard<std::mutex> lock(mu_);
  auto r = client_->request(frame, timeout(), timeout());
  if (r.status == Status::kError && r.fields.size() == 1) LS_THROW(r.fields[0]);
  LS_CHECK(r.status == Status::kOk, "store add(\"", key, "\"): unexpected reply from ",
           client_->where());
  return field_i64(r, 0, client_->where());
}

Bytes TCPStore::do_compare_set(const std::string& key, const Bytes& expected,
                               const Bytes& desired) {
  auto frame = request(Op::kCompareSet).field(key).field(expected).field(desired).finish();
  std::lock_guard<std::mutex> lock(mu_);
  auto r = client_->request(frame, timeout(), timeout());
  LS_CHECK(r.status == Status::kOk && r.fields.size() == 1, "store compare_set(\"", key,
           "\"): unexpected reply from ", client_->where());
  return Bytes(r.fields[0].begin(), r.fields[0].end());
}

bool TCPStore::do_check(const std::vector<std::string>& keys) {
  auto w = request(Op::kCheck);
  for (const auto& k : keys) w.field(k);
  auto frame = std::move(w).finish();
  std::lock_guard<std::mutex> lock(mu_);
  auto r = client_->request(frame, timeout(), timeout());
  LS_CHECK(r.status == Status::kOk, "store check: unexpected reply from ", client_->where());
  return field_i64(r, 0, client_->where()) != 0;
}

void TCPStore::do_wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  auto w = request(Op::kWait).field(int64_t{timeout.count()});
  for (const auto& k : keys) w.field(k);
  auto frame = std::move(w).finish();
  std::lock_guard<std::mutex> lock(mu_);
  auto r = client_->request(frame, timeout, this->timeout());
  LS_CHECK(r.status != Status::kTimeout, "store wait timed out after ", timeout.count(),
           " ms; keys still missing: ", detail::join_keys(r.fields));
  LS_CHECK(r.status == Status::kOk, "store wait: unexpected reply from ", client_->where());
}

bool TCPStore::do_delete_key(const std::string& key) {
  auto frame = request(Op::kDelete).field(key).finish();
  std::lock_guard<std::mutex> lock(mu_);
  auto r = client_->request(frame, timeout(), timeout());
  LS_CHECK(r.status == Status::kOk, "store delete_key(\"", key, "\"): unexpected reply from ",
           client_->where());
  return field_i64(r, 0, client_->where()) != 0;
}

int64_t TCPStore::do_num_keys() {
  auto frame = request(Op::kNumKeys).finish();
  std::lock_guard<std::mutex> lock(mu_);
  auto r = client_->request(frame, timeout(), timeout());
  LS_CHECK(r.status == Status::kOk, "store num_keys: unexpected reply from ", client_->where());
  return field_i64(r, 0, client_->where());
}

}  // namespace lockstep::dist
