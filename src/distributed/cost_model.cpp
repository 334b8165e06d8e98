#include "lockstep/distributed/cost_model.h"

#include <algorithm>
#include <cmath>

#include "lockstep/base/env_var.h"
#include "lockstep/base/error.h"
#include "lockstep/base/worker_env.h"

namespace lockstep::dist {

// Note [Cost model]
// A collective's time is a number of message rounds, each costing alpha (latency plus the fixed
// work of a step: a header, a wake-up), plus the bytes the busiest link carries, each costing
// beta (Hockney's model, as NCCL's tuner and MPI's collective selection use it). With n ranks and
// N bytes:
//   whole             2 alpha + (n - 1) N beta       every rank sends N to each of n - 1 peers
//                                                    (one round for the signature check of
//                                                    Note [Gloo signature check], one for data)
//   direct            3 alpha + 2 (n - 1) / n N beta reduce-scatter to chunk owners, all-gather
//                                                    (signature, two data rounds; with 2 ranks it
//                                                    is whole: the same bytes, one round less)
//   ring              2 (n - 1) alpha + 2 (n - 1) / n N beta
//   halving-doubling  2 log2(n) alpha + 2 (n - 1) / n N beta, and for n not a power of two a fold
//                     of the extra ranks first and an unfold last: 2 alpha + 2 N beta more (each
//                     extra rank sends its whole vector to a partner and receives the whole
//                     result back, as Rabenseifner's and Thakur's algorithm does)
//   hier              shared memory inside a machine (reduce-scatter and all-gather: 2 alpha_shm
//                     + 2 (L - 1) / L N beta_shm), then the network between M machines on N / L
//                     per rank, the machine's L ranks sharing its link (beta_net x L)
// Direct and ring move the same bytes (bandwidth-optimal); they differ in rounds, so direct wins
// at every size where alpha is not negligible; whole wins for small tensors, where rounds dominate.
// The gloo backend adds in rank order (Note [Gloo rank-order reduction]), which only whole and
// direct do, so it chooses between those two per call (LOCKSTEP_ALLREDUCE_ALGO forces one); both
// give the same bits. What the model leaves out: the pipeline's tail (the last piece's all-gather
// after its reduction), TCP's headers (about 4.5% at a 1500-byte MTU), and CPU contention, which
// shows up as a larger alpha. bench/net_allreduce fits alpha and beta to measurements and prints
// the model's error at every size (docs/PERFORMANCE.md).

namespace {

// t = rounds x alpha + bytes_factor x N x beta.
struct Terms {
  double rounds = 0;
  double bytes_factor = 0;
};

Terms terms(AllReduceAlgorithm a, int n) {
  if (n <= 1) return {};
  const double bw_optimal = 2.0 * (n - 1) / n;
  switch (a) {
    case AllReduceAlgorithm::kWhole:
      return {2, static_cast<double>(n - 1)};
    case AllReduceAlgorithm::kDirect:
      if (n == 2) return {2, 1};
      return {3, bw_optimal};
    case AllReduceAlgorithm::kRing:
      return {2.0 * (n - 1), bw_optimal};
    case AllReduceAlgorithm::kHalvingDoubling: {
      const int p = 1 << static_cast<int>(std::floor(std::log2(n)));
      Terms t{2.0 * std::log2(p), 2.0 * (p - 1) / p};
      if (p != n) {
        t.rounds += 2;        // the fold and the unfold
        t.bytes_factor += 2;  // N to the partner, N back
      }
      return t;
    }
  }
  return {};
}

}  // namespace

std::string_view algorithm_name(AllReduceAlgorithm a) {
  switch (a) {
    case AllReduceAlgorithm::kWhole:
      return "whole";
    case AllReduceAlgorithm::kDirect:
      return "direct";
    case AllReduceAlgorithm::kRing:
      return "ring";
    case AllReduceAlgorithm::kHalvingDoubling:
      return "halving-doubling";
  }
  return "?";
}

double predict_all_reduce(AllReduceAlgorithm a, int64_t bytes, int ranks, const LinkModel& link) {
  if (ranks <= 1 || bytes <= 0) return 0;
  const Terms t = terms(a, ranks);
  return t.rounds * link.alpha + t.bytes_factor * static_cast<double>(bytes) * link.beta;
}

double predict_hier_all_reduce(int64_t bytes, int machines, int local, const LinkModel& shm,
                               const LinkModel& net) {
  if (bytes <= 0 || machines * local <= 1) return 0;
  double t = 0;
  if (local > 1) {
    t += 2 * shm.alpha + 2.0 * (local - 1) / local * static_cast<double>(bytes) * shm.beta;
  }
  if (machines > 1) {
    const LinkModel shared{net.alpha, net.beta * local};
    const int64_t per_rank = (bytes + local - 1) / local;
    const AllReduceAlgorithm a = choose_all_reduce(per_rank, machines, shared);
    t += predict_all_reduce(a, per_rank, machines, shared);
  }
  return t;
}

AllReduceAlgorithm gloo_all_reduce_algorithm(int64_t bytes, int ranks, const LinkModel& link,
                                             AlgorithmSetting setting) {
  if (ranks == 2) return AllReduceAlgorithm::kWhole;
  switch (setting) {
    case AlgorithmSetting::kWhole:
      return AllReduceAlgorithm::kWhole;
    case AlgorithmSetting::kDirect:
      return AllReduceAlgorithm::kDirect;
    case AlgorithmSetting::kAuto:
      break;
  }
  return choose_all_reduce(bytes, ranks, link);
}

AllReduceAlgorithm choose_all_reduce(int64_t bytes, int ranks, const LinkModel& link,
                                     bool rank_order) {
  std::vector<AllReduceAlgorithm> candidates = {AllReduceAlgorithm::kWhole,
                                                AllReduceAlgorithm::kDirect};
  if (!rank_order) {
    candidates.push_back(AllReduceAlgorithm::kRing);
    candidates.push_back(AllReduceAlgorithm::kHalvingDoubling);
  }
  AllReduceAlgorithm best = candidates.front();
  double best_s = predict_all_reduce(best, bytes, ranks, link);
  for (AllReduceAlgorithm a : candidates) {
    const double s = predict_all_reduce(a, bytes, ranks, link);
    if (s < best_s) {
      best = a;
      best_s = s;
    }
  }
  return best;
}

int64_t bucket_bytes_for(const LinkModel& link, int ranks, double overhead) {
  LS_CHECK(overhead > 0 && overhead < 1, "bucket_bytes_for: overhead must be in (0, 1), got ",
           overhead);
  constexpr int64_t kMiB = int64_t{1} << 20;
  if (ranks <= 1 || link.beta <= 0) return kMiB;
  // rounds alpha <= overhead x (rounds alpha + factor N beta)
  const Terms t = terms(AllReduceAlgorithm::kDirect, ranks);
  const double n = t.rounds * link.alpha * (1 - overhead) / (overhead * t.bytes_factor * link.beta);
  const auto mib = static_cast<int64_t>(std::ceil(n / static_cast<double>(kMiB)));
  return std::max<int64_t>(1, mib) * kMiB;
}

LinkModel fit_link(int ranks, const std::vector<LinkSample>& samples) {
  LS_CHECK(ranks >= 2, "fit_link: needs at least 2 ranks, got ", ranks);
  // Weighted least squares on t_i = r_i alpha + f_i N_i beta with weights 1 / t_i^2.
  double saa = 0, sab = 0, sbb = 0, sat = 0, sbt = 0;
  std::vector<int64_t> sizes;
  for (const LinkSample& s : samples) {
    LS_CHECK(s.bytes > 0 && s.seconds > 0, "fit_link: a sample of ", s.bytes, " bytes in ",
             s.seconds, " s; expected both above 0");
    const Terms t = terms(s.algorithm, ranks);
    const double w = 1 / (s.seconds * s.seconds);
    const double x = t.rounds, y = t.bytes_factor * static_cast<double>(s.bytes);
    saa += w * x * x;
    sab += w * x * y;
    sbb += w * y * y;
    sat += w * x * s.seconds;
    sbt += w * y * s.seconds;
    sizes.push_back(s.bytes);
  }
  std::sort(sizes.begin(), sizes.end());
  LS_CHECK(std::unique(sizes.begin(), sizes.end()) - sizes.begin() >= 2,
           "fit_link: needs samples of at least two sizes, got ", samples.size(), " samples");
  const double det = saa * sbb - sab * sab;
  LinkModel m{(sat * sbb - sab * sbt) / det, (saa * sbt - sab * sat) / det};
  if (m.alpha < 0) m = {0, sbt / sbb};
  if (m.beta < 0) m = {sat / saa, 0};
  return m;
}

LinkModel link_from_env() {
  LinkModel m;
  if (const auto us = env_double(env::kNetAlphaUs, 0.001, 1e7,
                                 {.unit = "microseconds", .note = "per message round"})) {
    m.alpha = *us * 1e-6;
  }
  if (const auto gbps =
          env_double(env::kNetGbps, 0.001, 1e5, {.unit = "Gbit/s", .note = "per rank"})) {
    m.beta = 8 / (*gbps * 1e9);
  }
  return m;
}

AlgorithmSetting algorithm_setting_from_env() {
  const auto v = env_string(env::kAllReduceAlgo);
  if (!v || *v == "auto") return AlgorithmSetting::kAuto;
  if (*v == "whole") return AlgorithmSetting::kWhole;
  if (*v == "direct") return AlgorithmSetting::kDirect;
  LS_THROW(env::kAllReduceAlgo, "='", *v, "' is not one of auto, whole, direct");
}

}  // namespace lockstep::dist
