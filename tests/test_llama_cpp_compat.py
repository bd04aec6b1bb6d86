# llama-cpp-python's own tests, adapted to run against ``kvp_cpp.Llama``.
#
# Derived from llama-cpp-python's test suite (https://github.com/abetlen/llama-cpp-python):
# tests/test_llama.py of the 0.3.36 sdist, tests/test_llama_grammar.py of the same sdist, and four tests
# (test_llama_patch, test_llama_pickle, test_utf8, test_logits_to_logprobs) that upstream's tests/test_llama.py
# carried in its 0.2.x releases and no longer carries in 0.3.36.
#
#   MIT License
#
#   Copyright (c) 2023 Andrei Betlen
#
#   Permission is hereby granted, free of charge, to any person obtaining a copy of this software and associated
#   documentation files (the "Software"), to deal in the Software without restriction, including without limitation
#   the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell copies of the Software, and
#   to permit persons to whom the Software is furnished to do so, subject to the following conditions:
#
#   The above copyright notice and this permission notice shall be included in all copies or substantial portions
#   of the Software.
#
#   THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT LIMITED
#   TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL
#   THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF
#   CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER
#   DEALINGS IN THE SOFTWARE.
#
# What changed against upstream, everywhere:
#
# - Every model (upstream: a vocab-only llama-spm GGUF from the source tree and four HF-hub downloads) is the
#   bundled SmolLM2-135M-Instruct Q4_1 (``kvp_cpp.default_model_path()``); nothing is downloaded. Exact strings
#   and token ids are SmolLM2's (it adds no BOS, its EOS is ``<|im_end|>`` = 2, it is a byte-level BPE).
# - ``n_threads``/``n_threads_batch`` are 1 instead of ``multiprocessing.cpu_count()`` (2 shared cores: a spinning
#   second thread makes every decode several times slower).
# - Every test that builds a ``Llama`` runs under each configuration of ``CONFIGS``:
#     plain           kv_policy=None: must behave exactly as upstream ``llama_cpp.Llama`` with this model;
#     no-evict        kv_policy="streaming", default budget (= n_ctx): must give the same outputs as ``plain``
#                     (checked against a recorded ``plain`` run) and never evict;
#     evict-streaming kv_policy="streaming", kv_budget=64  } prompts get a 108-token preamble (``FILLER``) so the
#     evict-random    kv_policy="random",    kv_budget=64  } cache must evict; exact generated text is replaced by
#                     "well-formed, and the cache stayed within the budget"; every structural assertion stays.
#
# Correspondence (ours -> upstream):
#   test_llama_cpp_version                       test_llama.py::test_llama_cpp_version
#   test_llama_cpp_tokenization                  test_llama.py::test_llama_cpp_tokenization (token ids -> SmolLM2's)
#   test_vocab_only_construction                 test_llama.py::test_llama_cpp_tokenization (its vocab_only=True load)
#   test_real_model                              test_llama.py::test_real_model (low-level API; no Llama involved)
#   test_real_llama                              test_llama.py::test_real_llama
#   test_real_llama_repeated_prompt_cache        test_llama.py::test_real_llama_repeated_prompt_cache
#   test_prompt_cache_reset_handles_history_edit test_llama.py::_assert_prompt_cache_reset_handles_history_edit
#                                                (upstream runs it only for a recurrent and a hybrid model)
#   test_exact_cached_prompt_reuse_matches_fresh         test_llama.py::same name, [llama_cpp_transformer_model_path]
#   test_loaded_exact_cached_prompt_reuse_matches_fresh  test_llama.py::same name, [llama_cpp_transformer_model_path]
#   test_ram_cache_exact_prompt_hit_matches_fresh        test_llama.py::same name, [llama_cpp_transformer_model_path]
#   test_shorter_prompt_prefix_reuse_matches_fresh       test_llama.py::same name, [llama_cpp_transformer_model_path]
#   test_needs_recurrent_or_hybrid_model         the [recurrent]/[hybrid] cases of the four tests above, and
#                                                test_recurrent_model_prompt_cache_reset,
#                                                test_hybrid_model_prompt_cache_reset (skipped: see the reasons)
#   test_real_llama_embeddings                   test_llama.py::test_real_llama_embeddings
#   test_llama_patch                             0.2.x test_llama.py::test_llama_patch (completion / streaming /
#                                                stop / length), the mocked llama_decode replaced by a logits
#                                                processor that forces the same text through the real decode path
#   test_utf8                                    0.2.x test_llama.py::test_utf8 (same forcing technique)
#   test_llama_pickle                            0.2.x test_llama.py::test_llama_pickle
#   test_logits_to_logprobs                      0.2.x test_llama.py::test_logits_to_logprobs (numpy reference
#                                                instead of scipy.special.log_softmax)
#   test_json_schema_grammar_completion          test_llama_grammar.py::test_composed_pydantic_grammar and
#                                                ::test_grammar_anyof (upstream only builds the grammars; here they
#                                                constrain a completion and the output must parse)
#   test_chat_completion                         none upstream (test_llama_chat_format.py tests formatters only):
#                                                create_chat_completion, plain and streaming, and a second turn
#   test_state_round_trip_continuation           extends test_real_llama's save_state/load_state check to a
#                                                continuation decoded from the restored cache itself
from __future__ import annotations

import gc
import itertools
import json
import pickle
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

import llama_cpp
import llama_cpp._internals as internals

import kvp_cpp

MODEL = kvp_cpp.default_model_path()
THREADS = dict(n_threads=1, n_threads_batch=1)
BUDGET = 64

#: 108 SmolLM2 tokens put in front of every prompt of the evicting configurations, so a budget of 64 must evict.
FILLER = (
    "Background notes. The river town of Alder Bend sits where two slow rivers meet. Its market opens at dawn, "
    "when farmers bring apples, pears, cheese and bread from the hills, and fishermen sell the night's catch from "
    "flat wooden boats. The old stone bridge was built three hundred years ago and still carries every cart into "
    "town. In winter the rivers freeze and children skate between the boats. In summer the meadows flood, and the "
    "whole town gathers for a festival of music, lanterns and long tables of food. End of notes.\n\n"
)

