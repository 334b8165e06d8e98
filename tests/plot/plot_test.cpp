// `lockstep plot` (tools/lockstep/plot.h): the PNG and SVG it writes from metrics files (read by
// io/metrics.h, whose reading is tested in tests/io/metrics_test.cpp), and the tool's exit codes.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "lockstep/base/error.h"
#include "plot.h"

namespace lockstep::plot {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

std::string train(int64_t step, double loss, double lr, double speed,
                  const std::string& extra = "") {
  std::ostringstream os;
  os.precision(17);
  os << R"({"kind":"train","step":)" << step << R"(,"epoch":0,"loss":)" << loss << R"(,"lr":)" << lr
     << R"(,"samples_per_s":)" << speed << extra << R"(,"time":1700000000.5,"elapsed":)"
     << step * 0.1 << "}\n";
  return os.str();
}

std::string eval(int64_t step, double acc, const std::string& extra = "") {
  std::ostringstream os;
  os.precision(17);
  os << R"({"kind":"eval","step":)" << step << R"(,"epoch":0,"test_accuracy":)" << acc << extra
     << R"(,"time":1700000000.5,"elapsed":1.5})"
     << "\n";
  return os.str();
}

// Values chosen so that no three consecutive points are collinear: cairo merges collinear line
// segments into one, which would hide points from the count of a path's points.
std::string train_curved(int64_t step, double shift = 0) {
  const double k = static_cast<double>(step);
  return train(step, 2.0 / (k + 1) + shift, 0.1 / (k + 2) + shift * 1e-3,
               1000 + 37 * k * k + shift);
}

MetricsFile parse(const std::string& text, const std::string& name = "m.jsonl") {
  std::istringstream in(text);
  return io::parse_metrics(in, name);
}

// Enough of XML to catch a truncated or mis-nested document: every tag closes in order,
// attributes are quoted, '&' starts an entity, and there is one root element.
bool well_formed_xml(const std::string& s, std::string* why) {
  std::vector<std::string> open;
  int roots = 0;
  size_t i = 0;
  auto fail = [&](const std::string& what) {
    *why = what + " at offset " + std::to_string(i);
    return false;
  };
  while (i < s.size()) {
    if (s[i] == '&') {
      const size_t semi = s.find(';', i);
      if (semi == std::string::npos || semi - i > 10) return fail("bare '&'");
      i = semi + 1;
      continue;
    }
    if (s[i] != '<') {
      if (s[i] == '>') return fail("bare '>'");
      ++i;
      continue;
    }
    if (s.compare(i, 2, "<?") == 0 || s.compare(i, 4, "<!--") == 0) {
      const std::string end = s[i + 1] == '?' ? "?>" : "-->";
      const size_t e = s.find(end, i);
      if (e == std::string::npos) return fail("unterminated " + end);
      i = e + end.size();
      continue;
    }
    const bool closing = s[i + 1] == '/';
    size_t j = i + (closing ? 2 : 1);
    const size_t name_start = j;
    while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == ':' ||
                            s[j] == '-' || s[j] == '_')) {
      ++j;
    }
    const std::string name = s.substr(name_start, j - name_start);
    if (name.empty()) return fail("a tag without a name");
    if (closing) {
      if (open.empty() || open.back() != name) return fail("</" + name + "> closes nothing open");
      open.pop_back();
      const size_t e = s.find('>', j);
      if (e == std::string::npos) return fail("unterminated tag");
      i = e + 1;
      continue;
    }
    bool self_closing = false;
    for (;;) {  // attributes
      while (j < s.size() && std::isspace(static_cast<unsigned char>(s[j]))) ++j;
      if (j >= s.size()) return fail("unterminated <" + name + ">");
      if (s.compare(j, 2, "/>") == 0) {
        self_closing = true;
        j += 2;
        break;
      }
      if (s[j] == '>') {
        ++j;
        break;
      }
      const size_t eq = s.find('=', j);
      if (eq == std::string::npos || eq + 1 >= s.size()) return fail("attribute without value");
      const char q = s[eq + 1];
      if (q != '"' && q != '\'') return fail("unquoted attribute in <" + name + ">");
      const size_t close = s.find(q, eq + 2);
      if (close == std::string::npos) return fail("unterminated attribute");
      if (s.substr(eq + 2, close - eq - 2).find('<') != std::string::npos) {
        return fail("'<' in an attribute");
      }
      j = close + 1;
    }
    if (open.empty()) ++roots;
    if (!self_closing) open.push_back(name);
    i = j;
  }
  if (!open.empty()) return fail("<" + open.back() + "> is never closed");
  if (roots != 1) return fail(std::to_string(roots) + " root elements");
  return true;
}

