// `lockstep plot`: metrics (read by io/metrics.h) in, training curves out (PNG or SVG through one
// cairo drawing path: the image surface for PNG, the SVG surface for SVG).
#include "plot.h"

#include <cairo-svg.h>
#include <cairo.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <limits>
#include <memory>
#include <set>

#include "lockstep/base/error.h"
#include "lockstep/base/syscall.h"

// Every cairo status goes through here: cairo errors are sticky, so a check after drawing catches
// any call that failed during it.
#define CAIRO_CHECK(expr)                                                                       \
  do {                                                                                          \
    const cairo_status_t status_ = (expr);                                                      \
    LS_CHECK(status_ == CAIRO_STATUS_SUCCESS, "cairo: ", cairo_status_to_string(status_), " (", \
             #expr, ")");                                                                       \
  } while (0)

namespace lockstep::plot {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

}  // namespace

Format format_for(const std::string& output) {
  std::string ext = std::filesystem::path(output).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  if (ext == ".png") return Format::kPng;
  if (ext == ".svg") return Format::kSvg;
  throw InputError("cannot tell the format of '" + output + "' from its extension" +
                   (ext.empty() ? "" : " '" + ext + "'") + ": use .png or .svg");
}

namespace {

// ---------------------------------------------------------------------------------------------
// What to draw

enum class Scale { kLinear, kLog10, kLog2 };

struct Series {
  std::vector<double> x, y;
  double alpha = 1.0;
  double width = 1.5;
  bool dashed = false;
  bool markers = false;
};

struct Panel {
  std::string title;
  Scale scale = Scale::kLinear;
  std::vector<std::pair<size_t, Series>> series;  // (run index: the colour, series)
};

constexpr double kPalette[][3] = {  // matplotlib's tab10
    {0.122, 0.467, 0.706}, {1.000, 0.498, 0.055}, {0.173, 0.627, 0.173}, {0.839, 0.153, 0.157},
    {0.580, 0.404, 0.741}, {0.549, 0.337, 0.294}, {0.890, 0.467, 0.761}, {0.498, 0.498, 0.498},
    {0.737, 0.741, 0.133}, {0.090, 0.745, 0.812}};
constexpr size_t kPaletteSize = std::size(kPalette);

bool any_finite(const std::vector<double>& v) {
  return std::any_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); });
}

// TensorBoard's smoothing: an exponential moving average, debiased so that it starts at the
// first value rather than at 0. NaN values stay NaN and do not enter the average.
std::vector<double> smooth(const std::vector<double>& v, double weight) {
  std::vector<double> out(v.size(), kNaN);
  double last = 0.0;
  int64_t n = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) continue;
    last = last * weight + (1.0 - weight) * v[i];
    ++n;
    out[i] = last / (1.0 - std::pow(weight, static_cast<double>(n)));
  }
  return out;
}

template <typename Point, typename Get>
Series series_of(const std::vector<Point>& points, Get get) {
  Series s;
  for (const Point& p : points) {
    s.x.push_back(static_cast<double>(p.step));
    s.y.push_back(get(p));
  }
  return s;
}

