#include "results.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <stdexcept>
#include <tuple>

namespace kvp::bench {

namespace {

json budget_json(int64_t budget) { return budget == kUnbounded ? json(nullptr) : json(budget); }
int64_t budget_of(const json& value) { return value.is_null() ? kUnbounded : value.get<int64_t>(); }

bool is_percent_metric(const std::string& metric) { return metric != "mean_nll"; }

std::string format_fixed(double value, int decimals) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f", decimals, value);
    return buf;
}

std::string shortest(double value) {
    char buf[64];
    const auto result = std::to_chars(buf, buf + sizeof buf, value);
    return std::string(buf, result.ptr);
}

std::string csv_field(const std::string& value) {
    if (value.find_first_of(",\"\n\r") == std::string::npos) return value;
    std::string quoted = "\"";
    for (char c : value) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
    return quoted + "\"";
}

struct Moments {
    double mean = 0, stderr_ = 0;
};

Moments moments(const std::vector<double>& values) {
    Moments m;
    if (values.empty()) return m;
    for (double v : values) m.mean += v;
    m.mean /= double(values.size());
    if (values.size() > 1) {
        double ss = 0;
        for (double v : values) ss += (v - m.mean) * (v - m.mean);
        m.stderr_ = std::sqrt(ss / double(values.size() - 1) / double(values.size()));
    }
    return m;
}

}  // namespace

std::string display_label(const std::string& label) {
    const bool prefixed = label.rfind("kvp:", 0) == 0;
    const std::string suffix = ".kvp.bin";
    const bool is_file = label.size() > suffix.size() && label.compare(label.size() - suffix.size(), suffix.size(), suffix) == 0;
    if (!prefixed && !is_file) return label;
    std::string name = prefixed ? label.substr(4) : label;
    name = name.substr(name.find_last_of('/') + 1);  // npos + 1 == 0
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
        name.resize(name.size() - suffix.size());
    return "kvp:" + name;
}

double round_to_cents(double value) {
    // printf rounds the exact binary value half-to-even, as Python's round(value, 2) does.
    return std::strtod(format_fixed(value, 2).c_str(), nullptr);
}

// --- keys and the log -------------------------------------------------------------------------------------------

std::string RecordKey::str() const {
    const char sep = '\x1f';
    return model + sep + protocol + sep + variant + sep + task + sep + std::to_string(length) + sep +
           std::to_string(index) + sep + policy + sep + std::to_string(budget) + sep + kv_mode +
           (kv_mode == kPerHeadMode ? sep + shortest(head_consensus) : std::string()) +
           (evict_unit != "token" ? sep + evict_unit : std::string());
}

RecordKey RecordKey::of(const json& r) {
    return {r.at("model").get<std::string>(),  r.at("protocol").get<std::string>(), r.at("variant").get<std::string>(),
            r.at("task").get<std::string>(),   r.at("length").get<int64_t>(),      r.at("index").get<int64_t>(),
            r.at("policy").get<std::string>(), budget_of(r.at("budget")),  r.value("kv_mode", std::string(kSharedMode)),
            r.value("head_consensus", 0.0), r.value("evict_unit", std::string("token"))};
}

void RecordKey::write_to(json& r) const {
    r["model"] = model;
    r["protocol"] = protocol;
    r["variant"] = variant;
    r["task"] = task;
    r["length"] = length;
    r["index"] = index;
    r["policy"] = policy;
    r["kv_mode"] = kv_mode;
    if (kv_mode == kPerHeadMode) r["head_consensus"] = head_consensus;
    if (evict_unit != "token") r["evict_unit"] = evict_unit;
    r["budget"] = budget_json(budget);
}

ResultLog::ResultLog(const std::string& path) : path_(path) {
    bool ends_with_newline = true;
    if (std::ifstream in(path_); in) {
        for (std::string line; std::getline(in, line);) {
            ends_with_newline = !in.eof();
            if (line.empty()) continue;
            try {
                json record = json::parse(line);
                keys_.insert(RecordKey::of(record).str());
                records_.push_back(std::move(record));
            } catch (const json::exception&) {
                ++skipped_lines_;
            }
        }
    }
    out_.open(path_, std::ios::app);
    if (!out_) throw std::runtime_error("cannot open the results log " + path_ + " for appending");
    if (!ends_with_newline) out_ << '\n';  // after an interrupted line, so the next record starts a line of its own
}

void ResultLog::append(const json& record) {
    keys_.insert(RecordKey::of(record).str());
    records_.push_back(record);
    // A prediction cut off inside a multi-byte character is not valid UTF-8: its stray bytes are written as U+FFFD.
    out_ << json_text(record) << '\n';
    out_.flush();
    if (!out_) throw std::runtime_error("cannot write to the results log " + path_);
}

