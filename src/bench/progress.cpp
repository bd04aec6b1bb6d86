#include "progress.h"

#include <cstdio>
#include <unistd.h>

namespace kvp::bench {

std::string format_duration(double seconds) {
    const long s = long(seconds + 0.5);
    char buf[32];
    if (s >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", s / 3600, (s % 3600) / 60);
    else if (s >= 60) std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
    else std::snprintf(buf, sizeof buf, "%lds", s);
    return buf;
}

Progress::Progress(int64_t total, double log_interval)
    : total_(total), start_(Clock::now()), last_print_(start_), log_interval_(log_interval),
      interactive_(isatty(fileno(stderr)) != 0) {}

void Progress::done(const std::string& what) {
    ++done_;
    const bool due = interactive_ || std::chrono::duration<double>(Clock::now() - last_print_).count() >= log_interval_;
    if (due) print(what, false);
}

void Progress::finish() {
    if (total_ > 0) print("done", true);
}

void Progress::print(const std::string& what, bool final_line) {
    last_print_ = Clock::now();
    const double elapsed = std::chrono::duration<double>(last_print_ - start_).count();
    std::string eta = "?";
    if (done_ > 0) eta = format_duration(elapsed / double(done_) * double(total_ - done_));
    std::fprintf(stderr, "%s[kvp-bench] %lld/%lld results, %s elapsed, ETA %s  %-48s%s", interactive_ ? "\r" : "",
                 static_cast<long long>(done_), static_cast<long long>(total_), format_duration(elapsed).c_str(),
                 eta.c_str(), what.c_str(), interactive_ && !final_line ? "" : "\n");
    std::fflush(stderr);
}

}  // namespace kvp::bench