NUMBER_GRAMMAR = """
root ::= "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9" | "10"
"""


# ----------------------------------------------------------------------------------------------- configurations


class Config:
    """One way of constructing the Llama under test, plus the checks that depend on it."""

    def __init__(self, name: str, kind: str, kv: dict):
        self.name, self.kind, self.kv = name, kind, kv
        self._shared = {}
        self._owned = []

    @property
    def policy(self):
        return self.kv.get("kv_policy")

    @property
    def evicts(self) -> bool:
        return self.kind == "evict"

    def new(self, **kwargs) -> kvp_cpp.Llama:
        """A fresh Llama of this configuration (upstream tests that compare instances need fresh ones)."""
        args = dict(THREADS, verbose=False)
        args.update(kwargs)
        args.update(self.kv)
        llm = kvp_cpp.Llama(MODEL, **args)
        self._owned.append(llm)
        return llm

    def shared(self, **kwargs) -> kvp_cpp.Llama:
        """The module's Llama of this configuration for these arguments, loaded once, reset before each use."""
        key = tuple(sorted(kwargs.items()))
        if key not in self._shared:
            self._shared[key] = self.new(**kwargs)
        llm = self._shared[key]
        llm.reset()
        return llm

    def prompt(self, text: str) -> str:
        return FILLER + text if self.evicts else text

    def evicted(self, llm) -> int:
        return llm.kv_stats()["tokens_evicted"] if self.policy else 0

    def check_cache(self, llm, evicted_before: int = 0) -> None:
        """The budget held; no-evict never evicted; evicting configurations did evict (since ``evicted_before``)."""
        if self.policy is None:
            assert llm.kv_engine is None
            with pytest.raises(ValueError):
                llm.kv_stats()
            return
        stats = llm.kv_stats()
        assert stats["policy"] == self.policy
        assert stats["budget"] == (self.kv.get("kv_budget") or llm.context_params.n_ctx)
        assert 0 <= stats["cells_used"] <= stats["budget"]
        assert stats["n_ctx_cells"] >= stats["budget"]
        if self.evicts:
            assert stats["tokens_evicted"] > evicted_before, f"{self.name}: nothing was evicted: {stats}"
        else:
            assert stats["tokens_evicted"] == 0, f"{self.name}: evicted although the budget is n_ctx: {stats}"

    def close(self):
        for llm in self._owned:
            llm.close()
        self._owned.clear()
        self._shared.clear()


CONFIGS = {
    "plain": Config("plain", "plain", {}),
    "no-evict": Config("no-evict", "noevict", {"kv_policy": "streaming"}),
    "evict-streaming": Config("evict-streaming", "evict", {"kv_policy": "streaming", "kv_budget": BUDGET}),
    "evict-random": Config("evict-random", "evict", {"kv_policy": "random", "kv_budget": BUDGET}),
}
PLAIN = CONFIGS["plain"]

#: Outputs of the plain configuration, per scenario; no-evict must reproduce them exactly.
_PLAIN_RESULTS = {}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def cfg(request):
    config = CONFIGS[request.param]
    yield config
    config.close()


@pytest.fixture(scope="module", autouse=True)
def _close_reference_models():
    yield
    for config in CONFIGS.values():
        config.close()


def plain_result(name, scenario):
    """What ``scenario`` gives under the plain configuration (recorded by the plain test, else computed now)."""
    if name not in _PLAIN_RESULTS:
        _PLAIN_RESULTS[name] = scenario(PLAIN)
    return _PLAIN_RESULTS[name]


def record_or_compare(cfg, name, scenario, result):
    """plain records its result; no-evict must be identical to plain. Returns True for those two."""
    if cfg.kind == "plain":
        _PLAIN_RESULTS[name] = result
        return True
    if cfg.kind == "noevict":
        assert result == plain_result(name, scenario), f"{cfg.name} differs from llama_cpp.Llama without a policy"
        return True
    return False


def assert_completion(output, *, stream_chunk=False, logprobs=False):
    """The structure of a (non-streaming, or one streamed chunk of a) text completion."""
    assert isinstance(output, dict)
    assert output["id"].startswith("cmpl-")
    assert output["object"] == "text_completion"
    assert isinstance(output["created"], int)
    assert output["model"] == MODEL
    assert len(output["choices"]) == 1
    choice = output["choices"][0]
    assert isinstance(choice["text"], str)
    assert choice["index"] == 0
    if not logprobs:
        assert choice["logprobs"] is None
    if stream_chunk:
        assert choice["finish_reason"] in (None, "stop", "length")
        assert "usage" not in output
    else:
        assert choice["finish_reason"] in ("stop", "length")
        usage = output["usage"]
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] >= 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def text_of(output) -> str:
    return output["choices"][0]["text"]


# ------------------------------------------------------------------------------------ test_llama.py (0.3.36)


def test_llama_cpp_version():
    assert llama_cpp.__version__
    assert llama_cpp.__version__ == "0.3.36"  # the version kvp-cpp pins
    assert issubclass(kvp_cpp.Llama, llama_cpp.Llama)