// --- rows -------------------------------------------------------------------------------------------------------

void to_json(json& j, const ResultRow& row) {
    j = json{{"policy", row.policy},
             {"kv_mode", row.kv_mode},
             {"budget", budget_json(row.budget)},
             {"task", row.task},
             {"length", row.length},
             {"protocol", row.protocol},
             {"variant", row.variant},
             {"metric", row.metric},
             {"score", row.score},
             {"stderr", row.stderr_},
             {"n", row.n},
             {"cells_max", row.cells_max},
             {"llama_cells_max", row.llama_cells_max},
             {"prompt_tokens", row.prompt_tokens},
             {"decoded_tokens", row.decoded_tokens},
             {"generated_tokens", row.generated_tokens},
             {"seconds", row.seconds},
             {"evict_unit", row.evict_unit}};  // always, so that the CSV has one fixed set of columns
}

std::vector<ResultRow> aggregate(const std::vector<const json*>& records, const std::vector<std::string>& variant_order,
                                 const std::vector<std::string>& policy_order, const std::vector<std::string>& task_order) {
    auto rank = [](const std::vector<std::string>& order, const std::string& name) {
        return std::find(order.begin(), order.end(), name) - order.begin();
    };
    using GroupKey = std::tuple<std::ptrdiff_t, std::ptrdiff_t, bool, std::string, int64_t, std::ptrdiff_t, int64_t>;
    std::map<GroupKey, std::vector<const json*>> groups;
    for (const json* r : records) {
        const RecordKey key = RecordKey::of(*r);
        groups[{rank(variant_order, key.variant), rank(policy_order, key.policy), key.kv_mode != kSharedMode,
                key.evict_unit, key.budget, rank(task_order, key.task), key.length}]
            .push_back(r);
    }

    std::vector<ResultRow> rows;
    for (const auto& [group, members] : groups) {
        const json& first = *members.front();
        const RecordKey key = RecordKey::of(first);
        ResultRow row;
        row.policy = key.policy;
        row.kv_mode = key.kv_mode;
        row.evict_unit = key.evict_unit;
        row.budget = key.budget;
        row.task = key.task;
        row.length = key.length;
        row.protocol = key.protocol;
        row.variant = key.variant;
        row.metric = first.at("metric").get<std::string>();
        row.n = int64_t(members.size());
        std::vector<double> scores;
        for (const json* r : members) {
            scores.push_back(r->at("score").get<double>());
            row.cells_max = std::max(row.cells_max, r->at("cells_max").get<int64_t>());
            row.llama_cells_max = std::max(row.llama_cells_max, r->at("llama_cells").get<int64_t>());
            row.prompt_tokens += r->at("prompt_tokens").get<double>() / double(row.n);
            row.decoded_tokens += r->at("decoded_tokens").get<double>() / double(row.n);
            row.generated_tokens += r->at("generated_tokens").get<double>() / double(row.n);
            row.seconds += r->at("seconds").get<double>() / double(row.n);
        }
        const Moments m = moments(scores);
        row.score = is_percent_metric(row.metric) ? round_to_cents(m.mean) : m.mean;
        row.stderr_ = m.stderr_;
        rows.push_back(std::move(row));
    }
    return rows;
}

// --- table and CSV ----------------------------------------------------------------------------------------------

