"""Word-level eviction (kv_evict_unit="word", kvp-bench --evict-unit word): the sub-word tokens of a word are
ranked by the word's best score, so they stay or leave together."""
import json
import subprocess

import numpy as np
import pytest

import kvp_cpp
from kvp_cpp import bench
from kvp_cpp import policy_file as pf

MAX_WORD_TOKENS = 16
# coded words as in RULER's fwe task, split by the tokenizer into several pieces each
TEXT = ("Read the coded text. unotxl gecvwr unotxl toemyc esrdwz, unotxl (xqtvdn) gecvwr-lgfyfp 1234567 "
        "unotxl ysxhjk.\n" * 12)


@pytest.fixture(scope="module")
def random_policy_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("policies") / "random.kvp.bin"
    pf.write_policy(path, pf.random_policy(**pf.smollm2_identity(), hidden=(16,), seed=5))
    return str(path)


def is_word_byte(byte: int) -> bool:
    return chr(byte).isalnum() if byte < 0x80 else True


def reference_words(llm, tokens) -> list:
    """Each token's word (the logical index of its first token), from the tokens' text: a token continues the word
    of the token before it when the previous text ends with a letter or digit and its own starts with one."""
    words = []
    for i, token in enumerate(tokens):
        piece = llm.detokenize([token])
        previous = llm.detokenize([tokens[i - 1]]) if i else b""
        joins = (i > 0 and previous and piece and is_word_byte(previous[-1]) and is_word_byte(piece[0])
                 and i - words[i - 1] < MAX_WORD_TOKENS)
        words.append(words[i - 1] if joins else i)
    return words


def test_words_follow_the_tokens_text(model_path, random_policy_path):
    llm = kvp_cpp.Llama(model_path, n_ctx=1024, kv_policy=random_policy_path, kv_evict_unit="word", verbose=False)
    tokens = llm.tokenize(TEXT.encode(), add_bos=True)
    llm.eval(tokens)
    ledger = llm.kv_engine.ledger()
    assert ledger["logical"].tolist() == list(range(len(tokens)))
    expected = reference_words(llm, tokens)
    assert ledger["word"].tolist() == expected
    assert len(set(expected)) < len(tokens) - 50  # the coded words really are split into pieces here
    assert llm.kv_engine.eviction_unit == "word"
    # Token-level eviction: every token is its own word.
    plain = kvp_cpp.Llama(model_path, n_ctx=1024, kv_policy=random_policy_path, kv_evict_unit="token", verbose=False)
    plain.eval(tokens)
    assert plain.kv_engine.ledger()["word"].tolist() == list(range(len(tokens)))
    assert plain.kv_engine.eviction_unit == "token"


def test_a_long_run_without_breaks_is_cut_into_words_of_at_most_16_tokens(model_path, random_policy_path):
    llm = kvp_cpp.Llama(model_path, n_ctx=512, kv_policy=random_policy_path, kv_evict_unit="word", verbose=False)
    tokens = llm.tokenize(b" " + b"7" * 40, add_bos=False)  # one token per digit
    llm.eval(tokens)
    words = llm.kv_engine.ledger()["word"].tolist()
    assert words == reference_words(llm, tokens)
    assert max(np.bincount(words)) == MAX_WORD_TOKENS


def test_oneshot_compress_keeps_or_evicts_whole_words(model_path, random_policy_path):
    """The kept tokens are the top of sum_softmax over per-column scores that are each word's maximum, recomputed
    here in float64; every word but at most one (cut by the budget) is kept whole or evicted whole."""
    llm = kvp_cpp.Llama(model_path, n_ctx=1024, kv_policy=random_policy_path, kv_evict_unit="word", kv_sink=4,
                        kv_recent=16, verbose=False)
    tokens = llm.tokenize(TEXT.encode(), add_bos=True)
    llm.eval(tokens)
    n = len(tokens)
    before = llm.kv_engine.ledger()
    scores, words = before["scores"].astype(np.float64), before["word"]
    budget = 160
    assert llm.kv_compress(budget) == n - budget

    shared = scores.copy()
    for word in np.unique(words):
        members = words == word
        shared[members] = scores[members].max(axis=0)
    evicted = lowest(sum_softmax(shared[4:n - 16]), n - budget)
    expected = [i for i in range(n) if i - 4 not in evicted]
    after = llm.kv_engine.ledger()
    assert after["logical"].tolist() == expected
    assert after["word"].tolist() == [int(words[i]) for i in expected]
    assert len(split_words(words[4:n - 16], {i - 4 for i in expected})) <= 1
    # token-level eviction of the same scores would split many words
    by_token = lowest(sum_softmax(scores[4:n - 16]), n - budget)
    kept_by_token = set(range(n - 20)) - by_token
    assert len(split_words(words[4:n - 16], kept_by_token)) > 5


def sum_softmax(x: np.ndarray) -> np.ndarray:
    p = np.exp(x - x.max(axis=0))
    return (p / p.sum(axis=0)).sum(axis=1)


def lowest(keep: np.ndarray, n: int) -> set:
    """The n lowest keep-scores' indices, ties to the older (smaller) index, as the evictor picks victims."""
    return set(sorted(range(len(keep)), key=lambda j: (keep[j], j))[:n])


def split_words(words: np.ndarray, kept: set) -> list:
    """Words of which some tokens are kept and others are not."""
    return [w for w in np.unique(words) if len({j in kept for j in np.flatnonzero(words == w)}) > 1]