def test_llama_cpp_tokenization(cfg):
    # upstream loads a vocab-only model; tokenization does not depend on it (test_vocab_only_construction below
    # covers that load), so the configuration's full model is used here.
    llama = cfg.shared(n_ctx=64)

    assert llama
    assert llama._ctx.ctx is not None

    text = b"Hello World"

    tokens = llama.tokenize(text)
    # SmolLM2's tokenizer adds no BOS (tokenizer.ggml.add_bos_token = false), whatever add_bos says
    assert llama.metadata["tokenizer.ggml.add_bos_token"] == "false"
    assert tokens[0] != llama.token_bos()
    assert tokens == [19556, 2260]
    detokenized = llama.detokenize(tokens)
    assert detokenized == text

    tokens = llama.tokenize(text, add_bos=False)
    assert tokens[0] != llama.token_bos()
    assert tokens == [19556, 2260]

    detokenized = llama.detokenize(tokens)
    # upstream: != text (SentencePiece drops the leading space of a BOS-less sequence); byte-level BPE does not
    assert detokenized == text

    text = b"Hello World<|im_end|>"  # SmolLM2's EOS (upstream: "</s>")
    tokens = llama.tokenize(text)
    assert tokens[-1] != llama.token_eos()
    assert tokens == [19556, 2260, 44, 108, 306, 79, 486, 108, 46]

    tokens = llama.tokenize(text, special=True)
    assert tokens[-1] == llama.token_eos()
    assert tokens == [19556, 2260, 2]

    text = b""
    tokens = llama.tokenize(text, add_bos=True, special=True)
    assert tokens == []  # upstream: [bos]; SmolLM2 adds none
    assert text == llama.detokenize(tokens)


