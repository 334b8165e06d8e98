// What a collective costs on a network, as an alpha-beta model (Note [Cost model] in
// src/distributed/cost_model.cpp): the time of each all_reduce algorithm for a size, a world and
// a link, the algorithm the gloo backend picks from it, the link read from settings or fitted to
// measurements, and a bucket size worth its latency.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lockstep::dist {

// One rank's link: `alpha` seconds per message round (latency plus the fixed costs of a
// collective step: wake-ups, a header), `beta` seconds per byte sent through the rank's link
// (1 / bandwidth). Defaults: a 10 Gbit/s network with 50 us rounds.
struct LinkModel {
  double alpha = 50e-6;
  double beta = 0.8e-9;
};

enum class AllReduceAlgorithm {
  kWhole,            // every rank sends the whole tensor to every other rank (rank order, gloo)
  kDirect,           // reduce-scatter to each chunk's owner, then all-gather (rank order, gloo)
  kRing,             // Gloo's or NCCL's ring (not rank order)
  kHalvingDoubling,  // recursive halving, then doubling (not rank order)
};
std::string_view algorithm_name(AllReduceAlgorithm a);

// Seconds for one all_reduce of `bytes` over `ranks` ranks, each with `link`.
double predict_all_reduce(AllReduceAlgorithm a, int64_t bytes, int ranks, const LinkModel& link);

// The hier backend: `local` ranks on each of `machines` machines; shared memory inside a machine
// (`shm`), the network between machines (`net`, the machine's link, which its local ranks share).
double predict_hier_all_reduce(int64_t bytes, int machines, int local, const LinkModel& shm,
                               const LinkModel& net);

// The fastest algorithm for this size by the model; `rank_order` limits the choice to those that
// add in rank order (the gloo backend's, so that every backend and every chunking agree bitwise).
AllReduceAlgorithm choose_all_reduce(int64_t bytes, int ranks, const LinkModel& link,
                                     bool rank_order = true);

// LOCKSTEP_ALLREDUCE_ALGO: "auto" (unset: the model's choice), "whole" or "direct" (the gloo
// backend's rank-order algorithms). Anything else is an Error listing these.
enum class AlgorithmSetting { kAuto, kWhole, kDirect };
AlgorithmSetting algorithm_setting_from_env();

// The algorithm the gloo backend's all_reduce of `bytes` runs over `ranks` ranks: whole with two
// ranks (the same bytes as direct, one round less), else the one `setting` forces, else the
// model's rank-order choice for `link`. The backend and bench/net_allreduce both ask here.
AllReduceAlgorithm gloo_all_reduce_algorithm(int64_t bytes, int ranks, const LinkModel& link,
                                             AlgorithmSetting setting);

// The smallest bucket whose all_reduce spends at most `overhead` of its time on latency (direct
// algorithm), rounded up to a MiB: DDP's bucket cap that this link makes worth it.
int64_t bucket_bytes_for(const LinkModel& link, int ranks, double overhead = 0.05);

// One measured all_reduce: its size, its time and the algorithm that ran it.
struct LinkSample {
  int64_t bytes = 0;
  double seconds = 0;
  AllReduceAlgorithm algorithm = AllReduceAlgorithm::kDirect;
};
// Alpha and beta that fit measurements of one world size best, by relative error (a 4 KiB call
// weighs as much as a 64 MiB one). Needs two distinct sizes; a negative fit is clamped to 0.
LinkModel fit_link(int ranks, const std::vector<LinkSample>& samples);

// The network link from settings: LOCKSTEP_NET_ALPHA_US (microseconds, 0.001 to 1e7) and
// LOCKSTEP_NET_GBPS (Gbit/s per rank, 0.001 to 1e5), each defaulting to LinkModel's. Another value
// is an Error naming the variable, what it holds and what was expected (lockstep/base/env_var.h).
LinkModel link_from_env();

}  // namespace lockstep::dist