// The number of points of each stroked, unfilled single-subpath <path> in cairo's SVG (the
// curves; text is glyph outlines, which are filled).
std::vector<int> stroked_path_points(const std::string& svg) {
  std::vector<int> counts;
  static const std::regex path_re(R"re(<path style="([^"]*)" d="([^"]*)")re");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), path_re);
       it != std::sregex_iterator(); ++it) {
    const std::string style = (*it)[1], d = (*it)[2];
    if (style.find("fill:none") == std::string::npos) continue;
    int moves = 0, lines = 0;
    for (char c : d) moves += c == 'M', lines += c == 'L';
    if (moves == 1 && d.find_first_of("CZ") == std::string::npos) counts.push_back(1 + lines);
  }
  return counts;
}

struct PngSize {
  uint32_t width = 0, height = 0;
};

// The signature and the IHDR chunk, which the PNG format puts first.
PngSize png_size(const std::string& png) {
  static const std::string kSignature = "\x89PNG\r\n\x1a\n";
  EXPECT_GE(png.size(), 33u);
  if (png.size() < 33) return {};
  EXPECT_EQ(png.substr(0, 8), kSignature);
  EXPECT_EQ(png.substr(12, 4), "IHDR");
  auto be32 = [&](size_t at) {
    uint32_t v = 0;
    for (size_t k = 0; k < 4; ++k) v = v << 8 | static_cast<unsigned char>(png[at + k]);
    return v;
  };
  return {be32(16), be32(20)};
}

struct ToolResult {
  int code = -1;
  std::string output;  // stdout and stderr
};

ToolResult run_tool(const std::string& args) {
  ToolResult r;
  const std::string cmd = std::string("'") + LOCKSTEP_TOOL + "' plot " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) r.output.append(buf, n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class PlotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "lockstep_plot_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A run of `steps` training steps, evaluated every `eval_every`.
  fs::path write_run(const std::string& name, int steps, int eval_every,
                     const std::string& extra = "") {
    std::string text;
    for (int s = 1; s <= steps; ++s) {
      text += train(s, 2.0 / s, 0.01, 500 + s, extra);
      if (s % eval_every == 0) text += eval(s, 0.5 + 0.4 * s / steps, R"(,"test_loss":0.4)");
    }
    write_text(dir_ / name, text);
    return dir_ / name;
  }

  std::vector<std::string> files_in_dir() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }

  fs::path dir_;
};

TEST_F(PlotTest, PngHasTheSignatureAndTheRequestedSize) {
  const MetricsFile m = io::read_metrics(write_run("run.jsonl", 40, 10));
  PlotOptions opts;
  opts.output = dir_ / "curves.png";
  opts.width = 640;
  opts.height = 480;
  const PlotSummary s = plot({m}, opts);
  const PngSize size = png_size(read_text(opts.output));
  EXPECT_EQ(size.width, 640u);
  EXPECT_EQ(size.height, 480u);
  EXPECT_EQ(s.width, 640);
  EXPECT_EQ(s.height, 480);

  // The default height follows the panels: 4 panels in 2 rows here, 6 in 3 with AMP's values.
  opts.width = 1000;
  opts.height = 0;
  const PlotSummary four = plot({m}, opts);
  EXPECT_EQ(png_size(read_text(opts.output)).height, static_cast<uint32_t>(four.height));
  const MetricsFile amp =
      io::read_metrics(write_run("amp.jsonl", 40, 10, R"(,"loss_scale":65536.0,"grad_norm":1.5)"));
  const PlotSummary six = plot({amp}, opts);
  EXPECT_EQ(png_size(read_text(opts.output)).width, 1000u);
  EXPECT_EQ(six.panels.size(), 6u);
  EXPECT_GT(six.height, four.height);
}