void print_table(std::ostream& out, const std::vector<ResultRow>& rows) {
    struct Line {
        std::string variant, policy, kv_mode, budget, task, length, score, n;
    };
    auto score_text = [](const std::string& metric, double score, double stderr_) {
        const int decimals = is_percent_metric(metric) ? 2 : 4;
        return format_fixed(score, decimals) + " ± " + format_fixed(stderr_, decimals);
    };
    auto line_of = [&](const ResultRow& r, const std::string& task, double score, double stderr_, int64_t n) {
        return Line{r.variant, display_label(r.policy) + (r.evict_unit == "word" ? " (words)" : ""), r.kv_mode,
                    r.budget == kUnbounded ? "-" : std::to_string(r.budget), task,
                    std::to_string(r.length), score_text(r.metric, score, stderr_), std::to_string(n)};
    };

    std::vector<Line> lines;
    std::set<std::string> tasks;
    for (const ResultRow& r : rows) tasks.insert(r.task);
    for (size_t i = 0; i < rows.size();) {
        // rows of one (variant, policy, budget) are contiguous; a mean over tasks per length follows them
        size_t j = i;
        while (j < rows.size() && rows[j].variant == rows[i].variant && rows[j].policy == rows[i].policy &&
               rows[j].kv_mode == rows[i].kv_mode && rows[j].evict_unit == rows[i].evict_unit &&
               rows[j].budget == rows[i].budget)
            ++j;
        std::map<int64_t, std::vector<const ResultRow*>> by_length;
        for (size_t k = i; k < j; ++k) {
            lines.push_back(line_of(rows[k], rows[k].task, rows[k].score, rows[k].stderr_, rows[k].n));
            if (is_percent_metric(rows[k].metric)) by_length[rows[k].length].push_back(&rows[k]);
        }
        if (tasks.size() > 1)
            for (const auto& [length, members] : by_length) {
                if (members.size() < 2) continue;
                double mean = 0, variance = 0;
                int64_t n = 0;
                for (const ResultRow* r : members) {
                    mean += r->score / double(members.size());
                    variance += r->stderr_ * r->stderr_ / double(members.size() * members.size());
                    n += r->n;
                }
                lines.push_back(line_of(*members.front(), "mean", round_to_cents(mean), std::sqrt(variance), n));
            }
        i = j;
    }

    const bool any_per_head =
        std::any_of(rows.begin(), rows.end(), [](const ResultRow& r) { return r.kv_mode != kSharedMode; });
    std::vector<std::vector<std::string>> cells;
    for (const Line& l : lines) {
        cells.push_back({l.variant, l.policy, l.budget, l.task, l.length, l.score, l.n});
        if (any_per_head) cells.back().insert(cells.back().begin() + 2, l.kv_mode);
    }
    std::vector<std::string> header = {"variant", "policy", "budget", "task", "length", "score ± stderr", "n"};
    std::vector<bool> right = {false, false, true, false, true, true, true};
    if (any_per_head) {
        header.insert(header.begin() + 2, "kv mode");
        right.insert(right.begin() + 2, false);
    }
    print_markdown_table(out, header, right, cells);
}

void print_markdown_table(std::ostream& out, const std::vector<std::string>& header, const std::vector<bool>& right,
                          const std::vector<std::vector<std::string>>& rows) {
    auto display_width = [](const std::string& s) {  // UTF-8 aware: "±" is two bytes, one column
        size_t n = 0;
        for (unsigned char c : s) n += (c & 0xC0) != 0x80;
        return n;
    };
    std::vector<size_t> width(header.size());
    for (size_t c = 0; c < header.size(); ++c) {
        width[c] = std::max<size_t>(3, display_width(header[c]));  // room for a "--:" separator
        for (const auto& row : rows) width[c] = std::max(width[c], display_width(row.at(c)));
    }
    auto print = [&](const std::vector<std::string>& row) {
        out << '|';
        for (size_t c = 0; c < header.size(); ++c) {
            const std::string pad(width[c] - display_width(row[c]), ' ');
            out << ' ' << (right[c] ? pad + row[c] : row[c] + pad) << " |";
        }
        out << '\n';
    };
    print(header);
    out << '|';
    for (size_t c = 0; c < header.size(); ++c)
        out << ' ' << std::string(width[c] - (right[c] ? 1 : 0), '-') << (right[c] ? ":" : "") << " |";
    out << '\n';
    for (const auto& row : rows) print(row);
}

std::vector<std::string> csv_columns() {
    const json row = ResultRow{};
    std::vector<std::string> names;
    for (const auto& item : row.items()) names.push_back(item.key());
    return names;
}

void write_csv(const std::string& path, const std::vector<ResultRow>& rows) {
    std::vector<json> objects;
    for (const ResultRow& row : rows) objects.push_back(row);
    write_csv_rows(path, csv_columns(), objects);
}

void write_csv_rows(const std::string& path, const std::vector<std::string>& columns, const std::vector<json>& rows) {
    std::ofstream out(path);
    if (!out) throw std::runtime_error("cannot write " + path);
    for (size_t c = 0; c < columns.size(); ++c) out << (c ? "," : "") << columns[c];
    out << '\n';
    for (const json& j : rows) {
        for (size_t c = 0; c < columns.size(); ++c) {
            const json& v = j.at(columns[c]);
            std::string text;
            if (v.is_null()) text = "";
            else if (v.is_string()) text = v.get<std::string>();
            else if (v.is_number_float()) text = shortest(v.get<double>());
            else text = json_text(v);
            out << (c ? "," : "") << csv_field(text);
        }
        out << '\n';
    }
    if (!out) throw std::runtime_error("cannot write " + path);
}

}  // namespace kvp::bench
