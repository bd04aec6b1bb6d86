#include "modes.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include "metrics.h"

namespace kvp::bench {

namespace {

// Prompt tokens before the question: the context alone, tokenized, shares this prefix with the whole prompt (a
// token that straddles the boundary goes to the question).
int64_t context_tokens(const Model& model, const std::string& input, const json& question_field,
                       const std::vector<llama_token>& prompt) {
    const std::string question = question_field.get<std::string>();
    const bool proper_end = !question.empty() && question.size() < input.size() &&
                            input.compare(input.size() - question.size(), question.size(), question) == 0;
    if (!proper_end)
        throw std::invalid_argument("'question' must be a non-empty proper end of 'input'");
    const std::vector<llama_token> context = model.tokenize(input.substr(0, input.size() - question.size()));
    const auto mismatch = std::mismatch(context.begin(), context.end(), prompt.begin(), prompt.end());
    const int64_t shared = int64_t(mismatch.first - context.begin());
    if (shared < 1 || shared >= int64_t(prompt.size()))
        throw std::invalid_argument("the question splits no context off the prompt");
    return shared;
}

}  // namespace

std::vector<Sample> load_task_samples(const Model& model, const std::string& path, int64_t max_per_task,
                                      int64_t max_new_tokens) {
    std::ifstream in(path);
    if (!in) throw std::invalid_argument("cannot read the tasks file " + path);
    std::vector<Sample> samples;
    std::map<std::pair<std::string, int64_t>, int64_t> taken;
    int64_t line_number = 0;
    for (std::string line; std::getline(in, line);) {
        ++line_number;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        try {
            const json record = json::parse(line);
            Sample s;
            s.task = record.at("task").get<std::string>();
            s.length = record.contains("target_length") ? record.at("target_length").get<int64_t>()
                                                        : record.at("length").get<int64_t>();
            s.index = record.at("index").get<int64_t>();
            if (max_per_task > 0 && taken[{s.task, s.length}] >= max_per_task) continue;
            ++taken[{s.task, s.length}];
            s.metric = record.at("metric").get<std::string>();
            if (!is_known_metric(s.metric)) throw std::invalid_argument("unknown metric '" + s.metric + "'");
            s.outputs = record.at("outputs").get<std::vector<std::string>>();
            if (s.outputs.empty()) throw std::invalid_argument("no reference outputs");
            s.max_new_tokens = max_new_tokens > 0 ? max_new_tokens : record.at("max_new_tokens").get<int64_t>();
            const std::string input = record.at("input").get<std::string>();
            s.prompt = model.tokenize(input + record.value("answer_prefix", std::string()));
            if (s.prompt.empty()) throw std::invalid_argument("empty prompt");
            if (record.contains("question"))
                s.context_tokens = context_tokens(model, input, record.at("question"), s.prompt);
            samples.push_back(std::move(s));
        } catch (const std::exception& e) {
            throw std::invalid_argument(path + ":" + std::to_string(line_number) + ": " + e.what());
        }
    }
    if (samples.empty()) throw std::invalid_argument("no samples in " + path);
    return samples;
}

Outcome evaluate_answer(const Sample& sample, SequenceWriter& writer, std::span<const llama_token> unfed) {
    const Model& model = writer.session().model();
    const int32_t n_vocab = model.n_vocab();
    llama_token next = -1;
    const LogitsSink pick = [&](size_t, const float* logits) { next = argmax(logits, n_vocab); };
    writer.feed(unfed, unfed.size() - 1, pick);
    std::vector<llama_token> answer;
    while (int64_t(answer.size()) < sample.max_new_tokens && !model.is_end_of_generation(next)) {
        answer.push_back(next);
        if (int64_t(answer.size()) == sample.max_new_tokens) break;
        writer.feed(std::span<const llama_token>(&answer.back(), 1), 0, pick);
    }
    Outcome outcome;
    outcome.prediction = model.detokenize(answer);
    outcome.score = sample_score(sample.metric, outcome.prediction, sample.outputs);
    outcome.generated_tokens = int64_t(answer.size());
    return outcome;
}

std::vector<Sample> load_text_samples(const Model& model, const std::string& path, int64_t ctx_tokens,
                                      int64_t cont_tokens, int64_t max_windows) {
    if (ctx_tokens < 2 || cont_tokens < 1) throw std::invalid_argument("--ctx must be >= 2 and --cont >= 1");
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::invalid_argument("cannot read the text file " + path);
    // A .jsonl file holds documents ({"text": ...} per line), each cut into its own windows, so that no window
    // spans two documents (chats, say); any other file is one document.
    std::vector<std::string> documents;
    const bool jsonl = std::filesystem::path(path).extension() == ".jsonl";
    if (jsonl) {
        std::string line;
        for (int64_t number = 1; std::getline(in, line); ++number) {
            if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
            const json document = json::parse(line, nullptr, false);
            if (document.is_discarded() || !document.is_object() || !document.contains("text") ||
                !document["text"].is_string())
                throw std::invalid_argument(path + " line " + std::to_string(number) +
                                            ": expected a JSON object with a string \"text\"");
            documents.push_back(document["text"].get<std::string>());
        }
    } else {
        std::stringstream text;
        text << in.rdbuf();
        documents.push_back(text.str());
    }
    const size_t window = size_t(ctx_tokens + cont_tokens);
    std::vector<Sample> samples;
    const std::string task = "ppl:" + std::filesystem::path(path).stem().string();
    size_t longest = 0;
    for (const std::string& document : documents) {
        const std::vector<llama_token> tokens = model.tokenize(document);
        longest = std::max(longest, tokens.size());
        for (size_t start = 0; start + window <= tokens.size(); start += window) {
            if (max_windows > 0 && int64_t(samples.size()) >= max_windows) return samples;
            Sample s;
            s.task = task;
            s.length = ctx_tokens;
            s.index = int64_t(samples.size());
            s.metric = "mean_nll";
            s.prompt.assign(tokens.begin() + start, tokens.begin() + start + ctx_tokens);
            s.continuation.assign(tokens.begin() + start + ctx_tokens, tokens.begin() + start + window);
            samples.push_back(std::move(s));
        }
    }
    if (samples.empty())
        throw std::invalid_argument(path + (jsonl ? "'s longest document has " : " has ") + std::to_string(longest) +
                                    " tokens, fewer than --ctx + --cont = " + std::to_string(window));
    return samples;
}

Outcome evaluate_continuation(const Sample& sample, SequenceWriter& writer, std::span<const llama_token> unfed) {
    const int32_t n_vocab = writer.session().model().n_vocab();
    // The logits of the last unfed token predict continuation[0]; those of continuation[i] predict [i + 1].
    std::vector<llama_token> tokens(unfed.begin(), unfed.end());
    tokens.insert(tokens.end(), sample.continuation.begin(), sample.continuation.end() - 1);
    const size_t first = unfed.size() - 1;
    double nll = 0;
    writer.feed(tokens, first, [&](size_t i, const float* logits) {
        nll += negative_log_likelihood(logits, n_vocab, sample.continuation[i - first]);
    });
    Outcome outcome;
    outcome.score = nll / double(sample.continuation.size());
    outcome.generated_tokens = int64_t(sample.continuation.size());
    return outcome;
}

}  // namespace kvp::bench