TEST_F(PlotTest, SvgIsWellFormedAndNamesItsPanels) {
  const MetricsFile m = io::read_metrics(write_run("run.jsonl", 30, 10));
  PlotOptions opts;
  opts.output = dir_ / "curves.svg";
  plot({m}, opts);
  const std::string svg = read_text(opts.output);
  std::string why;
  EXPECT_TRUE(well_formed_xml(svg, &why)) << why;
  EXPECT_THAT(svg, HasSubstr(R"(width="1200px")"));
  for (const char* title :
       {"Loss (dashed: test loss)", "Test accuracy", "Throughput (samples/s)", "Learning rate"}) {
    EXPECT_THAT(svg, HasSubstr(title));
  }
  EXPECT_THAT(svg, ::testing::Not(HasSubstr("Loss scale")));  // no loss_scale in these records

  // The checker itself rejects what it should.
  EXPECT_FALSE(well_formed_xml(svg.substr(0, svg.size() / 2), &why));
  EXPECT_FALSE(well_formed_xml("<a><b></a></b>", &why));
  EXPECT_FALSE(well_formed_xml("<a x=1></a>", &why));
}

TEST_F(PlotTest, SvgCurvesHaveOnePointPerDistinctStep) {
  // Steps 1..5, then a restart from step 3 that runs to 7 and a second file with 4 steps: 7 and
  // 4 distinct steps, 10 and 4 records.
  std::string text;
  for (int s = 1; s <= 5; ++s) text += train_curved(s, 0.5);
  text += eval(2, 0.3) + eval(4, 0.5);
  for (int s = 3; s <= 7; ++s) text += train_curved(s);
  text += eval(5, 0.6) + eval(7, 0.65);
  write_text(dir_ / "a.jsonl", text);
  std::string other;
  for (int s = 1; s <= 4; ++s) other += train_curved(s, 0.25);
  write_text(dir_ / "b.jsonl", other);

  PlotOptions opts;
  opts.output = dir_ / "curves.svg";
  const PlotSummary s =
      plot({io::read_metrics(dir_ / "a.jsonl"), io::read_metrics(dir_ / "b.jsonl")}, opts);
  const std::vector<int> counts = stroked_path_points(read_text(opts.output));
  auto paths_with = [&](int points) { return std::count(counts.begin(), counts.end(), points); };
  // Raw and smoothed loss, throughput and learning rate: 4 curves per file.
  EXPECT_EQ(paths_with(7), 4) << ::testing::PrintToString(counts);
  EXPECT_EQ(paths_with(4), 4) << ::testing::PrintToString(counts);
  EXPECT_EQ(paths_with(10), 0);
  EXPECT_EQ(paths_with(3), 1);  // test accuracy at steps 2, 5, 7 (4 was dropped by the restart)
  EXPECT_EQ(s.panels.size(), 4u);
}

TEST_F(PlotTest, BadOptionsAreInputErrors) {
  const MetricsFile m = parse(train(1, 1.0, 0.1, 10) + train(2, 0.5, 0.1, 10));
  auto error = [&](const PlotOptions& o) -> std::string {
    try {
      plot({m}, o);
    } catch (const InputError& e) {
      return e.what();
    }
    return "";
  };
  PlotOptions o;
  o.output = dir_ / "x.jpg";
  EXPECT_THAT(error(o), HasSubstr("use .png or .svg"));
  o.output = dir_ / "x";
  EXPECT_THAT(error(o), HasSubstr("use .png or .svg"));
  o.output = dir_ / "X.PNG";
  EXPECT_EQ(error(o), "");
  o.width = 10;
  EXPECT_THAT(error(o), HasSubstr("--width must be in [200, 8192]"));
  o.width = 800;
  o.height = 100000;
  EXPECT_THAT(error(o), HasSubstr("--height must be in"));
  o.height = 0;
  o.smoothing = 1.0;
  EXPECT_THAT(error(o), HasSubstr("--smooth must be in [0, 1)"));
  EXPECT_EQ(format_for("a/b.SvG"), Format::kSvg);
}

