// init: reading the environment (torchrun, SLURM, Open MPI, none), the join check that makes
// disagreeing ranks fail loudly, new_group, the default group and the local address choice.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <latch>
#include <map>
#include <sstream>
#include <thread>

#include "distributed/bind_address.h"
#include "lockstep/base/syscall.h"
#include "lockstep/distributed/gloo/process_group_gloo.h"
#include "lockstep/distributed/init.h"
#include "lockstep/distributed/store/hash_store.h"
#include "lockstep/distributed/store/tcp_store.h"
#include "lockstep/tensor/cuda.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::dist;
using lockstep::testing::expect_error;
using namespace std::chrono_literals;

namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

// Runs body(rank, together) on `world` threads and returns each rank's exception message ("" when
// it succeeded). A body calls together() last, while it still holds its groups: no rank closes
// its groups before every rank got there, since a peer that leaves while another still connects
// fails it ("Connection closed by peer"), as a dying rank should.
std::vector<std::string> on_threads(
    int world, const std::function<void(int, const std::function<void()>&)>& body) {
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::latch all_there(world);
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) {
    ts.emplace_back([&, r] {
      bool arrived = false;
      try {
        body(r, [&] {
          arrived = true;
          all_there.arrive_and_wait();
        });
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
      if (!arrived) all_there.count_down();
    });
  }
  for (auto& t : ts) t.join();
  return errors;
}

TEST(ReadDistEnv, NothingSetIsAWorldOfOne) {
  DistEnv e = read_dist_env(env_of({}));
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_EQ(e.source, "none");
}

TEST(ReadDistEnv, TorchrunVariables) {
  DistEnv e = read_dist_env(env_of({{"RANK", "5"},
                                    {"WORLD_SIZE", "8"},
                                    {"LOCAL_RANK", "1"},
                                    {"LOCAL_WORLD_SIZE", "4"},
                                    {"GROUP_RANK", "1"},
                                    {"MASTER_ADDR", "10.0.0.7"},
                                    {"MASTER_PORT", "29600"},
                                    {"LOCKSTEP_RESTART_COUNT", "2"},
                                    {"LOCKSTEP_RUN_ID", "job42"},
                                    {"LOCKSTEP_USE_AGENT_STORE", "1"}}));
  EXPECT_EQ(e.source, "RANK/WORLD_SIZE");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.group_rank, 1);
  EXPECT_EQ(e.master_addr, "10.0.0.7");
  EXPECT_EQ(e.master_port, 29600);
  EXPECT_EQ(e.restart_count, 2);
  EXPECT_EQ(e.run_id, "job42");
  EXPECT_TRUE(e.agent_store);
}

TEST(ReadDistEnv, MissingLocalVariablesMeanOneMachine) {
  DistEnv e = read_dist_env(env_of({{"RANK", "2"}, {"WORLD_SIZE", "3"}}));
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world_size, 3);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_FALSE(e.agent_store);
}

TEST(ReadDistEnv, InconsistentValuesNameTheVariables) {
  expect_error(
      [] {
        read_dist_env(env_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}));
      },
      {"rank 4 must be < world size 4"});
  expect_error(
      [] {
        read_dist_env(env_of({{"RANK", "1"}}));
      },
      {"RANK is set but WORLD_SIZE is not"});
  expect_error(
      [] {
        read_dist_env(env_of({{"WORLD_SIZE", "2"}}));
      },
      {"WORLD_SIZE is set but RANK is not"});
  expect_error(
      [] {
        read_dist_env(env_of({{"RANK", "one"}, {"WORLD_SIZE", "2"}}));
      },
      {"RANK='one' is not an integer"});
  expect_error(
      [] {
        read_dist_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}}));
      },
      {"WORLD_SIZE=0 is out of range"});
  expect_error(
      [] {
        read_dist_env(env_of({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}));
      },
      {"RANK=-1 is out of range"});
  expect_error(
      [] {
        read_dist_env(env_of(
            {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}));
      },
      {"local rank 2 must be < local world size 2"});
  expect_error(
      [] {
        read_dist_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}}));
      },
      {"MASTER_ADDR is not set", "several machines", "world size 8, 4 per machine"});
  expect_error(
      [] {
        read_dist_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}));
      },
      {"MASTER_PORT=70000 is out of range"});
}

