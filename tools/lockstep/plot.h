// `lockstep plot`: reads the training example's metrics (JSON Lines) and draws training curves to
// PNG or SVG with cairo, one drawing code path for both formats. docs/PLOT.md has the details.
#pragma once

#include <cstdint>
#include <istream>
#include <stdexcept>
#include <string>
#include <vector>

namespace lockstep::plot {

// Bad input (a malformed metrics file, a bad option): exit code 2. Any other failure (cannot
// write the output) is a lockstep::Error: exit code 1.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One "kind":"train" record. NaN marks a value the record did not have (or had as null, which is
// how a JSON writer spells a NaN loss).
struct TrainPoint {
  int64_t step = 0;
  double loss, lr, samples_per_s, loss_scale, grad_norm;
};

// One "kind":"eval" record; NaN as above.
struct EvalPoint {
  int64_t step = 0;
  double test_accuracy, test_loss;
};

// One metrics file as the final model went through it: steps strictly increasing, the records a
// resumed run replaced are gone (Note [Restarts] in plot.cpp).
struct Metrics {
  std::string path;
  std::vector<TrainPoint> train;
  std::vector<EvalPoint> eval;
  std::vector<int64_t> restarts;      // the step each resumed run restarted at
  std::vector<std::string> warnings;  // e.g. a half-written last line that was skipped
};

// Parses a metrics file's text; `name` prefixes error messages ("NAME:LINE: ..."). Throws
// InputError for a line that is not a JSON object, a record without an integer "step" or a string
// "kind", a value of the wrong type, or a file without train or eval records.
Metrics parse_metrics(std::istream& in, const std::string& name);
Metrics read_metrics(const std::string& path);

enum class Format { kPng, kSvg };

// The format an output path asks for by its extension (.png, .svg; any case); InputError otherwise.
Format format_for(const std::string& output);

inline constexpr int kDefaultWidth = 1200;
inline constexpr int kDefaultPanelHeight = 340;  // the default height is this per row of panels
inline constexpr int kMinSize = 200;
inline constexpr int kMaxSize = 8192;  // 8192 x 8192 ARGB is 256 MiB
inline constexpr double kDefaultSmoothing = 0.6;

struct PlotOptions {
  std::string output;  // .png or .svg; written atomically (a temporary file, then rename)
  int width = kDefaultWidth;
  int height = 0;      // 0: kDefaultPanelHeight per row of panels, plus the header
  bool log_y = false;  // the loss panel on a logarithmic axis
  double smoothing = kDefaultSmoothing;  // the loss panel's EMA weight in [0, 1); 0 draws raw only
  std::string title;                     // empty: the file name, or "N runs"
};

// What plot() drew, for messages and tests.
struct PlotSummary {
  int width = 0, height = 0;
  std::vector<std::string> panels;  // panel titles, in drawing order
};

// Draws `runs` (one colour each, a legend when there are several) into opts.output.
PlotSummary plot(const std::vector<Metrics>& runs, const PlotOptions& opts);

}  // namespace lockstep::plot