std::vector<Panel> build_panels(const std::vector<MetricsFile>& runs, const PlotOptions& opts) {
  Panel loss{"Training loss", opts.log_y ? Scale::kLog10 : Scale::kLinear, {}};
  Panel acc{"Test accuracy", Scale::kLinear, {}};
  Panel speed{"Throughput (samples/s)", Scale::kLinear, {}};
  Panel lr{"Learning rate", Scale::kLinear, {}};
  Panel scale{"Loss scale", Scale::kLog2, {}};
  Panel grad{"Gradient norm", Scale::kLinear, {}};
  bool test_loss = false;
  for (size_t r = 0; r < runs.size(); ++r) {
    const MetricsFile& m = runs[r];
    auto add = [&](Panel& p, Series s) {
      if (any_finite(s.y)) p.series.emplace_back(r, std::move(s));
    };
    Series raw = series_of(m.train, [](const TrainPoint& p) { return p.loss; });
    if (opts.smoothing > 0 && any_finite(raw.y)) {
      Series smoothed = raw;
      smoothed.y = smooth(raw.y, opts.smoothing);
      smoothed.width = 2.0;
      raw.alpha = 0.3;
      raw.width = 1.0;
      add(loss, std::move(raw));
      add(loss, std::move(smoothed));
    } else {
      add(loss, std::move(raw));
    }
    Series tl = series_of(m.eval, [](const EvalPoint& p) { return p.test_loss; });
    tl.dashed = tl.markers = true;
    test_loss = test_loss || any_finite(tl.y);
    add(loss, std::move(tl));
    Series a = series_of(m.eval, [](const EvalPoint& p) { return p.test_accuracy; });
    a.markers = true;
    add(acc, std::move(a));
    add(speed, series_of(m.train, [](const TrainPoint& p) { return p.samples_per_s; }));
    add(lr, series_of(m.train, [](const TrainPoint& p) { return p.lr; }));
    add(scale, series_of(m.train, [](const TrainPoint& p) { return p.loss_scale; }));
    add(grad, series_of(m.train, [](const TrainPoint& p) { return p.grad_norm; }));
  }
  if (test_loss) loss.title = "Loss (dashed: test loss)";
  std::vector<Panel> panels;
  for (Panel* p : {&loss, &acc, &speed, &lr, &scale, &grad}) {
    if (!p->series.empty()) panels.push_back(std::move(*p));
  }
  return panels;
}

// ---------------------------------------------------------------------------------------------
// Axes

struct Axis {
  double lo = 0, hi = 1;  // data range shown
  Scale scale = Scale::kLinear;
  double px0 = 0, px1 = 1;  // pixels of lo and hi
  std::vector<double> ticks;
  std::vector<std::string> labels;

  double t(double v) const {
    return scale == Scale::kLinear ? v : scale == Scale::kLog10 ? std::log10(v) : std::log2(v);
  }
  double map(double v) const { return px0 + (t(v) - t(lo)) / (t(hi) - t(lo)) * (px1 - px0); }
  bool shows(double v) const { return std::isfinite(v) && (scale == Scale::kLinear || v > 0); }
};

