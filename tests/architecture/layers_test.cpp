// The layer order of docs/ARCHITECTURE.md, enforced: every #include in src/, include/, tools/ and
// examples/ points to the including file's own layer or one below it.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

// Note [Layer order]
// The layers from the bottom up. A file may include its own layer and any layer with a lower
// rank; layers that share a rank (nn and optim; data and io) are independent of each other and
// may not include each other either. autograd is two layers: its graph types (Node, edges, grad
// mode, hooks) sit below ops, since every op records its backward as it runs; its engine and
// gradcheck sit above ops, since they run them. distributed/store/ is the bottom of
// distributed/: the store knows nothing of process groups, DDP or backends. The rest of
// distributed/ is one layer whose folders group it by concern, not by rank (the process-group
// core at its top, the backends' folders, data_parallel/, sharding/, checkpoint/, diagnosis/):
// they may include each other, as the core names the built-in backends and each backend uses
// the core. The same table is docs/ARCHITECTURE.md's "Layers"; change both together.
struct Layer {
  const char* name;
  int rank;
};
constexpr Layer kLayers[] = {
    {"base", 0},
    {"tensor", 1},
    {"autograd/graph", 2},
    {"ops", 3},
    {"autograd/engine", 4},
    {"nn", 5},
    {"optim", 5},
    {"data", 6},
    {"io", 6},
    {"amp", 7},
    {"distributed/store", 8},
    {"distributed", 9},
    {"programs", 10},
};

std::optional<Layer> find_layer(const std::string& name) {
  for (const Layer& l : kLayers)
    if (name == l.name) return l;
  return std::nullopt;
}

// The layer of a path relative to the tree's root ("src/ops/cpu/loops.h", "include/lockstep/nn/
// module.h", "tools/lockstep/agent.cpp") or of an include's spelling ("lockstep/ops/nn.h",
// "ops/cpu/loops.h", "distributed/store/socket.h"). Empty when the path names no layer.
std::string layer_of(std::string path) {
  for (const char* prefix : {"include/lockstep/", "lockstep/", "src/"}) {
    if (path.rfind(prefix, 0) == 0) {
      path = path.substr(std::string(prefix).size());
      break;
    }
  }
  if (path.rfind("tools/", 0) == 0 || path.rfind("examples/", 0) == 0) return "programs";
  if (path == "lockstep.h") return "programs";  // the whole API: for programs only
  const auto slash = path.find('/');
  if (slash == std::string::npos) return "";
  const std::string top = path.substr(0, slash);
  const std::string rest = path.substr(slash + 1);
  if (top == "autograd") {
    const bool graph = rest.rfind("node", 0) == 0 || rest.rfind("grad_mode", 0) == 0 ||
                       rest.rfind("hooks", 0) == 0;
    return graph ? "autograd/graph" : "autograd/engine";
  }
  if (top == "distributed" && rest.rfind("store/", 0) == 0) return "distributed/store";
  return find_layer(top) ? top : "";
}

struct Violation {
  std::string where;  // file:line
  std::string text;
};

