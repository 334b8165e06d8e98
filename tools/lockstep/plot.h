// `lockstep plot`: draws the training example's metrics (JSON Lines, read by io/metrics.h) as
// training curves to PNG or SVG with cairo, one drawing code path for both formats. docs/PLOT.md
// has the details.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "lockstep/io/metrics.h"

namespace lockstep::plot {

// Bad input (a bad option, nothing to draw): exit code 2, as for a malformed metrics file. Any
// other failure (cannot write the output) is a lockstep::Error: exit code 1.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The metrics a plot draws: read by lockstep::io::read_metrics (include/lockstep/io/metrics.h),
// which throws io::MetricsFileError for a malformed file (exit code 2, as InputError).
using io::EvalPoint;
using io::MetricsFile;
using io::TrainPoint;

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
PlotSummary plot(const std::vector<MetricsFile>& runs, const PlotOptions& opts);

}  // namespace lockstep::plot