double nice_step(double span, int target) {
  const double raw = span / std::max(target, 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
}

std::vector<double> linear_ticks(double lo, double hi, int target, double min_step = 0) {
  const double step = std::max(nice_step(hi - lo, target), min_step);
  std::vector<double> ticks;
  for (double k = std::ceil(lo / step - 1e-9); k * step <= hi + step * 1e-9; k += 1) {
    ticks.push_back(std::abs(k * step) < step * 1e-9 ? 0.0 : k * step);
  }
  return ticks;
}

// Labels in one style per axis: fixed decimals enough to tell ticks apart, or scientific where
// the values are very large or very small.
std::vector<std::string> linear_labels(const std::vector<double>& ticks) {
  std::vector<std::string> out;
  if (ticks.empty()) return out;
  double step = ticks.size() > 1 ? ticks[1] - ticks[0] : std::max(std::abs(ticks[0]), 1.0);
  double biggest = 0;
  for (double t : ticks) biggest = std::max(biggest, std::abs(t));
  const bool sci = biggest >= 1e6 || (biggest < 1e-3 && biggest > 0);
  char buf[64];
  for (double t : ticks) {
    if (t == 0) {
      out.emplace_back("0");
    } else if (sci) {
      const int digits = std::clamp(static_cast<int>(std::floor(std::log10(std::abs(t))) -
                                                     std::floor(std::log10(step) + 1e-9)),
                                    0, 6);
      std::snprintf(buf, sizeof buf, "%.*e", digits, t);
      std::string s = buf;  // 1.5e-04 -> 1.5e-4
      const size_t e = s.find('e');
      std::string exp = s.substr(e + 1);
      const bool neg = exp[0] == '-';
      exp = exp.substr(1);
      while (exp.size() > 1 && exp[0] == '0') exp.erase(0, 1);
      out.push_back(s.substr(0, e) + "e" + (neg ? "-" : "") + exp);
    } else {
      const int decimals =
          std::clamp(static_cast<int>(-std::floor(std::log10(step) + 1e-9)), 0, 10);
      std::snprintf(buf, sizeof buf, "%.*f", decimals, t);
      out.emplace_back(buf);
    }
  }
  return out;
}

// The range of `values` (what the axis can show), padded a little; ticks and labels for `target`
// ticks. A log axis with no positive value falls back to linear.
Axis make_axis(const std::vector<double>& values, Scale scale, int target, bool integers) {
  Axis a;
  a.scale = scale;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (double v : values) {
    if (a.shows(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  }
  if (!(lo <= hi)) {
    if (scale != Scale::kLinear) return make_axis(values, Scale::kLinear, target, integers);
    lo = 0, hi = 1;
  }
  constexpr double kPad = 0.04;
  if (scale == Scale::kLinear) {
    if (hi - lo <= 1e-12 * std::max(std::abs(lo), std::abs(hi))) {
      const double d = lo == 0 ? 1.0 : std::abs(lo) * 0.1;
      lo -= d, hi += d;
    }
    const double pad = (hi - lo) * kPad;
    a.lo = lo - pad, a.hi = hi + pad;
    a.ticks = linear_ticks(a.lo, a.hi, target, integers ? 1.0 : 0.0);
    a.labels = linear_labels(a.ticks);
    return a;
  }
  const double base = scale == Scale::kLog10 ? 10.0 : 2.0;
  double tlo = a.t(lo), thi = a.t(hi);
  if (thi - tlo < 1e-9) tlo -= 0.5, thi += 0.5;
  const double pad = (thi - tlo) * kPad;
  tlo -= pad, thi += pad;
  a.lo = std::pow(base, tlo), a.hi = std::pow(base, thi);
  const int k0 = static_cast<int>(std::ceil(tlo)), k1 = static_cast<int>(std::floor(thi));
  if (k1 - k0 + 1 >= 2) {
    const int stride = std::max(1, (k1 - k0 + 1 + target - 1) / std::max(target, 1));
    for (int k = k0; k <= k1; k += stride) {
      a.ticks.push_back(std::pow(base, k));
      a.labels.push_back("2^" + std::to_string(k));
    }
    if (scale == Scale::kLog10) {  // one style for the whole axis
      a.labels = linear_labels(a.ticks);
      const bool sci = std::any_of(a.labels.begin(), a.labels.end(),
                                   [](const std::string& s) { return s.find('e') != s.npos; });
      if (!sci && a.ticks.front() < 1) {  // 0.001, 0.010, 0.100 -> 0.001, 0.01, 0.1
        char buf[64];
        for (size_t i = 0; i < a.ticks.size(); ++i) {
          std::snprintf(buf, sizeof buf, "%g", a.ticks[i]);
          a.labels[i] = buf;
        }
      }
    }
  } else {  // less than a decade (octave): linear ticks inside it
    a.ticks = linear_ticks(a.lo, a.hi, std::min(target, 4));
    a.labels = linear_labels(a.ticks);
  }
  return a;
}

// ---------------------------------------------------------------------------------------------
// Drawing (the same calls for the image and the SVG surface)

using Surface = std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)>;
using Context = std::unique_ptr<cairo_t, decltype(&cairo_destroy)>;

enum class Align { kLeft, kCenter, kRight };

struct Style {
  double f = 1.0;  // font and line scale, from the width
  double title_size() const { return 16 * f; }
  double panel_title_size() const { return 13 * f; }
  double tick_size() const { return 11 * f; }
  double pad() const { return 12 * f; }
};

void set_font(cairo_t* cr, double size, bool bold) {
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL,
                         bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
}

double text_width(cairo_t* cr, const std::string& s) {
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  return e.x_advance;
}

// Draws `s` with its vertical middle at y.
void text(cairo_t* cr, double x, double y, const std::string& s, Align align) {
  cairo_font_extents_t fe;
  cairo_font_extents(cr, &fe);
  const double w = text_width(cr, s);
  const double dx = align == Align::kLeft ? 0 : align == Align::kCenter ? -w / 2 : -w;
  cairo_move_to(cr, x + dx, y + (fe.ascent - fe.descent) / 2);
  cairo_show_text(cr, s.c_str());
}

struct Rect {
  double x, y, w, h;
};

struct Legend {
  std::vector<std::string> labels;
  std::vector<std::pair<double, double>> at;  // each item's top-left
  double height = 0;
};

// One label per file (its name; the path as given where two files share a name), laid out in
// rows that fit the width.
Legend layout_legend(cairo_t* cr, const std::vector<MetricsFile>& runs, const Style& st,
                     double width) {
  Legend lg;
  if (runs.size() < 2) return lg;
  std::multiset<std::string> names;
  for (const MetricsFile& m : runs) names.insert(std::filesystem::path(m.path).filename().string());
  set_font(cr, st.tick_size(), false);
  const double row_h = st.tick_size() * 1.6, swatch = 22 * st.f, gap = 18 * st.f;
  double x = st.pad(), y = 0;
  for (const MetricsFile& m : runs) {
    const std::string base = std::filesystem::path(m.path).filename().string();
    lg.labels.push_back(names.count(base) > 1 ? m.path : base);
    const double w = swatch + 6 * st.f + text_width(cr, lg.labels.back());
    if (x > st.pad() && x + w > width - st.pad()) x = st.pad(), y += row_h;
    lg.at.emplace_back(x, y);
    x += w + gap;
  }
  lg.height = y + row_h;
  return lg;
}

void draw_series(cairo_t* cr, const Axis& xa, const Axis& ya, const Series& s, const double* rgb,
                 const Style& st) {
  cairo_set_source_rgba(cr, rgb[0], rgb[1], rgb[2], s.alpha);
  cairo_set_line_width(cr, s.width * st.f);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  if (s.dashed) {
    const double dash[] = {6 * st.f, 4 * st.f};
    cairo_set_dash(cr, dash, 2, 0);
  } else {
    cairo_set_dash(cr, nullptr, 0, 0);
  }
  bool pen_down = false;
  int shown = 0;
  for (size_t i = 0; i < s.x.size(); ++i) {
    if (!ya.shows(s.y[i])) {  // a gap: NaN, or not positive on a log axis
      pen_down = false;
      continue;
    }
    ++shown;
    const double px = xa.map(s.x[i]), py = ya.map(s.y[i]);
    pen_down ? cairo_line_to(cr, px, py) : cairo_move_to(cr, px, py);
    pen_down = true;
  }
  cairo_stroke(cr);
  if (!s.markers && shown != 1) return;  // a lone point would be invisible as a line
  for (size_t i = 0; i < s.x.size(); ++i) {
    if (!ya.shows(s.y[i])) continue;
    cairo_new_sub_path(cr);
    cairo_arc(cr, xa.map(s.x[i]), ya.map(s.y[i]), 2.5 * st.f, 0, 2 * M_PI);
  }
  cairo_fill(cr);
}

void draw_panel(cairo_t* cr, const Panel& panel, Rect cell, double xmin, double xmax,
                const Style& st) {
  const double f = st.f, tick = st.tick_size();
  // Vertical layout: title, plot area, tick labels, "step".
  const double top = cell.y + st.panel_title_size() * 1.8;
  const double bottom = cell.y + cell.h - tick * 3.2;
  std::vector<double> ys;
  for (const auto& [r, s] : panel.series) ys.insert(ys.end(), s.y.begin(), s.y.end());
  Axis ya =
      make_axis(ys, panel.scale, std::max(2, static_cast<int>((bottom - top) / (45 * f))), false);
  set_font(cr, tick, false);
  double label_w = 0;
  for (const std::string& l : ya.labels) label_w = std::max(label_w, text_width(cr, l));
  const Rect area{cell.x + label_w + 8 * f, top, cell.w - label_w - 8 * f - 14 * f, bottom - top};
  if (area.w < 10 || area.h < 10) return;  // a degenerate size: nothing fits, draw nothing
  ya.px0 = area.y + area.h, ya.px1 = area.y;
  Axis xa = make_axis({xmin, xmax}, Scale::kLinear,
                      std::max(2, static_cast<int>(area.w / (90 * f))), /*integers=*/true);
  xa.px0 = area.x, xa.px1 = area.x + area.w;

  // Title, grid, frame, tick labels.
  cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
  set_font(cr, st.panel_title_size(), true);
  text(cr, area.x, cell.y + st.panel_title_size() * 0.8, panel.title, Align::kLeft);
  set_font(cr, tick, false);
  cairo_set_line_width(cr, 1);
  for (size_t i = 0; i < ya.ticks.size(); ++i) {
    const double y = std::round(ya.map(ya.ticks[i])) + 0.5;
    if (y < area.y - 1 || y > area.y + area.h + 1) continue;
    cairo_set_source_rgb(cr, 0.91, 0.91, 0.91);
    cairo_move_to(cr, area.x, y);
    cairo_line_to(cr, area.x + area.w, y);
    cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
    text(cr, area.x - 5 * f, y, ya.labels[i], Align::kRight);
  }
  for (size_t i = 0; i < xa.ticks.size(); ++i) {
    const double x = std::round(xa.map(xa.ticks[i])) + 0.5;
    if (x < area.x - 1 || x > area.x + area.w + 1) continue;
    cairo_set_source_rgb(cr, 0.91, 0.91, 0.91);
    cairo_move_to(cr, x, area.y);
    cairo_line_to(cr, x, area.y + area.h);
    cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
    text(cr, x, area.y + area.h + tick, xa.labels[i], Align::kCenter);
  }
  text(cr, area.x + area.w / 2, area.y + area.h + tick * 2.3, "step", Align::kCenter);
  cairo_set_source_rgb(cr, 0.6, 0.6, 0.6);
  cairo_rectangle(cr, std::round(area.x) + 0.5, std::round(area.y) + 0.5, std::round(area.w),
                  std::round(area.h));
  cairo_stroke(cr);

  cairo_save(cr);
  cairo_rectangle(cr, area.x, area.y, area.w, area.h);
  cairo_clip(cr);
  for (const auto& [r, s] : panel.series)
    draw_series(cr, xa, ya, s, kPalette[r % kPaletteSize], st);
  cairo_restore(cr);
}

struct Page {
  int width = 0, height = 0;
  int cols = 1, rows = 1;
  Style style;
  std::string title;
  Legend legend;
  double header = 0;  // pixels above the panels
};

void draw_page(cairo_t* cr, const Page& page, const std::vector<Panel>& panels,
               const std::vector<MetricsFile>& runs) {
  const Style& st = page.style;
  cairo_font_options_t* fo = cairo_font_options_create();
  cairo_font_options_set_hint_metrics(fo, CAIRO_HINT_METRICS_OFF);  // same layout in PNG and SVG
  cairo_set_font_options(cr, fo);
  cairo_font_options_destroy(fo);

  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
  set_font(cr, st.title_size(), true);
  text(cr, st.pad(), st.pad() + st.title_size() / 2, page.title, Align::kLeft);
  set_font(cr, st.tick_size(), false);
  const double legend_y = st.pad() + st.title_size() * 1.6;
  for (size_t r = 0; r < page.legend.labels.size(); ++r) {
    const auto [x, y] = page.legend.at[r];
    const double* rgb = kPalette[r % kPaletteSize];
    const double mid = legend_y + y + st.tick_size() * 0.8;
    cairo_set_source_rgb(cr, rgb[0], rgb[1], rgb[2]);
    cairo_set_line_width(cr, 3 * st.f);
    cairo_move_to(cr, x, mid);
    cairo_line_to(cr, x + 22 * st.f, mid);
    cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
    text(cr, x + 28 * st.f, mid, page.legend.labels[r], Align::kLeft);
  }

  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin;
  for (const MetricsFile& m : runs) {
    for (const TrainPoint& p : m.train)
      xmin = std::min(xmin, double(p.step)), xmax = std::max(xmax, double(p.step));
    for (const EvalPoint& p : m.eval)
      xmin = std::min(xmin, double(p.step)), xmax = std::max(xmax, double(p.step));
  }
  const double cell_w = (page.width - 2 * st.pad()) / page.cols;
  const double cell_h = (page.height - page.header - st.pad()) / page.rows;
  for (size_t i = 0; i < panels.size(); ++i) {
    const Rect cell{st.pad() + cell_w * static_cast<double>(i % page.cols),
                    page.header + cell_h * static_cast<double>(i / page.cols), cell_w - st.pad(),
                    cell_h};
    draw_panel(cr, panels[i], cell, xmin, xmax, st);
  }
}

cairo_status_t append_bytes(void* closure, const unsigned char* data, unsigned int length) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
  return CAIRO_STATUS_SUCCESS;
}

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string render(Format format, const Page& page, const std::vector<Panel>& panels,
                   const std::vector<MetricsFile>& runs) {
  std::string bytes;
  Surface surface(
      format == Format::kPng
          ? cairo_image_surface_create(CAIRO_FORMAT_RGB24, page.width, page.height)
          : cairo_svg_surface_create_for_stream(append_bytes, &bytes, page.width, page.height),
      cairo_surface_destroy);
  CAIRO_CHECK(cairo_surface_status(surface.get()));
#if CAIRO_VERSION >= CAIRO_VERSION_ENCODE(1, 15, 10)
  if (format == Format::kSvg) cairo_svg_surface_set_document_unit(surface.get(), CAIRO_SVG_UNIT_PX);
#endif
  {
    Context cr(cairo_create(surface.get()), cairo_destroy);
    draw_page(cr.get(), page, panels, runs);
    CAIRO_CHECK(cairo_status(cr.get()));
  }
  if (format == Format::kPng) {
    cairo_surface_flush(surface.get());
    CAIRO_CHECK(cairo_surface_write_to_png_stream(surface.get(), append_bytes, &bytes));
    return bytes;
  }
  cairo_surface_finish(surface.get());  // writes the document
  CAIRO_CHECK(cairo_surface_status(surface.get()));
  // cairo draws text as glyph outlines; a <title> and <desc> keep the words searchable (and
  // readable by screen readers).
  const size_t svg = bytes.find("<svg");
  const size_t end = svg == std::string::npos ? svg : bytes.find('>', svg);
  LS_CHECK(end != std::string::npos, "cairo wrote an SVG without an <svg> element");
  std::string desc = "Panels: ";
  for (size_t i = 0; i < panels.size(); ++i) desc += (i ? "; " : "") + panels[i].title;
  desc += ". Files: ";
  for (size_t i = 0; i < runs.size(); ++i) {
    desc += (i ? "; " : "") + runs[i].path + " (" + std::to_string(runs[i].train.size()) +
            " train steps, " + std::to_string(runs[i].eval.size()) + " evaluations)";
  }
  bytes.insert(end + 1, "\n<title>" + xml_escape(page.title) + "</title>\n<desc>" +
                            xml_escape(desc) + ".</desc>");
  return bytes;
}

// Writes `bytes` to a temporary file next to `path` and renames it over `path`, so that a reader
// sees the old file or the new one, never half of one.
void write_atomically(const std::string& path, const std::string& bytes) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  fs::path tmp;
  Fd fd;
  for (int attempt = 0; !fd; ++attempt) {
    std::string name = ".";  // hidden, so that a watcher globbing *.png does not pick it up
    name += target.filename().string();
    name += ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(attempt);
    tmp = dir / name;
    const int opened = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (opened < 0 && (errno != EEXIST || attempt > 100)) {
      LS_THROW("cannot write '", path, "': ", errno_text(errno));
    }
    fd = Fd(opened);
  }
  // The temporary file is removed on every failure below; only the rename keeps it.
  struct RemoveUnlessKept {
    const fs::path& file;
    bool keep = false;
    ~RemoveUnlessKept() {
      if (!keep) ::unlink(file.c_str());
    }
  } remove_tmp{tmp};
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    LS_CHECK(n >= 0, "cannot write '", path, "' (write): ", errno_text(errno));
    done += static_cast<size_t>(n);
  }
  LS_SYSCHECK_MSG(::fsync(fd.get()), "cannot write '", path, "' (fsync)");
  LS_SYSCHECK_MSG(fd.close(), "cannot write '", path, "' (close)");
  LS_SYSCHECK_MSG(::rename(tmp.c_str(), path.c_str()), "cannot write '", path, "' (rename)");
  remove_tmp.keep = true;
}

}  // namespace