std::vector<Violation> check_tree(const fs::path& root) {
  std::vector<Violation> found;
  // "..." includes, and <lockstep/...> ones (the angle spelling of a public header).
  const std::regex include_re(R"re(^\s*#\s*include\s*(?:"([^"]+)"|<(lockstep/[^>]+)>))re");
  for (const char* dir : {"src", "include", "tools", "examples"}) {
    if (!fs::exists(root / dir)) continue;
    for (const auto& entry : fs::recursive_directory_iterator(root / dir)) {
      const std::string ext = entry.path().extension().string();
      if (!entry.is_regular_file() ||
          (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".cuh"))
        continue;
      const std::string rel = fs::relative(entry.path(), root).generic_string();
      const std::string from = layer_of(rel);
      if (from.empty()) {
        found.push_back({rel, "is in no layer of Note [Layer order]; add its folder to the table"});
        continue;
      }
      const Layer src = *find_layer(from);
      std::ifstream in(entry.path());
      std::string line;
      for (int n = 1; std::getline(in, line); ++n) {
        std::smatch m;
        if (!std::regex_search(line, m, include_re)) continue;
        const std::string target = m[1].matched ? m[1].str() : m[2].str();
        // A bare name ("agent.h") or a relative path ("../x.h") names a file beside this one:
        // its layer is that of the file it resolves to (src/autograd/ holds two layers).
        const bool relative = target.find('/') == std::string::npos ||
                              target.rfind("../", 0) == 0 || target.rfind("./", 0) == 0;
        const std::string to =
            relative
                ? layer_of(
                      (fs::path(rel).parent_path() / target).lexically_normal().generic_string())
                : layer_of(target);
        if (to.empty() || to == from) continue;
        const Layer dst = *find_layer(to);
        if (dst.rank < src.rank) continue;
        found.push_back(
            {rel + ":" + std::to_string(n),
             "includes \"" + target + "\": " + from + " may not include " + to +
                 (dst.rank == src.rank ? " (a peer at the same level)" : " (a layer above it)")});
      }
    }
  }
  return found;
}

TEST(Layers, EveryIncludePointsDownTheLayerOrder) {
  const std::vector<Violation> found = check_tree(LOCKSTEP_SOURCE_DIR);
  std::string report;
  for (const Violation& v : found) report += "  " + v.where + " " + v.text + "\n";
  EXPECT_TRUE(found.empty()) << found.size()
                             << " include(s) against the layer order (Note [Layer order] in "
                                "tests/architecture/layers_test.cpp, docs/ARCHITECTURE.md):\n"
                             << report;
}

// The checker itself: it must see an upward include, a peer include and a file outside every
// layer, and accept includes that point down or stay in the layer.
TEST(Layers, CheckerFindsUpwardPeerAndUnknown) {
  const fs::path root = fs::temp_directory_path() / ("layers_test_" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto write = [&](const std::string& rel, const std::string& text) {
    fs::create_directories((root / rel).parent_path());
    std::ofstream(root / rel) << text;
  };
  write("src/tensor/tensor.cpp",
        "#include \"lockstep/base/error.h\"\n#include \"tensor/dispatch.h\"\n"
        "#include \"lockstep/ops/elementwise.h\"\n");
  write("src/nn/layers.cpp",
        "#include \"lockstep/optim/optimizer.h\"\n#include \"ops/cpu/loops.h\"\n");
  write("src/autograd/node.cpp", "#include \"lockstep/ops/reduce.h\"\n");
  write("src/autograd/engine.cpp",
        "#include \"lockstep/ops/reduce.h\"\n#include \"lockstep/autograd/node.h\"\n");
  write("src/distributed/store/tcp_store.cpp",
        "#include \"lockstep/distributed/process_group.h\"\n");
  write(
      "src/distributed/data_parallel/ddp.cpp",
      "#include \"distributed/store/socket.h\"\n#include \"distributed/diagnosis/slow_rank.h\"\n");
  write("src/widgets/w.cpp", "\n");
  write("src/autograd/grad_mode.cpp", "#include \"engine.h\"\n#include \"node.h\"\n");
  write("src/data/x.cpp", "#include <lockstep/amp/grad_scaler.h>\n#include \"../ops/common.h\"\n");
  write("tools/lockstep/main.cpp", "#include \"lockstep/lockstep.h\"\n#include \"agent.h\"\n");
  const std::vector<Violation> found = check_tree(root);
  fs::remove_all(root);
  std::vector<std::string> where;
  for (const Violation& v : found) where.push_back(v.where);
  std::sort(where.begin(), where.end());
  const std::vector<std::string> expected = {
      "src/autograd/grad_mode.cpp:1",  // "engine.h" beside it is the engine, above ops
      "src/autograd/node.cpp:1",
      "src/data/x.cpp:1",  // <lockstep/amp/...>; its "../ops/common.h" points down
      "src/distributed/store/tcp_store.cpp:1",
      "src/nn/layers.cpp:1",
      "src/tensor/tensor.cpp:3",
      "src/widgets/w.cpp"};
  EXPECT_EQ(where, expected);
}

}  // namespace
