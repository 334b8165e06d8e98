// The launcher's verdict over every rank's collective trace (Note [Verdict] in verdict.h).
#include "verdict.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <sstream>

namespace lockstep::launch {

using dist::TraceRecord;
using dist::TraceState;
using json = nlohmann::json;

std::string clock_text(int64_t ns) {
  const time_t secs = static_cast<time_t>(ns / 1'000'000'000);
  tm t{};
  gmtime_r(&secs, &t);
  char buf[16];
  std::strftime(buf, sizeof(buf), "%H:%M:%S", &t);
  return buf;
}

namespace {

std::string seconds_text(double s) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(s < 10 ? 1 : 0);
  o << s << " s";
  return o.str();
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  return s;
}

// The oldest collective issued and not finished: pending, or failed (gave up at its timeout).
const TraceRecord* stuck_record(const dist::TraceSnapshot& t) {
  for (const auto& r : t.records) {
    if (r.state == TraceState::queued || r.state == TraceState::started ||
        r.state == TraceState::failed) {
      return &r;
    }
  }
  return nullptr;
}

const TraceRecord* last_finished(const dist::TraceSnapshot& t) {
  for (auto it = t.records.rbegin(); it != t.records.rend(); ++it) {
    if (it->state == TraceState::finished) return &*it;
  }
  return nullptr;
}

// "it is stopped (state T) since 12:00:01", "it exited (killed by SIGKILL) at 12:00:05", "".
std::string process_clause(const RankView& v) {
  if (v.process == "stopped") {
    return "it is stopped (" + v.process_detail + ")" +
           (v.process_since_ns ? " since " + clock_text(v.process_since_ns) : "");
  }
  if (v.process == "exited") {
    return "it exited (" + v.process_detail + ")" +
           (v.process_since_ns ? " at " + clock_text(v.process_since_ns) : "");
  }
  return "";
}

}  // namespace

Verdict judge(const std::vector<RankView>& ranks, int64_t now_ns) {
  Verdict v;
  // The collective to explain: the oldest stuck one of any rank.
  const TraceRecord* k = nullptr;
  for (const auto& r : ranks) {
    if (!r.trace) continue;
    const TraceRecord* s = stuck_record(*r.trace);
    if (s != nullptr && (k == nullptr || s->seq < k->seq)) k = s;
  }
  std::vector<int> stopped, exited;
  for (const auto& r : ranks) {
    if (r.process == "stopped") stopped.push_back(r.rank);
    if (r.process == "exited") exited.push_back(r.rank);
  }
  if (k == nullptr) {
    if (!stopped.empty()) {
      const RankView& s = *std::find_if(ranks.begin(), ranks.end(),
                                        [&](const RankView& r) { return r.rank == stopped[0]; });
      v.line = "rank " + std::to_string(s.rank) + " is stopped (" + s.process_detail + ")" +
               (s.process_since_ns ? " since " + clock_text(s.process_since_ns) : "") +
               "; no rank waits in a collective";
      v.culprit = true;
    }
    return v;
  }
  v.seq = k->seq;
  // Who waits in #K, and for how long.
  std::vector<int> waiting, laggards, no_trace;
  double waited = 0;
  for (const auto& r : ranks) {
    if (!r.trace) {
      no_trace.push_back(r.rank);
      continue;
    }
    const TraceRecord* mine = r.trace->find(k->seq);
    if (mine != nullptr && mine->state != TraceState::finished) {
      waiting.push_back(r.rank);
      const int64_t until =
          mine->state == TraceState::failed && mine->finished_ns ? mine->finished_ns : now_ns;
      waited = std::max(waited, static_cast<double>(until - mine->issued_ns) / 1e9);
    } else if (r.trace->issued < k->seq) {
      laggards.push_back(r.rank);
    }
  }
  v.waited_s = std::max(0.0, waited);
  const std::string what = k->describe();
  const std::string waiters = waiting.empty() ? ""
                                              : "; " + rank_list(waiting) + " waited " +
                                                    seconds_text(v.waited_s) + " in " + what;
  auto view_of = [&](int rank) -> const RankView& {
    return *std::find_if(ranks.begin(), ranks.end(),
                         [&](const RankView& r) { return r.rank == rank; });
  };
  if (!laggards.empty()) {
    const RankView& l = view_of(laggards[0]);
    std::string since;
    if (const TraceRecord* f = last_finished(*l.trace)) {
      since = "it last finished " + f->describe() + " at " + clock_text(f->finished_ns);
    } else {
      since = "it finished no collective";
    }
    const std::string proc = process_clause(l);
    if (!proc.empty()) since += "; " + proc;
    const std::string who =
        laggards.size() == 1 ? "rank " + std::to_string(l.rank) : rank_list(laggards);
    v.line = who + " never issued " + what + " (" +
             (laggards.size() > 1 ? "rank " + std::to_string(l.rank) + ": " : "") + since + ")" +
             waiters;
    v.culprit = true;
    return v;
  }
  // Ranks that issued a different #K.
  for (const auto& r : ranks) {
    if (!r.trace) continue;
    const TraceRecord* mine = r.trace->find(k->seq);
    if (mine == nullptr || mine->same_call(*k)) continue;
    // k is the first rank's (lowest rank holding it in ranks' order); name both sides.
    int k_rank = -1;
    for (const auto& o : ranks) {
      if (o.trace && o.trace->find(k->seq) == k) k_rank = o.rank;
    }
    v.line = "the ranks disagree on collective #" + std::to_string(k->seq) + ": rank " +
             std::to_string(k_rank) + " issued " + what + ", rank " + std::to_string(r.rank) +
             " issued " + mine->describe() +
             "; every rank must issue the same collectives in the same order";
    v.culprit = true;
    return v;
  }
  if (!stopped.empty() || !exited.empty()) {
    const RankView& s = view_of(!stopped.empty() ? stopped[0] : exited[0]);
    const std::string proc = process_clause(s);
    v.line = "rank " + std::to_string(s.rank) + " " + proc.substr(3) + waiters;
    v.culprit = true;
    return v;
  }
  if (!no_trace.empty()) {
    const RankView& n = view_of(no_trace[0]);
    v.line = "rank " + std::to_string(n.rank) + " has no collective trace" +
             (n.no_trace.empty() ? "" : " (" + n.no_trace + ")") + waiters;
    return v;
  }
  v.line = "every rank issued " + what + " and it has not finished after " +
           seconds_text(v.waited_s) +
           ": the ranks are not held up by one of them, but by the transport (a lost or slow "
           "link between machines; the backend's own error names the peer)";
  return v;
}

std::vector<std::string> rank_details(const std::vector<RankView>& ranks, int64_t now_ns,
                                      int last_n) {
  std::vector<std::string> out;
  for (const auto& r : ranks) {
    std::ostringstream s;
    s << "rank " << r.rank << " (node " << r.node << ", host " << r.host;
    if (r.trace) s << ", pid " << r.trace->pid;
    s << "): " << r.process;
    if (!r.process_detail.empty()) s << " (" << r.process_detail << ")";
    if (!r.trace) {
      s << "; no trace" << (r.no_trace.empty() ? "" : " (" + r.no_trace + ")");
      out.push_back(s.str());
      continue;
    }
    s << "; issued " << r.trace->issued << ", finished " << r.trace->finished;
    if (r.trace->wait_seq != 0) {
      s << ", blocked in wait() on #" << r.trace->wait_seq << " for "
        << seconds_text(static_cast<double>(now_ns - r.trace->wait_since_ns) / 1e9);
    }
    const auto& recs = r.trace->records;
    const size_t from = recs.size() > static_cast<size_t>(last_n) ? recs.size() - last_n : 0;
    for (size_t i = from; i < recs.size(); ++i) {
      const TraceRecord& t = recs[i];
      s << (i == from ? "; last: " : ", ") << t.describe() << " " << trace_state_name(t.state);
      if (t.state == TraceState::finished || t.state == TraceState::failed) {
        s << " at " << clock_text(t.finished_ns);
      } else {
        s << " since " << clock_text(t.issued_ns);
      }
    }
    out.push_back(s.str());
  }
  return out;
}

json to_json(const RankView& v) {
  json j = {{"rank", v.rank},
            {"node", v.node},
            {"host", v.host},
            {"process", v.process},
            {"detail", v.process_detail},
            {"since", v.process_since_ns}};
  if (!v.trace) {
    j["no_trace"] = v.no_trace;
    return j;
  }
  const auto& t = *v.trace;
  json recs = json::array();
  // The newest few are what a verdict reads; the whole ring stays in the worker's file.
  constexpr size_t kKept = 16;
  const size_t from = t.records.size() > kKept ? t.records.size() - kKept : 0;
  for (size_t i = from; i < t.records.size(); ++i) {
    const auto& r = t.records[i];
    recs.push_back({r.seq, r.kind, r.dtype, r.op, r.root, r.numel, static_cast<int>(r.state),
                    r.issued_ns, r.started_ns, r.finished_ns});
  }
  j["trace"] = {{"rank", t.rank},         {"size", t.size},
                {"pid", t.pid},           {"backend", t.backend},
                {"issued", t.issued},     {"finished", t.finished},
                {"wait_seq", t.wait_seq}, {"wait_since", t.wait_since_ns},
                {"records", recs}};
  return j;
}

RankView rank_view_from_json(const json& j) {
  RankView v;
  v.rank = j.value("rank", -1);
  v.node = j.value("node", -1);
  v.host = j.value("host", std::string());
  v.process = j.value("process", std::string("unknown"));
  v.process_detail = j.value("detail", std::string());
  v.process_since_ns = j.value("since", int64_t{0});
  v.no_trace = j.value("no_trace", std::string());
  if (!j.contains("trace")) return v;
  const json& t = j["trace"];
  dist::TraceSnapshot s;
  s.rank = t.value("rank", -1);
  s.size = t.value("size", 0);
  s.pid = t.value("pid", 0);
  s.backend = t.value("backend", std::string());
  s.issued = t.value("issued", int64_t{0});
  s.finished = t.value("finished", int64_t{0});
  s.wait_seq = t.value("wait_seq", int64_t{0});
  s.wait_since_ns = t.value("wait_since", int64_t{0});
  for (const auto& r : t.value("records", json::array())) {
    TraceRecord rec;
    rec.seq = r.at(0);
    rec.kind = r.at(1);
    rec.dtype = r.at(2);
    rec.op = r.at(3);
    rec.root = r.at(4);
    rec.numel = r.at(5);
    const int state = r.at(6);
    rec.state = static_cast<TraceState>(std::clamp(state, 0, 4));
    rec.issued_ns = r.at(7);
    rec.started_ns = r.at(8);
    rec.finished_ns = r.at(9);
    s.records.push_back(rec);
  }
  v.trace = std::move(s);
  return v;
}

}  // namespace lockstep::launch