TEST_F(PlotTest, WritesAtomicallyAndCleansUpOnFailure) {
  const MetricsFile m = io::read_metrics(write_run("run.jsonl", 20, 5));
  PlotOptions opts;
  opts.output = dir_ / "curves.png";
  write_text(opts.output, "old");
  plot({m}, opts);  // replaces the old file
  EXPECT_EQ(png_size(read_text(opts.output)).width, 1200u);
  EXPECT_EQ(files_in_dir(), (std::vector<std::string>{"curves.png", "run.jsonl"}));

  fs::create_directory(dir_ / "taken.svg");  // rename() cannot replace a directory
  opts.output = dir_ / "taken.svg";
  try {
    plot({m}, opts);
    ADD_FAILURE() << "expected lockstep::Error";
  } catch (const lockstep::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot write"));
  }
  EXPECT_EQ(files_in_dir(), (std::vector<std::string>{"curves.png", "run.jsonl", "taken.svg"}));
}

TEST_F(PlotTest, LogAxisAndGapsDoNotBreakTheDrawing) {
  // Zero and negative losses cannot be drawn on a log axis; null is a gap; one lone point.
  const MetricsFile m = parse(train(1, 0.0, 0.1, 10) + train(2, -1.0, 0.1, 10) +
                              R"({"kind":"train","step":3,"loss":null,"lr":0.1,"samples_per_s":10})"
                              "\n" +
                              train(4, 0.5, 0.1, 10));
  PlotOptions opts;
  opts.log_y = true;
  for (const char* name : {"log.png", "log.svg"}) {
    opts.output = dir_ / name;
    EXPECT_NO_THROW(plot({m}, opts));
    EXPECT_GT(fs::file_size(opts.output), 100u);
  }
}

TEST_F(PlotTest, NullLossLeavesAGapInTheCurve) {
  std::string text;
  for (int s = 1; s <= 6; ++s) {
    text += s == 3 ? R"({"kind":"train","step":3,"loss":null,"lr":0.1,"samples_per_s":10})"
                     "\n"
                   : train_curved(s);
  }
  PlotOptions opts;
  opts.output = dir_ / "gap.svg";
  opts.smoothing = 0;  // the raw loss only
  plot({parse(text)}, opts);
  // The loss curve: two pieces, steps 1-2 and 4-6 (cairo writes "M .. L .. M .. L .. L ..").
  const std::string svg = read_text(opts.output);
  static const std::regex two_pieces(R"re(d="M [^"LM]+L [^"LM]+M [^"LM]+(L [^"LM]+){2}")re");
  EXPECT_TRUE(std::regex_search(svg, two_pieces));
}

TEST_F(PlotTest, ToolExitCodes) {
  const fs::path run = write_run("run.jsonl", 20, 5);
  ToolResult r = run_tool("'" + run.string() + "' -o '" + (dir_ / "curves.jpg").string() + "'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("use .png or .svg"));
  EXPECT_FALSE(fs::exists(dir_ / "curves.jpg"));

  write_text(dir_ / "bad.jsonl", train(1, 1.0, 0.1, 10) + "oops\n");
  r = run_tool("'" + (dir_ / "bad.jsonl").string() + "' -o '" + (dir_ / "c.png").string() + "'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("bad.jsonl:2: not a JSON object"));

  // A metrics file that cannot be read is bad input too: its path and the reason.
  r = run_tool("'" + (dir_ / "missing.jsonl").string() + "' -o '" + (dir_ / "c.png").string() +
               "'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("missing.jsonl: cannot open: No such file or directory"));

  r = run_tool("'" + run.string() + "'");  // no -o
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("lockstep plot --help"));

  r = run_tool("'" + run.string() + "' -o '" + (dir_ / "no/such/dir/c.png").string() + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("cannot write"));

  r = run_tool("'" + run.string() + "' '" + run.string() + "' --width 700 --height 300 -o '" +
               (dir_ / "c.png").string() + "'");
  EXPECT_EQ(r.code, 0) << r.output;
  const PngSize size = png_size(read_text(dir_ / "c.png"));
  EXPECT_EQ(size.width, 700u);
  EXPECT_EQ(size.height, 300u);
}

}  // namespace
}  // namespace lockstep::plot
