// The progress line on stderr: results done of the total, elapsed time and an ETA from the mean time per result.
// On a terminal it is rewritten in place; in a log a line is written at most every `log_interval` seconds.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace kvp::bench {

class Progress {
public:
    Progress(int64_t total, double log_interval = 30.0);
    void done(const std::string& what);  // one more result finished
    void finish();

private:
    void print(const std::string& what, bool final_line);

    using Clock = std::chrono::steady_clock;
    int64_t total_, done_ = 0;
    Clock::time_point start_, last_print_;
    double log_interval_;
    bool interactive_;
};

std::string format_duration(double seconds);  // "2m05s", "1h02m", "45s"

}  // namespace kvp::bench