def test_decoding_under_budget_with_words_stays_within_it(model_path):
    llm = kvp_cpp.Llama(model_path, n_ctx=128, kv_policy="kvp", kv_evict_unit="word", verbose=False)
    llm.eval(llm.tokenize(TEXT.encode(), add_bos=True))
    assert llm.kv_stats()["cells_used"] <= 128 and llm.kv_stats()["tokens_evicted"] > 0
    text = llm.create_completion(" unotxl", max_tokens=6, temperature=0.0)["choices"][0]["text"]
    assert isinstance(text, str) and llm.kv_stats()["cells_used"] <= 128


def test_state_carries_the_words_and_refuses_another_unit(model_path, random_policy_path):
    llm = kvp_cpp.Llama(model_path, n_ctx=96, kv_policy=random_policy_path, kv_evict_unit="word", verbose=False)
    llm.eval(llm.tokenize(TEXT.encode(), add_bos=True)[:300])
    words = llm.kv_engine.ledger()["word"].tolist()
    state = llm.save_state()
    first = llm.create_completion(" unotxl", max_tokens=6, temperature=0.0)["choices"][0]["text"]
    llm.load_state(state)
    assert llm.kv_engine.ledger()["word"].tolist() == words
    assert llm.create_completion(" unotxl", max_tokens=6, temperature=0.0)["choices"][0]["text"] == first

    tokens = kvp_cpp.Llama(model_path, n_ctx=96, kv_policy=random_policy_path, kv_evict_unit="token", verbose=False)
    with pytest.raises(ValueError, match="kv_evict_unit='word'"):
        tokens.load_state(state)


def test_words_are_the_default_unit_wherever_there_is_eviction(model_path, random_policy_path):
    default = kvp_cpp.Llama(model_path, n_ctx=96, kv_policy=random_policy_path, verbose=False)
    assert default.kv_engine.eviction_unit == "word"
    default.eval(default.tokenize(TEXT.encode(), add_bos=True)[:300])
    ledger = default.kv_engine.ledger()
    assert (ledger["word"] != ledger["logical"]).any()  # some kept token continues the word of the one before it
    explicit = kvp_cpp.Llama(model_path, n_ctx=96, kv_policy=random_policy_path, kv_evict_unit="word", verbose=False)
    explicit.eval(explicit.tokenize(TEXT.encode(), add_bos=True)[:300])
    for column in ("word", "logical"):
        assert explicit.kv_engine.ledger()[column].tolist() == ledger[column].tolist()
    token = kvp_cpp.Llama(model_path, n_ctx=96, kv_policy=random_policy_path, kv_evict_unit="token", verbose=False)
    assert token.kv_engine.eviction_unit == "token"
    token.eval(token.tokenize(TEXT.encode(), add_bos=True)[:300])
    assert token.kv_engine.ledger()["logical"].tolist() != ledger["logical"].tolist()
    full = kvp_cpp.Llama(model_path, n_ctx=96, verbose=False)  # no policy, no engine: the unit does not apply
    assert full.kv_engine is None


def test_bad_word_arguments_raise_value_error(model_path, random_policy_path):
    with pytest.raises(ValueError, match="kv_evict_unit must be one of"):
        kvp_cpp.Llama(model_path, n_ctx=128, kv_policy="streaming", kv_evict_unit="letter", verbose=False)
    with pytest.raises(ValueError, match="needs a kv_policy"):
        kvp_cpp.Llama(model_path, n_ctx=128, kv_evict_unit="word", verbose=False)
    llm = kvp_cpp.Llama(model_path, n_ctx=128, kv_policy=random_policy_path, kv_evict_unit="word", verbose=False)
    engine = llm.kv_engine
    with pytest.raises(ValueError, match="needs the batch's token ids"):
        engine.begin_batch(2)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.begin_batch(2, [1, llm.n_vocab()])
    with pytest.raises(ValueError, match="2 token ids for 3 tokens"):
        engine.begin_batch(3, [1, 2])
    assert engine.logical_length == 0  # nothing was recorded


def test_kvp_bench_keys_records_by_eviction_unit(tmp_path, model_path, random_policy_path):
    from kvp_cpp.ruler import LlamaTokenizer, generate

    tasks = tmp_path / "fwe.jsonl"
    with open(tasks, "w", encoding="utf-8") as f:
        for record in generate("fwe", 700, 1, LlamaTokenizer(model_path)):
            f.write(json.dumps(record) + "\n")
    out = tmp_path / "r.json"
    common = [bench.binary_path(), "-m", model_path, "--tasks", str(tasks), "--policies",
              f"full,kvp:{random_policy_path}", "--budgets", "128", "--variants", "question_included",
              "--max-new-tokens", "6", "-o", str(out)]
    for unit in ("token", "word", None):  # the default is word: the last run resumes every record
        flags = [] if unit is None else ["--evict-unit", unit]
        result = subprocess.run([*common, *flags], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    assert "2 results (2 resumed)" in result.stderr and "kvp:random (words)" in result.stdout
    records = [json.loads(line) for line in open(str(out)[: -len(".json")] + ".samples.jsonl", encoding="utf-8")]
    units = sorted((r["policy"] == "full", r.get("evict_unit", "token")) for r in records)
    assert units == [(False, "token"), (False, "word"), (True, "token")]
    document = json.load(open(out, encoding="utf-8"))
    assert document["config"]["evict_unit"] == "word"
    assert {(r["policy"] == "full", r["evict_unit"]) for r in document["results"]} == {(True, "token"), (False, "word")}
    word = next(r for r in records if r.get("evict_unit") == "word")
    token = next(r for r in records if r["policy"] != "full" and "evict_unit" not in r)
    assert word["compressed_cells"] == token["compressed_cells"] == 128
    assert word["kept_digest"] != token["kept_digest"]
    bad = subprocess.run([*common, "--evict-unit", "letter"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown eviction unit 'letter'" in bad.stderr