TEST(ReadDistEnv, SlurmVariables) {
  DistEnv e = read_dist_env(env_of({{"SLURM_PROCID", "6"},
                                    {"SLURM_NTASKS", "8"},
                                    {"SLURM_LOCALID", "2"},
                                    {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                    {"SLURM_NODEID", "1"},
                                    {"SLURM_NODELIST", "gpu[07-08]"},
                                    {"SLURM_JOB_ID", "123456"}}));
  EXPECT_EQ(e.source, "SLURM");
  EXPECT_EQ(e.rank, 6);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.group_rank, 1);
  EXPECT_EQ(e.master_addr, "gpu07");
  EXPECT_EQ(e.master_port, 20000 + 123456 % 20000);
  // Explicit MASTER_* and torchrun's variables win.
  DistEnv t = read_dist_env(env_of({{"SLURM_PROCID", "6"},
                                    {"SLURM_NTASKS", "8"},
                                    {"RANK", "1"},
                                    {"WORLD_SIZE", "2"},
                                    {"MASTER_ADDR", "h"},
                                    {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(t.source, "RANK/WORLD_SIZE");
  EXPECT_EQ(t.rank, 1);
  EXPECT_EQ(t.master_addr, "h");
  EXPECT_EQ(t.master_port, 1234);
}

TEST(ReadDistEnv, OpenMpiVariables) {
  DistEnv e = read_dist_env(env_of({{"OMPI_COMM_WORLD_RANK", "3"},
                                    {"OMPI_COMM_WORLD_SIZE", "4"},
                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  EXPECT_EQ(e.source, "Open MPI");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 3);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  expect_error(
      [] {
        read_dist_env(env_of({{"OMPI_COMM_WORLD_RANK", "3"},
                              {"OMPI_COMM_WORLD_SIZE", "8"},
                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
      },
      {"MASTER_ADDR is not set", "Open MPI"});
}

TEST(ReadDistEnv, SocketInterfaceOverride) {
  EXPECT_EQ(read_dist_env(env_of({{"LOCKSTEP_SOCKET_IFNAME", "eth1"}})).socket_ifname, "eth1");
  EXPECT_EQ(read_dist_env(env_of({{"GLOO_SOCKET_IFNAME", "ib0"}})).socket_ifname, "ib0");
  EXPECT_EQ(read_dist_env(env_of({{"GLOO_SOCKET_IFNAME", "ib0"}, {"LOCKSTEP_SOCKET_IFNAME", "e"}}))
                .socket_ifname,
            "e");
}

TEST(ReadDistEnv, RendezvousTimeoutIsInSecondsAndChecked) {
  EXPECT_EQ(read_dist_env(env_of({})).rendezvous_timeout, std::nullopt);
  EXPECT_EQ(read_dist_env(env_of({{"LOCKSTEP_RENDEZVOUS_TIMEOUT", "2.5"}})).rendezvous_timeout,
            2500ms);
  EXPECT_EQ(read_dist_env(env_of({{"LOCKSTEP_RENDEZVOUS_TIMEOUT", "300"}})).rendezvous_timeout,
            300s);
  for (const char* bad : {"abc", "5s", "nan", "inf", " 5"}) {
    expect_error(
        [&] {
          read_dist_env(env_of({{"LOCKSTEP_RENDEZVOUS_TIMEOUT", bad}}));
        },
        {std::string("LOCKSTEP_RENDEZVOUS_TIMEOUT='") + bad + "' is not a number of seconds"});
  }
  for (const char* bad : {"0", "-5", "1e9"}) {
    expect_error(
        [&] {
          read_dist_env(env_of({{"LOCKSTEP_RENDEZVOUS_TIMEOUT", bad}}));
        },
        {std::string("LOCKSTEP_RENDEZVOUS_TIMEOUT=") + bad + " is out of range", "seconds"});
  }
}

TEST(ReadDistEnv, CollectiveTimeoutIsInSecondsAndChecked) {
  EXPECT_EQ(read_dist_env(env_of({})).timeout, std::nullopt);
  EXPECT_EQ(read_dist_env(env_of({{"LOCKSTEP_TIMEOUT", "1.5"}})).timeout, 1500ms);
  EXPECT_EQ(read_dist_env(env_of({{"LOCKSTEP_TIMEOUT", "600"}})).timeout, 600s);
  for (const char* bad : {"abc", "30s", "nan"}) {
    expect_error(
        [&] {
          read_dist_env(env_of({{"LOCKSTEP_TIMEOUT", bad}}));
        },
        {std::string("LOCKSTEP_TIMEOUT='") + bad + "' is not a number of seconds"});
  }
  for (const char* bad : {"0", "-1", "1e9"}) {
    expect_error(
        [&] {
          read_dist_env(env_of({{"LOCKSTEP_TIMEOUT", bad}}));
        },
        {std::string("LOCKSTEP_TIMEOUT=") + bad + " is out of range", "604800 seconds"});
  }
}

TEST(ConnectWorld, CollectiveTimeoutIsTheOptionsThenLockstepTimeoutThenTheDefault) {
  // A world of one keeps the timeout it was given, so the order shows without any peer.
  DistEnv env = read_dist_env(env_of({{"LOCKSTEP_TIMEOUT", "2"}}));
  EXPECT_EQ(connect_world(env).group->timeout(), 2s);
  InitOptions o;
  o.timeout = 7s;
  EXPECT_EQ(connect_world(env, o).group->timeout(), 7s);
  EXPECT_EQ(connect_world(read_dist_env(env_of({}))).group->timeout(), kDefaultCollectiveTimeout);
}

TEST(ConnectWorld, BackendIsTheOptionsThenLockstepBackendThenAuto) {
  const DistEnv shm_env = read_dist_env(env_of({{"LOCKSTEP_BACKEND", "shm"}}));
  EXPECT_EQ(shm_env.backend, "shm");
  EXPECT_EQ(read_dist_env(env_of({})).backend, "");
  EXPECT_EQ(connect_world(shm_env).backend, "shm");
  EXPECT_EQ(connect_world(DistEnv{}).backend, "auto");
  InitOptions o;
  o.backend = "gloo";
  EXPECT_EQ(connect_world(shm_env, o).backend, "gloo");

  // Two ranks whose environment says shm get a shared-memory group.
  auto store = std::make_shared<HashStore>(30s);
  std::vector<std::string> errors(2), backends(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      try {
        DistEnv env = read_dist_env(env_of({{"RANK", std::to_string(r)},
                                            {"WORLD_SIZE", "2"},
                                            {"MASTER_ADDR", "127.0.0.1"},
                                            {"LOCKSTEP_BACKEND", "shm"}}));
        InitOptions io;
        io.store = store;
        io.timeout = 30s;
        World w = connect_world(env, io);
        backends[r] = w.group->backend();
        w.group->barrier()->wait();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(backends[r], "shm") << "rank " << r;
  }
}

TEST(ConnectWorld, UnknownBackendFromTheEnvironmentListsTheRegisteredOnes) {
  const DistEnv env = read_dist_env(env_of({{"LOCKSTEP_BACKEND", "ucc"}}));
  expect_error([&] { connect_world(env); },
               {"unknown backend 'ucc' (from LOCKSTEP_BACKEND)", "expected one of", "gloo", "shm"});
  InitOptions o;
  o.backend = "mpi";
  expect_error([&] { connect_world(DistEnv{}, o); },
               {"unknown backend 'mpi' (from InitOptions::backend)", "gloo", "shm"});
}

// "nccl" is a backend of CUDA builds; elsewhere asking for it says why it is missing rather than
// calling it unknown, and with CUDA but no GPU init refuses it before anything connects.
TEST(ConnectWorld, NcclIsRegisteredInCudaBuildsAndExplainedElsewhere) {
  EXPECT_EQ(has_backend("nccl"), cuda::compiled_with_cuda());
  const DistEnv env = read_dist_env(env_of({{"LOCKSTEP_BACKEND", "nccl"}}));
  if (!cuda::compiled_with_cuda()) {
    expect_error([&] { connect_world(env); },
                 {"backend 'nccl' (from LOCKSTEP_BACKEND) is not available", "no CUDA support",
                  "-DLOCKSTEP_CUDA", "gloo"});
    BackendConfig c;
    c.store = std::make_shared<HashStore>(30s);
    c.size = 2;
    expect_error([&] { create_process_group("nccl", c); },
                 {"backend 'nccl' is not available", "no CUDA support"});
  } else if (!cuda::is_available()) {
    expect_error([&] { connect_world(env); },
                 {"init_process_group", "nccl backend needs a CUDA GPU", "gloo"});
  } else {
    EXPECT_EQ(connect_world(env).backend, "nccl");  // a world of one on cuda:0
    EXPECT_EQ(cuda::current_device(), 0);
  }
}

// Note [A GPU per rank] in src/distributed/init.cpp: the binding and the refusals as numbers.
TEST(ChooseDevice, CudaLocalRankWhereGpusExistNoneWithout) {
  EXPECT_EQ(choose_device("gloo", 0, 1, 0).device, -1);
  EXPECT_EQ(choose_device("gloo", 0, 1, 0).error, "");
  EXPECT_EQ(choose_device("nccl", 3, 8, 8).device, 3);
  EXPECT_EQ(choose_device("nccl", 3, 8, 8).error, "");
  EXPECT_EQ(choose_device("gloo", 7, 8, 8).device, 7);
  // CPU backends share GPUs round-robin (their cuda tensors are staged through host memory):
  // two ranks on one GPU is how DDP on CUDA is tested on a machine with one GPU.
  EXPECT_EQ(choose_device("gloo", 1, 2, 1).device, 0);
  EXPECT_EQ(choose_device("shm", 5, 8, 4).device, 1);
  EXPECT_EQ(choose_device("gloo", 5, 8, 4).error, "");
}

TEST(ChooseDevice, NcclRefusesSharedGpusAndNoGpuSayingWhatToDo) {
  const DeviceChoice none = choose_device("nccl", 0, 1, 0);
  EXPECT_EQ(none.device, -1);
  EXPECT_THAT(none.error, ::testing::HasSubstr("nccl backend needs a CUDA GPU per rank"));
  EXPECT_THAT(none.error, ::testing::HasSubstr("gloo"));
  const DeviceChoice shared = choose_device("nccl", 1, 2, 1);
  EXPECT_EQ(shared.device, -1);
  for (const char* part : {"LOCAL_WORLD_SIZE=2 ranks on this machine, but 1 GPU is visible",
                           "share one GPU", "--nproc-per-node gpu", "gloo"}) {
    EXPECT_THAT(shared.error, ::testing::HasSubstr(part));
  }
  EXPECT_THAT(choose_device("nccl", 0, 8, 4).error, ::testing::HasSubstr("4 GPUs are visible"));
  EXPECT_EQ(choose_device("nccl", 3, 4, 4).error, "");  // as many ranks as GPUs
}

// A rank whose rank 0 never comes (nothing listens at MASTER_ADDR:MASTER_PORT), or whose
// MASTER_ADDR does not resolve, fails at the rendezvous timeout saying so, not at the
// collectives' 30 minutes.
TEST(ConnectWorld, ARankThatCannotReachTheStoreFailsAtTheRendezvousTimeoutNamingTheCause) {
  uint16_t port = 0;
  {
    TCPStoreOptions so;
    so.port = 0;
    so.is_server = true;
    so.token = "";
    port = TCPStore(so).port();  // free a moment ago
  }
  DistEnv env;
  env.rank = 1;
  env.world_size = 2;
  env.local_rank = 1;
  env.local_world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  env.rendezvous_timeout = 1500ms;  // as LOCKSTEP_RENDEZVOUS_TIMEOUT=1.5 sets it
  InitOptions o;
  o.timeout = 60s;
  const std::string where = "127.0.0.1:" + std::to_string(port);
  expect_error(
      [&] { connect_world(env, o); },
      {"rank 1 of 2 cannot reach rank 0's rendezvous store at MASTER_ADDR:MASTER_PORT = " + where,
       "within 1.5 s", "last cause: connection refused", "LOCKSTEP_RENDEZVOUS_TIMEOUT"});
  o.rendezvous_timeout = 700ms;  // the option wins over the environment
  expect_error([&] { connect_world(env, o); }, {"within 700 ms"});
  env.master_addr = "garbage..host";
  expect_error([&] { connect_world(env, o); },
               {"garbage..host:" + std::to_string(port), "last cause: name", "getaddrinfo"});
}

// Runs connect_world for several (rank, world_size) claims as threads over one HashStore.
// `backends`, when given, is each claim's InitOptions::backend.
std::vector<std::string> join_threads(const std::vector<std::pair<int, int>>& claims,
                                      std::chrono::milliseconds timeout = 30s,
                                      const std::vector<std::string>& backends = {}) {
  auto store = std::make_shared<HashStore>(30s);
  std::vector<std::string> errors(claims.size());
  std::vector<std::thread> ts;
  for (size_t i = 0; i < claims.size(); ++i) {
    ts.emplace_back([&, i] {
      try {
        InitOptions o;
        o.store = store;
        o.rank = claims[i].first;
        o.world_size = claims[i].second;
        o.timeout = timeout;
        if (!backends.empty()) o.backend = backends[i];
        World w = connect_world(DistEnv{}, o);
        w.group->barrier()->wait();
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  return errors;
}

TEST(ConnectWorld, RanksThatAgreeFormAWorld) {
  for (const auto& e : join_threads({{0, 3}, {1, 3}, {2, 3}})) EXPECT_EQ(e, "");
}

TEST(ConnectWorld, TwoProcessesClaimingOneRankFailBoth) {
  const auto errors = join_threads({{0, 2}, {0, 2}});
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("rank 0 is claimed by two processes"));
    EXPECT_THAT(e, ::testing::HasSubstr("every process needs its own RANK"));
  }
}

TEST(ConnectWorld, DifferentWorldSizesFailEveryRank) {
  const auto errors = join_threads({{0, 2}, {1, 3}});
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("ranks disagree on the world size"));
  }
}

// shm on one rank and gloo on the other: each would wait for a peer that connects elsewhere
// until the timeout; the join check stops both at once, naming both backends.
TEST(ConnectWorld, DifferentBackendsFailEveryRankAtOnce) {
  const auto errors = join_threads({{0, 2}, {1, 2}}, 30s, {"shm", "gloo"});
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("ranks disagree on the backend"));
    EXPECT_THAT(e, ::testing::HasSubstr("'shm'"));
    EXPECT_THAT(e, ::testing::HasSubstr("'gloo'"));
    EXPECT_THAT(e, ::testing::HasSubstr("LOCKSTEP_BACKEND"));
  }
}

TEST(ConnectWorld, AMissingRankIsNamedAtTheTimeout) {
  const auto errors = join_threads({{0, 3}, {2, 3}}, 300ms);
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("only 2 of 3 ranks joined within 300 ms"));
    EXPECT_THAT(e, ::testing::HasSubstr("missing rank(s): 1"));
  }
}

TEST(ConnectWorld, UnknownInterfaceListsTheMachinesInterfaces) {
  DistEnv env;
  env.socket_ifname = "nosuch0";
  InitOptions o;
  o.store = std::make_shared<HashStore>(30s);
  expect_error([&] { connect_world(env, o); }, {"nosuch0: no such network interface", "lo"});
  o.backend = "nope";
  expect_error([&] { connect_world(DistEnv{}, o); }, {"unknown backend 'nope'"});
}

TEST(ConnectWorld, InterfaceOrAddressOverrideIsUsed) {
  auto store = std::make_shared<HashStore>(30s);
  std::vector<std::thread> ts;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      try {
        DistEnv env;
        env.socket_ifname = r == 0 ? "lo" : "127.0.0.1";
        InitOptions o;
        o.store = store;
        o.rank = r;
        o.world_size = 2;
        World w = connect_world(env, o);
        LS_CHECK(r == 0 ? w.bind_interface == "lo" : w.bind_address == "127.0.0.1", "binding");
        Tensor x = full({3}, 1.0);
        w.group->all_reduce(x)->wait();
        LS_CHECK(x.to_vector<double>()[0] == 2.0, "sum");
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(NewGroup, MembersGetASubgroupNonMembersGetNothing) {
  auto store = std::make_shared<HashStore>(30s);
  std::vector<std::thread> ts;
  std::vector<std::string> errors(4);
  for (int r = 0; r < 4; ++r) {
    ts.emplace_back([&, r] {
      try {
        InitOptions o;
        o.store = store;
        o.rank = r;
        o.world_size = 4;
        World w = connect_world(DistEnv{}, o);
        // Ranks 1 and 3 make two groups of the same list; rank 0 and 2 do not call at all.
        if (r == 1 || r == 3) {
          for (int k = 0; k < 2; ++k) {
            auto g = new_group(w, {1, 3});
            LS_CHECK(g && g->size() == 2 && g->rank() == (r == 1 ? 0 : 1), "membership");
            Tensor x = full({2}, static_cast<double>(r + k), kInt32);
            g->all_reduce(x)->wait();
            LS_CHECK(x.to_vector<double>()[1] == 4 + 2 * k, "sum in subgroup");
          }
        }
        auto alone = new_group(w, {r});
        LS_CHECK(alone && alone->size() == 1, "a group of one");
        LS_CHECK(new_group(w, {(r + 1) % 4}) == nullptr, "non-member got a group");
        w.group->barrier()->wait();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(NewGroup, RejectsBadRankLists) {
  World w = connect_world(DistEnv{}, {});
  expect_error([&] { new_group(w, {}); }, {"at least one rank"});
  expect_error([&] { new_group(w, {0, 1}); }, {"rank 1 is outside the world [0, 1)"});
  expect_error([&] { new_group(w, {0, 0}); }, {"increasing and distinct"});
}

TEST(DefaultGroup, LifecycleAndAccessors) {
  // The test runs without launcher variables: a world of one with no network.
  if (is_initialized()) destroy_process_group();
  expect_error([] { rank(); }, {"not initialized", "init_process_group"});
  EXPECT_FALSE(is_initialized());
  auto pg = init_process_group();
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(pg->size(), world_size());
  EXPECT_EQ(rank(), 0);
  EXPECT_EQ(local_rank(), 0);
  EXPECT_EQ(local_world_size(), 1);
  EXPECT_TRUE(is_main_process());
  EXPECT_EQ(default_group(), pg);
  expect_error([] { init_process_group(); }, {"already exists", "destroy_process_group"});
  auto solo = new_group({0});
  ASSERT_NE(solo, nullptr);
  EXPECT_EQ(solo->size(), 1);
  destroy_process_group();
  EXPECT_FALSE(is_initialized());
  destroy_process_group();  // a no-op
  expect_error([] { world_size(); }, {"not initialized"});
}

// The bind address is chosen once, by connect_world, from MASTER_ADDR (whatever the store), and
// reaches every group's backend; the world's groups and new_group's listen on it.
TEST(ConnectWorld, TheBindAddressIsChosenOnceAndReachesEveryGroup) {
  auto store = std::make_shared<HashStore>(30s);
  const auto errors = on_threads(2, [&](int r, const std::function<void()>& together) {
    DistEnv env;
    env.master_addr = "localhost";
    InitOptions o;
    o.backend = "gloo";  // the one that listens (auto would choose shm here)
    o.store = store;
    o.rank = r;
    o.world_size = 2;
    World w = connect_world(env, o);
    LS_CHECK(w.bind_address == local_address_toward("localhost", env.master_port) &&
                 w.bind_interface.empty(),
             "bound to '", w.bind_address, "'");
    auto sub = new_group(w, {0, 1});
    for (const auto& g : {w.group, sub}) {
      auto* gloo = dynamic_cast<ProcessGroupGloo*>(g.get());
      LS_CHECK(gloo != nullptr && gloo->address() == w.bind_address, "a group listens on ",
               gloo ? gloo->address() : "?");
    }
    together();
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");

  DistEnv nowhere;
  nowhere.master_addr = "no-such-host.invalid";
  InitOptions o;
  o.store = std::make_shared<HashStore>(30s);
  o.rank = 0;
  o.world_size = 2;
  expect_error([&] { connect_world(nowhere, o); }, {"cannot resolve 'no-such-host.invalid'"});
}

TEST(LocalAddress, LoopbackRoutesThroughLoopback) {
  EXPECT_EQ(local_address_toward("127.0.0.1", 29500), "127.0.0.1");
  EXPECT_EQ(local_address_toward("localhost", 29500).rfind("127.", 0) == 0 ||
                local_address_toward("localhost", 29500) == "::1",
            true);
  expect_error([] { local_address_toward("no-such-host.invalid", 1); },
               {"cannot resolve 'no-such-host.invalid'"});
}

}  // namespace

namespace {

TEST(ConnectWorld, ABadInterfaceOnOneRankFailsEveryRankAtOnce) {
  auto store = std::make_shared<HashStore>(30s);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {
    ts.emplace_back([&, r] {
      try {
        DistEnv env;
        if (r == 1) env.socket_ifname = "nosuch0";
        InitOptions o;
        o.store = store;
        o.rank = r;
        o.world_size = 2;
        o.timeout = 20s;  // rank 0 would wait this long for rank 1 without the error key
        connect_world(env, o);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("nosuch0: no such network interface"));
  }
  EXPECT_THAT(errors[0], ::testing::HasSubstr("rank 1: "));
}

// Note [Who may reach rank 0's store] (src/distributed/bind_address.h).
TEST(StoreListen, LoopbackWhenTheJobIsOnThisMachineElseATokenOrTheInsecureSetting) {
  auto at = [](const std::string& addr, std::map<std::string, std::string> more = {}) {
    more["RANK"] = "0";
    more["WORLD_SIZE"] = "2";
    more["MASTER_ADDR"] = addr;
    return dist::detail::store_listen_address(read_dist_env(env_of(more)));
  };
  EXPECT_EQ(at("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(at("127.0.1.1"), "127.0.1.1");
  EXPECT_EQ(at("::1"), "::1");
  const std::string localhost = at("localhost");
  EXPECT_TRUE(localhost == "127.0.0.1" || localhost == "::1") << localhost;
  // Another machine's address (the torchrun/SLURM way): open only with a token.
  expect_error([&] { at("10.255.255.1"); },
               {"rank 0: rank 0 would host the rendezvous store on every interface",
                "MASTER_ADDR=10.255.255.1 is not a loopback address", "port 29500",
                "LOCKSTEP_STORE_TOKEN_FILE=~/.lockstep-token", "before srun",
                "LOCKSTEP_STORE_TOKEN=<secret>", "LOCKSTEP_STORE_INSECURE=1"});
  EXPECT_EQ(at("10.255.255.1", {{"LOCKSTEP_STORE_TOKEN", "s3cret"}}), "");
  EXPECT_EQ(at("10.255.255.1", {{"LOCKSTEP_STORE_INSECURE", "1"}}), "");
  expect_error(
      [&] {
        at("10.255.255.1", {{"LOCKSTEP_STORE_INSECURE", "0"}});
      },
      {"would host the rendezvous store on every interface"});
  expect_error(
      [&] {
        at("10.255.255.1", {{"LOCKSTEP_STORE_INSECURE", "yes"}});
      },
      {"LOCKSTEP_STORE_INSECURE: expected 1", "or 0, got 'yes'"});
}

TEST(StoreListen, ATokenFileOfTheUsersOwnReadableByNoOneElse) {
  const std::string path = ::testing::TempDir() + "token_" + std::to_string(::getpid());
  std::ofstream(path) << "  s3cret-from-a-file\n";
  auto token_of = [&](std::map<std::string, std::string> vars) {
    return read_dist_env(env_of(vars)).store_token;
  };
  ::chmod(path.c_str(), 0600);
  EXPECT_EQ(token_of({{"LOCKSTEP_STORE_TOKEN_FILE", path}}), "s3cret-from-a-file");
  EXPECT_EQ(token_of({{"LOCKSTEP_STORE_TOKEN", "t"}}), "t");
  EXPECT_EQ(token_of({}), std::nullopt);
  expect_error(
      [&] {
        token_of({{"LOCKSTEP_STORE_TOKEN_FILE", path}, {"LOCKSTEP_STORE_TOKEN", "t"}});
      },
      {"LOCKSTEP_STORE_TOKEN and LOCKSTEP_STORE_TOKEN_FILE both give", "set only one"});
  ::chmod(path.c_str(), 0644);
  expect_error(
      [&] {
        token_of({{"LOCKSTEP_STORE_TOKEN_FILE", path}});
      },
      {"LOCKSTEP_STORE_TOKEN_FILE=" + path + " has mode 0644", "chmod 600"});
  ::unlink(path.c_str());
  expect_error(
      [&] {
        token_of({{"LOCKSTEP_STORE_TOKEN_FILE", path}});
      },
      {"LOCKSTEP_STORE_TOKEN_FILE=" + path + ": cannot open it"});
  // A FIFO is refused at once, not read (which would block until a writer came).
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  expect_error([&] { token_of({{"LOCKSTEP_STORE_TOKEN_FILE", path}}); }, {"is not a regular file"});
  ::unlink(path.c_str());
}

// The local addresses on which something listens on TCP port `port` (from /proc/net/tcp and
// tcp6, as the kernel's hex: "0100007F" is 127.0.0.1, "00000000" every interface).
std::vector<std::string> listeners_on(uint16_t port) {
  std::vector<std::string> found;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state != "0A" || colon == std::string::npos) continue;  // 0A: LISTEN
      if (std::stoul(local.substr(colon + 1), nullptr, 16) == port)
        found.push_back(local.substr(0, colon));
    }
  }
  return found;
}

// Ranks started the torchrun/SLURM way on one machine (MASTER_ADDR=127.0.0.1, no token): rank 0's
// store listens on loopback only, where it once listened on every interface with no token.
TEST(StoreListen, RankZerosStoreListensOnLoopbackOnlyForAJobOnThisMachine) {
  uint16_t port = 0;
  {
    Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    socklen_t len = sizeof(a);
    ASSERT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    ASSERT_EQ(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len), 0);
    port = ntohs(a.sin_port);
  }
  std::vector<std::string> listening;
  const auto errors = on_threads(2, [&](int r, const std::function<void()>& together) {
    const DistEnv env = read_dist_env(env_of({{"RANK", std::to_string(r)},
                                              {"WORLD_SIZE", "2"},
                                              {"MASTER_ADDR", "127.0.0.1"},
                                              {"MASTER_PORT", std::to_string(port)},
                                              {"LOCKSTEP_BACKEND", "gloo"}}));
    World w = connect_world(env, {});
    if (r == 0) listening = listeners_on(port);
    w.group->barrier()->wait();
    together();
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_THAT(listening, ::testing::ElementsAre("0100007F"));
}

}  // namespace