def test_vocab_only_construction(cfg):
    # The load of upstream's test_llama_cpp_tokenization: Llama(model_path, vocab_only=True). Run in a child
    # process so that an abort inside llama.cpp fails this test instead of killing the whole session.
    script = textwrap.dedent(
        f"""
        import kvp_cpp
        try:
            llama = kvp_cpp.Llama({MODEL!r}, vocab_only=True, verbose=False, **{cfg.kv!r})
        except ValueError as error:
            print("VALUEERROR", error)
        else:
            assert llama._ctx.ctx is not None
            assert llama.detokenize(llama.tokenize(b"Hello World")) == b"Hello World"
            print("OK", llama.tokenize(b"Hello World"))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (
        f"Llama(vocab_only=True, **{cfg.kv}) killed the interpreter (exit {done.returncode}):\n"
        + "\n".join(line for line in done.stderr.splitlines() if "error" in line.lower() or " in " in line)[:3000]
    )
    if cfg.policy is None:
        assert done.stdout.startswith("OK [19556, 2260]"), done.stdout
    else:
        # either it works (tokenizer only), or it is refused cleanly
        assert done.stdout.startswith("OK [19556, 2260]") or (
            done.stdout.startswith("VALUEERROR") and "vocab_only" in done.stdout
        ), done.stdout


def test_real_model():
    # Low-level API only (LlamaModel / LlamaContext / LlamaSampler): no Llama subclass is involved, so it runs
    # once, not per configuration; it checks the llama.cpp build kvp_cpp binds to.
    params = llama_cpp.llama_model_default_params()
    if llama_cpp.llama_supports_mmap() and llama_cpp.llama_supports_mlock():
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK
    elif llama_cpp.llama_supports_mlock():
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MLOCK
    elif llama_cpp.llama_supports_mmap():
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
    else:
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
    params.check_tensors = False

    model = internals.LlamaModel(path_model=MODEL, params=params)

    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = 16
    cparams.n_batch = 16
    cparams.n_ubatch = 16
    cparams.n_threads = THREADS["n_threads"]
    cparams.n_threads_batch = THREADS["n_threads_batch"]
    cparams.logits_all = False
    cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED

    context = internals.LlamaContext(model=model, params=cparams)
    tokens = model.tokenize(b"Hello, world!", add_bos=True, special=True)

    assert tokens == [19556, 28, 905, 17]  # upstream (Qwen3.5): [9419, 11, 1814, 0]

    tokens = model.tokenize(
        b"The quick brown fox jumps over the lazy dog. The quick brown fox jumps ",
        add_bos=True,
        special=True,
    )
    prompt_token_count = len(tokens)
    assert prompt_token_count == 16  # fits n_batch

    batch = internals.LlamaBatch(n_tokens=len(tokens), embd=0, n_seq_max=1)

    seed = 1337
    sampler = internals.LlamaSampler()
    sampler.add_top_k(50)
    sampler.add_top_p(0.9, 1)
    sampler.add_temp(0.8)
    sampler.add_dist(seed)

    result = tokens
    n_eval = 0
    for _ in range(4):
        batch.set_batch(tokens, n_past=n_eval, logits_all=False)
        context.decode(batch)
        n_eval += len(tokens)
        token_id = sampler.sample(context, -1)
        tokens = [token_id]
        result += tokens

    output = result[prompt_token_count:]
    output_text = model.detokenize(output, special=True)
    assert len(output) == 4
    assert output_text

    model.close()
    assert context.ctx is None


def _real_llama_scenario(cfg):
    """test_real_llama, returning every observable output."""
    model = cfg.shared(n_ctx=32, n_batch=32, n_ubatch=32, logits_all=False, flash_attn=True)
    evicted = cfg.evicted(model)
    out = {}

    output = model.create_completion(
        cfg.prompt("The quick brown fox jumps over the lazy dog. The quick brown fox"),
        max_tokens=6,
        top_k=50,
        top_p=0.9,
        temperature=0.0,
        seed=1337,
    )
    assert_completion(output)
    out["fox"] = text_of(output)

    output = model.create_completion(
        cfg.prompt("The capital of france is paris, 'true' or 'false'?:\n"),
        max_tokens=4,
        top_k=50,
        top_p=0.9,
        temperature=0.8,
        seed=1337,
        grammar=llama_cpp.LlamaGrammar.from_string("""
root ::= "true" | "false"
"""),
    )
    assert_completion(output)
    out["grammar"] = text_of(output)

    suffix = b"rot"
    tokens = model.tokenize(suffix, add_bos=True, special=True)
    seen = []

    def logit_processor_func(input_ids, logits):
        seen.append([float(logits[token]) for token in tokens])
        for token in tokens:
            logits[token] *= 1000
        return logits

    logit_processors = llama_cpp.LogitsProcessorList([logit_processor_func])

    output = model.create_completion(
        cfg.prompt("The capital of france is par"),
        max_tokens=4,
        top_k=50,
        top_p=0.9,
        temperature=0.8,
        seed=1337,
        logits_processor=logit_processors,
    )
    assert_completion(output)
    out["processor"] = text_of(output)
    out["processor_calls"] = len(seen)
    out["processor_first_logits"] = seen[0] if seen else None

    model.set_seed(1337)

    state = model.save_state()

    numbers = []
    for i in range(3):
        if i == 2:
            model.load_state(state)
        output = model.create_completion(
            cfg.prompt("Pick a number from 1 to 10?:\n"),
            max_tokens=4,
            top_k=50,
            top_p=0.9,
            temperature=1.0,
            grammar=llama_cpp.LlamaGrammar.from_string(NUMBER_GRAMMAR),
        )
        assert_completion(output)
        numbers.append(text_of(output))
    out["numbers"] = numbers
    cfg.check_cache(model, evicted)
    return out


def test_real_llama(cfg):
    out = _real_llama_scenario(cfg)
    number_1, number_2, number_3 = out["numbers"]

    # structure, in every configuration
    assert out["grammar"] in ("true", "false")
    assert out["processor_calls"] == 4  # once per sampled token
    assert all(n in [str(i) for i in range(1, 11)] for n in out["numbers"])
    # the logits processor's effect: a positive logit times 1000 wins the first token
    if out["processor_first_logits"][0] > 0:
        assert out["processor"].lower().startswith("rot")
    # save_state/load_state: the same seed after load gives the same number as before saving
    assert number_1 == number_3

    if record_or_compare(cfg, "real_llama", _real_llama_scenario, out):
        # upstream's exact expectations, with SmolLM2's strings
        assert out["fox"] == " is a classic example of a"  # upstream (Qwen3.5): " jumps over the lazy dog."
        assert out["grammar"] == "true"
        assert out["processor"].lower().startswith("rot")
        assert number_1 != number_2


def _repeated_prompt_cache_scenario(cfg):
    model = cfg.shared(n_ctx=32, n_batch=32, n_ubatch=32, logits_all=False, flash_attn=True)
    evicted = cfg.evicted(model)
    prompt = cfg.prompt("The quick brown fox jumps over the lazy dog. The quick brown fox")

    output_1 = model.create_completion(prompt, max_tokens=6, temperature=0.0, seed=1337)
    output_2 = model.create_completion(prompt, max_tokens=6, temperature=0.0, seed=1337)
    assert_completion(output_1)
    assert_completion(output_2)
    cfg.check_cache(model, evicted)
    return text_of(output_1), text_of(output_2)


def test_real_llama_repeated_prompt_cache(cfg):
    text_1, text_2 = _repeated_prompt_cache_scenario(cfg)
    # Repeating a prompt must not change a greedy completion, evicting or not: a second call either reuses the
    # cache or (when the prefix was evicted) re-prefills the same prompt under the same budget.
    assert text_2 == text_1
    if record_or_compare(cfg, "repeated_prompt_cache", _repeated_prompt_cache_scenario, (text_1, text_2)):
        assert text_1 == " is a classic example of a"  # upstream (Qwen3.5): " jumps over the lazy dog."


def _history_edit_scenario(cfg):
    model = cfg.shared(n_ctx=32, n_batch=32, n_ubatch=32, logits_all=False)
    evicted = cfg.evicted(model)

    assert model._is_recurrent is False
    assert model._is_hybrid is False

    first_prompt = cfg.prompt("The quick brown fox")
    second_prompt = cfg.prompt("The slow brown fox")
    first_tokens = model.tokenize(first_prompt.encode(), add_bos=True, special=True)
    second_tokens = model.tokenize(second_prompt.encode(), add_bos=True, special=True)

    assert first_tokens != second_tokens
    assert first_tokens[0] == second_tokens[0]

    first_output = model.create_completion(first_prompt, max_tokens=1, temperature=0.0)
    assert isinstance(first_output["choices"][0]["text"], str)
    assert_completion(first_output)

    second_output = model.create_completion(second_prompt, max_tokens=1, temperature=0.0)
    assert isinstance(second_output["choices"][0]["text"], str)
    assert_completion(second_output)
    cfg.check_cache(model, evicted)
    return text_of(first_output), text_of(second_output)


def test_prompt_cache_reset_handles_history_edit(cfg):
    out = _history_edit_scenario(cfg)
    record_or_compare(cfg, "history_edit", _history_edit_scenario, out)


def _create_test_model(cfg):
    return cfg.new(n_ctx=64, n_batch=64, n_ubatch=64, logits_all=False)


def _generate_test_tokens(model, tokens, max_tokens=3):
    return list(itertools.islice(model.generate(tokens, temp=0.0), max_tokens))


def _eval_alternate_same_length_prompt(model, tokens, expected_next_token):
    replacement_tokens = (
        model.token_eos(),
        model.token_nl(),
        0,
        1,
        2,
        model.n_vocab() - 1,
    )

    for replacement_token in replacement_tokens:
        alternate_tokens = list(tokens)
        alternate_tokens[-1] = replacement_token
        if alternate_tokens == tokens:
            continue

        model.reset()
        model.eval(alternate_tokens)
        if model.sample(temp=0.0, idx=len(tokens) - 1) != expected_next_token:
            return

    raise AssertionError("failed to find an alternate same-length prompt")


def _exact_cached_prompt_reuse_scenario(cfg):
    prompt = cfg.prompt("The quick brown fox")
    fresh = _create_test_model(cfg)
    tokens = fresh.tokenize(prompt.encode(), add_bos=True, special=True)

    assert fresh._is_recurrent is False
    assert fresh._is_hybrid is False

    expected_tokens = _generate_test_tokens(fresh, tokens)

    cached = _create_test_model(cfg)
    cached.eval(tokens)
    assert cached.n_tokens == len(tokens)
    assert cached.input_ids[: cached.n_tokens].tolist() == tokens
    assert cached.sample(temp=0.0, idx=len(tokens) - 1) == expected_tokens[0]

    reset_calls = 0
    original_reset = cached.reset

    def reset_tracker():
        nonlocal reset_calls
        reset_calls += 1
        original_reset()

    cached.reset = reset_tracker

    cached_tokens = _generate_test_tokens(cached, tokens)
    assert reset_calls == 0
    assert cached_tokens == expected_tokens
    assert cached.n_tokens == len(tokens) + len(cached_tokens) - 1
    cfg.check_cache(fresh)
    cfg.check_cache(cached)
    return expected_tokens


def test_exact_cached_prompt_reuse_matches_fresh(cfg):
    out = _exact_cached_prompt_reuse_scenario(cfg)
    record_or_compare(cfg, "exact_cached_prompt_reuse", _exact_cached_prompt_reuse_scenario, out)


def _loaded_exact_cached_prompt_reuse_scenario(cfg):
    prompt = cfg.prompt("The quick brown fox")
    fresh = _create_test_model(cfg)
    tokens = fresh.tokenize(prompt.encode(), add_bos=True, special=True)
    expected_tokens = _generate_test_tokens(fresh, tokens)

    source = _create_test_model(cfg)
    source.eval(tokens)
    state = source.save_state()
    if cfg.policy is not None:
        assert isinstance(state, kvp_cpp.KvpLlamaState)

    loaded = _create_test_model(cfg)
    _eval_alternate_same_length_prompt(loaded, tokens, expected_tokens[0])
    loaded.load_state(state)

    assert loaded.n_tokens == len(tokens)
    assert loaded.input_ids[: loaded.n_tokens].tolist() == tokens

    loaded_tokens = _generate_test_tokens(loaded, tokens)
    assert loaded_tokens == expected_tokens
    assert loaded.n_tokens == len(tokens) + len(loaded_tokens) - 1
    cfg.check_cache(source)
    cfg.check_cache(loaded)
    return expected_tokens


def test_loaded_exact_cached_prompt_reuse_matches_fresh(cfg):
    out = _loaded_exact_cached_prompt_reuse_scenario(cfg)
    record_or_compare(cfg, "loaded_exact_cached_prompt_reuse", _loaded_exact_cached_prompt_reuse_scenario, out)


def _ram_cache_scenario(cfg):
    prompt = cfg.prompt("The quick brown fox")
    fresh = _create_test_model(cfg)
    tokens = fresh.tokenize(prompt.encode(), add_bos=True, special=True)
    expected = fresh.create_completion(tokens, max_tokens=1, temperature=0.0, seed=1337)

    cache = llama_cpp.LlamaRAMCache()
    writer = _create_test_model(cfg)
    writer.set_cache(cache)
    writer.create_completion(tokens, max_tokens=1, temperature=0.0, seed=1337)

    cached = _create_test_model(cfg)
    cached.set_cache(cache)

    load_state_calls = 0
    original_load_state = cached.load_state

    def load_state_tracker(state):
        nonlocal load_state_calls
        load_state_calls += 1
        original_load_state(state)

    cached.load_state = load_state_tracker

    actual = cached.create_completion(tokens, max_tokens=1, temperature=0.0, seed=1337)

    assert load_state_calls == 1
    assert actual["choices"][0]["text"] == expected["choices"][0]["text"]
    assert actual["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
    assert_completion(actual)
    cfg.check_cache(writer)
    cfg.check_cache(cached)
    return text_of(expected), expected["usage"]["completion_tokens"]


def test_ram_cache_exact_prompt_hit_matches_fresh(cfg):
    out = _ram_cache_scenario(cfg)
    record_or_compare(cfg, "ram_cache", _ram_cache_scenario, out)


def _shorter_prompt_prefix_reuse_scenario(cfg):
    prompt = cfg.prompt("The quick brown fox")
    history = " jumps over the lazy dog"
    fresh = _create_test_model(cfg)
    tokens = fresh.tokenize(prompt.encode(), add_bos=True, special=True)
    history_tokens = fresh.tokenize(history.encode(), add_bos=False, special=True)
    expected_tokens = _generate_test_tokens(fresh, tokens)

    cached = _create_test_model(cfg)
    cached.eval(tokens + history_tokens)
    assert cached.n_tokens > len(tokens)
    assert cached.input_ids[: len(tokens)].tolist() == tokens

    cached_tokens = _generate_test_tokens(cached, tokens)
    assert cached_tokens == expected_tokens
    cfg.check_cache(cached)
    return expected_tokens


def test_shorter_prompt_prefix_reuse_matches_fresh(cfg):
    out = _shorter_prompt_prefix_reuse_scenario(cfg)
    record_or_compare(cfg, "shorter_prompt_prefix_reuse", _shorter_prompt_prefix_reuse_scenario, out)


@pytest.mark.parametrize(
    "model_kind",
    [
        pytest.param(
            "recurrent",
            marks=pytest.mark.skip(
                reason="needs a recurrent model (upstream: QuantFactory/mamba-130m-hf-GGUF from the HF hub, not "
                "downloadable here; the bundled SmolLM2 is a plain transformer): covers upstream "
                "test_recurrent_model_prompt_cache_reset and the [llama_cpp_recurrent_model_path] cases of "
                "test_exact_cached_prompt_reuse_matches_fresh, test_loaded_exact_cached_prompt_reuse_matches_fresh, "
                "test_ram_cache_exact_prompt_hit_matches_fresh, test_shorter_prompt_prefix_reuse_matches_fresh"
            ),
        ),
        pytest.param(
            "hybrid",
            marks=pytest.mark.skip(
                reason="needs a hybrid attention/SSM model (upstream: tiiuae/Falcon-H1-Tiny-90M-Instruct-GGUF from "
                "the HF hub, not downloadable here): covers upstream test_hybrid_model_prompt_cache_reset and the "
                "[llama_cpp_hybrid_model_path] cases of test_exact_cached_prompt_reuse_matches_fresh, "
                "test_loaded_exact_cached_prompt_reuse_matches_fresh, test_ram_cache_exact_prompt_hit_matches_fresh, "
                "test_shorter_prompt_prefix_reuse_matches_fresh"
            ),
        ),
    ],
)
def test_needs_recurrent_or_hybrid_model(model_kind):
    raise AssertionError("skipped by its mark")


def test_real_llama_embeddings(cfg):
    # upstream embeds with bge-small-en-v1.5, whose GGUF asks for mean pooling. SmolLM2's GGUF names no pooling
    # (embed() would then return per-token vectors, and llama-cpp-python 0.3.36 mis-slices those when it batches
    # several inputs), so mean pooling is requested explicitly.
    kwargs = dict(
        n_ctx=32, n_batch=32, n_ubatch=32, logits_all=False, flash_attn=True, embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    )
    if cfg.policy is not None:
        # documented: a kv_policy applies to generation and refuses embedding=True (before loading the model).
        # The refused object must also be collectable without an error (Llama.__del__ calls close()).
        unraisable = []
        previous_hook = sys.unraisablehook
        sys.unraisablehook = unraisable.append
        try:
            with pytest.raises(ValueError, match="embedding"):
                cfg.new(**kwargs)
            gc.collect()
        finally:
            sys.unraisablehook = previous_hook
        assert not unraisable, "a refused kvp_cpp.Llama raised in __del__: " + "; ".join(
            f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable
        )
        return
    model = cfg.new(**kwargs)
    embedding = model.embed("Hello World")
    assert len(embedding) > 0
    assert len(embedding) == model.n_embd()

    prompts = ["Hello World", "A different prompt"]
    individual_embeddings = [model.embed(prompt) for prompt in prompts]
    batched_embeddings = model.embed(prompts)

    assert len(batched_embeddings) == len(prompts)
    for individual, batched in zip(individual_embeddings, batched_embeddings):
        np.testing.assert_allclose(batched, individual, rtol=1e-4, atol=1e-4)

    repeated_embeddings = model.embed(list(reversed(prompts)))
    assert len(repeated_embeddings) == len(prompts)
    for repeated, original in zip(repeated_embeddings, reversed(individual_embeddings)):
        assert np.shape(repeated) == np.shape(original)


# ---------------------------------------------------------------- tests upstream's test_llama.py had in 0.2.x


def forcing_processor(model, target_tokens):
    """Upstream's mock_llama made llama_decode return logits in which row i strongly predicts target_tokens[i + 1]
    (EOS after the end). This does the same through a logits processor, so the real decode path (and the eviction
    engine) runs underneath: position p (the number of tokens evaluated so far) is forced to target_tokens[p]."""

    def force(input_ids, logits):
        position = len(input_ids)
        forced = target_tokens[position] if position < len(target_tokens) else model.token_eos()
        logits[:] = -100.0
        logits[forced] = 100.0
        return logits

    return llama_cpp.LogitsProcessorList([force])


def _llama_patch_scenario(cfg):
    llama = cfg.shared(n_ctx=128)
    evicted = cfg.evicted(llama)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama._model.vocab)
    assert n_vocab == 49152  # upstream (llama spm vocab): 32000

    text = cfg.prompt("The quick brown fox")
    output_text = " jumps over the lazy dog."
    all_text = text + output_text
    target = llama.tokenize(all_text.encode("utf-8"), add_bos=True, special=True)

    def force():
        return forcing_processor(llama, target)

    out = {}
    ## Test basic completion until eos
    completion = llama.create_completion(text, max_tokens=20, logits_processor=force())
    assert_completion(completion)
    assert completion["choices"][0]["text"] == output_text
    assert completion["choices"][0]["finish_reason"] == "stop"

    ## Test streaming completion until eos
    chunks = list(llama.create_completion(text, max_tokens=20, stream=True, logits_processor=force()))
    for chunk in chunks:
        assert_completion(chunk, stream_chunk=True)
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == output_text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    ## Test basic completion until stop sequence
    completion = llama.create_completion(text, max_tokens=20, stop=["lazy"], logits_processor=force())
    assert_completion(completion)
    assert completion["choices"][0]["text"] == " jumps over the "
    assert completion["choices"][0]["finish_reason"] == "stop"

    ## Test streaming completion until stop sequence
    chunks = list(
        llama.create_completion(text, max_tokens=20, stream=True, stop=["lazy"], logits_processor=force())
    )
    for chunk in chunks:
        assert_completion(chunk, stream_chunk=True)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == " jumps over the "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    ## Test basic completion until length
    completion = llama.create_completion(text, max_tokens=2, logits_processor=force())
    assert_completion(completion)
    assert completion["choices"][0]["text"] == " jumps over"  # upstream (spm vocab: " j" "umps"): " jumps"
    assert completion["choices"][0]["finish_reason"] == "length"
    assert completion["usage"]["completion_tokens"] == 2

    ## Test streaming completion until length
    chunks = list(llama.create_completion(text, max_tokens=2, stream=True, logits_processor=force()))
    for chunk in chunks:
        assert_completion(chunk, stream_chunk=True)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == " jumps over"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    ## Unforced greedy completion: streaming and non-streaming agree (not in upstream: its decode was mocked)
    plain = llama.create_completion(text, max_tokens=8, temperature=0.0)
    assert_completion(plain)
    streamed = list(llama.create_completion(text, max_tokens=8, temperature=0.0, stream=True))
    for chunk in streamed:
        assert_completion(chunk, stream_chunk=True)
    assert streamed[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    out["greedy"] = text_of(plain)
    out["greedy_streamed"] = "".join(chunk["choices"][0]["text"] for chunk in streamed)
    cfg.check_cache(llama, evicted)
    return out


def test_llama_patch(cfg):
    out = _llama_patch_scenario(cfg)
    # the same prompt twice: the same greedy text, streamed or not (see test_real_llama_repeated_prompt_cache)
    assert out["greedy_streamed"] == out["greedy"]
    record_or_compare(cfg, "llama_patch", _llama_patch_scenario, out)


def _utf8_scenario(cfg):
    llama = cfg.shared(n_ctx=128, logits_all=True)
    evicted = cfg.evicted(llama)

    output_text = "😀"  # three byte-level tokens in SmolLM2's vocabulary
    # upstream starts from the empty prompt, i.e. from the BOS token; SmolLM2 adds no BOS and generate() cannot
    # sample from zero tokens, so a short prompt stands in for it.
    prompt = cfg.prompt("Smile:")
    target = llama.tokenize((prompt + output_text).encode("utf-8"), add_bos=True, special=True)
    assert len(target) - len(llama.tokenize(prompt.encode("utf-8"))) == 3

    ## Test basic completion with utf8 multibyte
    completion = llama.create_completion(prompt, max_tokens=4, logits_processor=forcing_processor(llama, target))
    assert_completion(completion)
    assert completion["choices"][0]["text"] == output_text

    ## Test basic completion with incomplete utf8 multibyte
    completion = llama.create_completion(prompt, max_tokens=1, logits_processor=forcing_processor(llama, target))
    assert_completion(completion)
    # upstream 0.2.x expected "" (the incomplete character withheld). In 0.3.36, _create_completion skips the
    # max_tokens check while the last character is incomplete, so the character is completed instead; either way no
    # broken character is returned.
    assert completion["choices"][0]["text"] == output_text
    assert completion["usage"]["completion_tokens"] == 3

    ## logprobs (logits_all=True, which upstream's test_utf8 also set): one entry per completion token
    completion = llama.create_completion(
        prompt, max_tokens=4, logprobs=2, logits_processor=forcing_processor(llama, target)
    )
    assert_completion(completion, logprobs=True)
    logprobs = completion["choices"][0]["logprobs"]
    assert completion["choices"][0]["text"] == output_text
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
    assert len(logprobs["tokens"]) == completion["usage"]["completion_tokens"]
    assert all(np.isfinite(lp) and lp <= 0.0 for lp in logprobs["token_logprobs"])
    cfg.check_cache(llama, evicted)
    return completion["choices"][0]["text"], logprobs["token_logprobs"]


def test_utf8(cfg):
    out = _utf8_scenario(cfg)
    record_or_compare(cfg, "utf8", _utf8_scenario, out)


def test_llama_pickle(cfg):
    # upstream pickles a vocab-only model; a full one (with logits_all=True, so that n_ctx bounds the logits rows)
    # lets the clone be checked by generating.
    llama = cfg.new(n_ctx=128, logits_all=True)
    before = llama.__getstate__()

    with tempfile.TemporaryFile() as fp:
        pickle.dump(llama, fp)
        fp.seek(0)
        clone = pickle.load(fp)
    cfg._owned.append(clone)

    after = clone.__getstate__()  # before anything (create_completion sets the seed) changes it

    assert clone
    assert clone.ctx is not None
    assert type(clone) is kvp_cpp.Llama

    text = b"Hello World"

    assert clone.detokenize(clone.tokenize(text)) == text

    # the kv_* arguments survive
    assert clone._kvp_args == llama._kvp_args
    assert {k: clone.__getstate__()[k] for k in clone._kvp_args} == {k: before[k] for k in llama._kvp_args}

    # the clone does what the original does (here: logprobs over the prompt), within its budget
    prompt = cfg.prompt("The quick brown fox")
    reference = llama.create_completion(prompt, max_tokens=4, temperature=0.0, logprobs=1)
    evicted = cfg.evicted(clone)
    output = clone.create_completion(prompt, max_tokens=4, temperature=0.0, logprobs=1)
    assert_completion(output, logprobs=True)
    assert len(output["choices"][0]["logprobs"]["tokens"]) == output["usage"]["completion_tokens"]
    cfg.check_cache(clone, evicted)
    if cfg.kind != "evict":
        assert text_of(output) == text_of(reference)

    # and so does every other constructor argument
    assert after == before
    assert clone.n_batch == llama.n_batch


@pytest.mark.parametrize(
    "size_and_axis",
    [
        ((32_000,), -1),  # last token's next-token logits
        ((10, 32_000), -1),  # many tokens' next-token logits, or batch of last tokens
        ((4, 10, 32_000), -1),  # batch of texts
    ],
)
@pytest.mark.parametrize("convert_to_list", [True, False])
def test_logits_to_logprobs(size_and_axis, convert_to_list: bool, atol: float = 1e-7):
    # a static method: configuration-independent; called through kvp_cpp.Llama to check the inheritance
    size, axis = size_and_axis
    logits: np.ndarray = -np.random.uniform(low=0, high=60, size=size)
    logits = logits.astype(np.single)
    reference = logits.astype(np.float64)
    if convert_to_list:
        # Currently, logits are converted from arrays to lists. This may change soon
        logits = logits.tolist()
    log_probs = kvp_cpp.Llama.logits_to_logprobs(logits, axis=axis)
    # scipy.special.log_softmax in upstream; the same formula in numpy
    shifted = reference - reference.max(axis=axis, keepdims=True)
    log_probs_correct = shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))
    assert log_probs.dtype == np.single
    assert log_probs.shape == size
    assert np.allclose(log_probs, log_probs_correct, atol=atol)


# ------------------------------------------------------------------------ grammar, chat, state continuation


COMPOSED_SCHEMA = {  # test_llama_grammar.py::test_composed_pydantic_grammar
    "$defs": {
        "A": {
            "properties": {"a": {"title": "A", "type": "integer"}},
            "required": ["a"],
            "title": "A",
            "type": "object",
        }
    },
    "properties": {
        "a": {"$ref": "#/$defs/A"},
        "b": {"title": "B", "type": "integer"},
    },
    "required": ["a", "b"],
    "title": "B",
    "type": "object",
}

ANYOF_SCHEMA = {  # test_llama_grammar.py::test_grammar_anyof
    "properties": {
        "temperature": {
            "description": "The temperature mentioned",
            "type": "number",
        },
        "unit": {
            "anyOf": [
                {
                    "description": "Unit for temperature",
                    "enum": ["celsius", "fahrenheit"],
                    "type": "string",
                },
                {"type": "null"},
            ],
        },
    },
    "type": "object",
}


def _json_grammar_scenario(cfg):
    llama = cfg.shared(n_ctx=256)
    evicted = cfg.evicted(llama)
    out = []
    for schema, prompt in (
        (COMPOSED_SCHEMA, 'Write a JSON object like {"a": {"a": 1}, "b": 2}:\n'),
        (ANYOF_SCHEMA, "It is 21 degrees celsius today. As JSON:\n"),
    ):
        grammar = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(schema))
        output = llama.create_completion(cfg.prompt(prompt), max_tokens=40, temperature=0.0, grammar=grammar)
        assert_completion(output)
        assert output["choices"][0]["finish_reason"] == "stop", output
        value = json.loads(text_of(output))
        assert isinstance(value, dict)
        if schema is COMPOSED_SCHEMA:
            assert set(value) == {"a", "b"}
            assert set(value["a"]) == {"a"} and isinstance(value["a"]["a"], int)
            assert isinstance(value["b"], int)
        else:
            assert set(value) <= {"temperature", "unit"}
            if "temperature" in value:
                assert isinstance(value["temperature"], (int, float))
            if "unit" in value:
                assert value["unit"] in ("celsius", "fahrenheit", None)
        out.append(text_of(output))
    cfg.check_cache(llama, evicted)
    return out


def test_json_schema_grammar_completion(cfg):
    out = _json_grammar_scenario(cfg)
    record_or_compare(cfg, "json_grammar", _json_grammar_scenario, out)


def _chat_scenario(cfg):
    llama = cfg.shared(n_ctx=256)
    evicted = cfg.evicted(llama)
    assert llama.chat_format == "chat_template.default"  # SmolLM2's template, from the GGUF metadata
    messages = [
        {"role": "system", "content": cfg.prompt("You are a helpful assistant.")},
        # Greedy margins of at least 1.3 nats on every token of the reply: the bare question's first token was a
        # near-tie (0.13 nats on an AVX2-only CPU, where a fresh prefill and the cached repeat disagreed).
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
    ]

    response = llama.create_chat_completion(messages=messages, max_tokens=12, temperature=0.0)
    assert response["id"].startswith("chatcmpl-")
    assert response["object"] == "chat.completion"
    assert isinstance(response["created"], int)
    assert len(response["choices"]) == 1
    choice = response["choices"][0]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = response["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] <= 12

    chunks = list(llama.create_chat_completion(messages=messages, max_tokens=12, temperature=0.0, stream=True))
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(set(chunk["choices"][0]["delta"]) <= {"content"} for chunk in chunks[1:])
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    streamed = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks[1:])

    # a second turn on top of the first (upstream's prompt cache reuses the shared prefix)
    follow_up = messages + [
        {"role": "assistant", "content": choice["message"]["content"]},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = llama.create_chat_completion(messages=follow_up, max_tokens=8, temperature=0.0)
    assert second["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(second["choices"][0]["message"]["content"], str)
    assert second["choices"][0]["finish_reason"] in ("stop", "length")
    assert second["usage"]["prompt_tokens"] > usage["prompt_tokens"]
    cfg.check_cache(llama, evicted)
    return choice["message"]["content"], streamed, second["choices"][0]["message"]["content"]


def test_chat_completion(cfg):
    content, streamed, second = _chat_scenario(cfg)
    # the same messages twice: the same greedy reply, streamed or not (see test_real_llama_repeated_prompt_cache)
    assert streamed == content
    if record_or_compare(cfg, "chat", _chat_scenario, (content, streamed, second)):
        assert "Paris" in content


def _state_round_trip_scenario(cfg):
    # test_real_llama checks that load_state restores the seed; with eviction, generate() re-prefills a restored
    # prompt whose prefix was evicted, so that check never decodes from the restored cache. Here the continuation
    # is decoded from the restored KV cache and eviction ledger themselves (generate(reset=False)).
    llama = cfg.shared(n_ctx=256)
    evicted = cfg.evicted(llama)
    tokens = llama.tokenize(cfg.prompt("Once upon a time, in a small village,").encode(), add_bos=True, special=True)
    llama.eval(tokens[:-1])
    state = llama.save_state()
    saved_stats = llama.kv_stats() if cfg.policy else None

    def continuation(model):
        return list(itertools.islice(model.generate(tokens[-1:], temp=0.0, reset=False), 40))

    def load(model):
        model.load_state(state)
        assert model.n_tokens == len(tokens) - 1
        assert model.input_ids[: model.n_tokens].tolist() == tokens[:-1]
        if cfg.policy:
            restored = model.kv_stats()
            assert restored["cells_used"] == saved_stats["cells_used"]
            assert restored["next_position"] == saved_stats["next_position"]

    first = continuation(llama)
    assert llama.n_tokens == len(tokens) + len(first) - 1
    cfg.check_cache(llama, evicted)

    load(llama)  # back into the Llama that saved it
    second = continuation(llama)
    cfg.check_cache(llama, evicted)

    other = cfg.new(n_ctx=256)  # into another Llama of the same configuration
    load(other)
    third = continuation(other)
    cfg.check_cache(other)
    return first, second, third


def test_state_round_trip_continuation(cfg):
    first, second, third = _state_round_trip_scenario(cfg)
    assert len(first) == len(second) == len(third) == 40
    # same cache, same ledger, greedy: the same continuation as before saving
    assert second == first, "load_state into the same Llama"
    assert third == first, "load_state into another Llama"
    record_or_compare(cfg, "state_round_trip", _state_round_trip_scenario, (first, second, third))