PlotSummary plot(const std::vector<MetricsFile>& runs, const PlotOptions& opts) {
  const Format format = format_for(opts.output);
  auto check_size = [](const char* name, int v) {
    if (v < kMinSize || v > kMaxSize) {
      throw InputError(std::string(name) + " must be in [" + std::to_string(kMinSize) + ", " +
                       std::to_string(kMaxSize) + "] pixels, got " + std::to_string(v));
    }
  };
  check_size("--width", opts.width);
  if (opts.height != 0) check_size("--height", opts.height);
  if (!(opts.smoothing >= 0 && opts.smoothing < 1)) {
    throw InputError("--smooth must be in [0, 1), got " + std::to_string(opts.smoothing));
  }
  if (runs.empty()) throw InputError("no metrics files given");
  const std::vector<Panel> panels = build_panels(runs, opts);
  if (panels.empty()) {
    throw InputError(
        "nothing to plot: the records have no loss, accuracy, throughput or "
        "learning rate values");
  }

  Page page;
  page.width = opts.width;
  page.style.f = std::clamp(opts.width / static_cast<double>(kDefaultWidth), 0.6, 2.5);
  page.cols = panels.size() > 1 && opts.width >= 640 ? 2 : 1;
  page.rows = static_cast<int>((panels.size() + page.cols - 1) / page.cols);
  page.title = !opts.title.empty() ? opts.title
               : runs.size() == 1  ? std::filesystem::path(runs[0].path).filename().string()
                                   : std::to_string(runs.size()) + " runs";
  {  // the legend's rows decide the header's height; measure them on a scratch surface
    Surface scratch(cairo_image_surface_create(CAIRO_FORMAT_RGB24, 1, 1), cairo_surface_destroy);
    Context cr(cairo_create(scratch.get()), cairo_destroy);
    cairo_font_options_t* fo = cairo_font_options_create();
    cairo_font_options_set_hint_metrics(fo, CAIRO_HINT_METRICS_OFF);
    cairo_set_font_options(cr.get(), fo);
    cairo_font_options_destroy(fo);
    page.legend = layout_legend(cr.get(), runs, page.style, opts.width);
    CAIRO_CHECK(cairo_status(cr.get()));
  }
  const Style& st = page.style;
  page.header = st.pad() + st.title_size() * 1.6 + page.legend.height + st.pad();
  page.height =
      opts.height != 0
          ? opts.height
          : std::min(kMaxSize, static_cast<int>(std::ceil(page.header + st.pad() +
                                                          page.rows * kDefaultPanelHeight * st.f)));
  write_atomically(opts.output, render(format, page, panels, runs));

  PlotSummary summary{page.width, page.height, {}};
  for (const Panel& p : panels) summary.panels.push_back(p.title);
  return summary;
}

}  // namespace lockstep::plot
