// Between the logger and a progress bar that shares its terminal (src/io/progress.cpp).
#pragma once

namespace lockstep::detail {

// Note [Open progress line]
// A progress bar on a terminal is a line without its '\n': it is redrawn in place with '\r'. A
// log line written then would land on the bar's line, so the bar says that its line is open and
// the logger ends that line (a '\n' to stdout, where the bar is) before it writes. The next
// redraw of the bar starts on a fresh line below.
void set_progress_line_open(bool open);

}  // namespace lockstep::detail
