"""RULER sample generators (niah, vt, cwe, fwe) and their sizing to a target length in tokens.

Each generator reproduces the random draws of RULER's script for its task (``random`` and ``numpy.random`` seeded
with the seed, plus the fixed ``random.Random(seed)`` shuffles), so only the tokenizer and the documented
deviations change what comes out.
"""
from __future__ import annotations

import math
import random
import string
import uuid
import warnings
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

from .constants import NEEDLE, NOISE_SENTENCE, TASKS, VT_ANSWER_PREFIX, VT_TEMPLATE, NiahConfig, TaskSpec
from .prompt import Tokenizer, prompt_template, split_answer_prefix
from .sources import cwe_word_pool, essay_words, niah_word_keys, split_sentences

# Needle depths in percent for the essay haystack: np.round(np.linspace(0, 100, 40)).
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
ZETA_2 = math.pi**2 / 6  # Riemann zeta(2), RULER's scipy.special.zeta(alpha) for its alpha = 2.0

Prompt = Tuple[str, List[str]]  # full prompt (answer prefix included), reference answers
MAX_REDRAWS = 100


class TargetTooShort(ValueError):
    """The target length cannot hold even the smallest haystack of the task."""


class WordPoolExhausted(ValueError):
    """cwe needs more distinct words than the wonderwords pool holds (RULER then uses english_words.json)."""


class _Sizer:
    """What every generator shares: the target, the token counter and RULER's size searches."""

    def __init__(self, spec: TaskSpec, target_length: int, tokenizer: Tokenizer):
        self.spec = spec
        self.target_length = target_length
        self.tokenizer = tokenizer

    def fits(self, tokens: int) -> bool:
        return tokens + self.spec.tokens_to_generate <= self.target_length

    def tripled_estimate(self, tokens_per_unit: float) -> int:
        """niah's and vt's upper bound: three times the units the estimated tokens per unit allow."""
        return int(self.target_length / tokens_per_unit * 3)

    def search_size(
        self,
        make_text: Callable[[int], str],
        incremental: int,
        upper_bound: Callable[[float], int],
        probe_size: Optional[int] = None,
        extra_tokens: int = 0,
    ) -> int:
        """RULER's binary search (since 2025-06) for the haystack size of every sample.

        Tokens per unit are estimated from one prompt of ``probe_size`` units (default ``incremental``); the
        largest size in [incremental, max(upper_bound(estimate), 2 * incremental)] whose freshly generated prompt
        (plus ``extra_tokens``) fits is the result, ``incremental`` if none does. A size that cannot be generated
        (:class:`WordPoolExhausted`) counts as too long.
        """
        probe_size = probe_size or incremental
        tokens_per_unit = self.tokenizer.count(make_text(probe_size)) / probe_size
        lower, upper = incremental, max(upper_bound(tokens_per_unit), incremental * 2)
        best = None
        while lower <= upper:
            mid = (lower + upper) // 2
            try:
                fits = self.fits(self.tokenizer.count(make_text(mid)) + extra_tokens)
            except WordPoolExhausted:
                fits = False
            if fits:
                best, lower = mid, mid + 1
            else:
                upper = mid - 1
        return incremental if best is None else best

    def fit_sample(self, make: Callable[[int], Prompt], size: int, step: int) -> Tuple[str, List[str], int]:
        """RULER's per-sample loop: generate at ``size``; while too long, retry ``step`` units smaller.

        Once no step is left RULER redraws at the same size until a sample fits, forever; this gives up after
        ``MAX_REDRAWS`` draws.
        """
        redraws = 0
        while True:
            prompt, answers = make(size)
            tokens = self.tokenizer.count(prompt)
            if self.fits(tokens):
                return prompt, answers, tokens
            if size > step:
                size -= step
                continue
            redraws += 1
            if redraws >= MAX_REDRAWS:
                raise TargetTooShort(
                    f"{self.spec.name}: {self.target_length} tokens cannot hold the smallest haystack "
                    f"({tokens} + {self.spec.tokens_to_generate} tokens)"
                )


class Niah(_Sizer):
    """``scripts/data/synthetic/niah.py``."""

    def __init__(self, spec, target_length, tokenizer, template_kind, seed, rng, np_rng):
        super().__init__(spec, target_length, tokenizer)
        config: NiahConfig = spec.niah
        self.config = config
        self.num_needle_k = max(config.num_needle_k, config.num_needle_q)
        self.seed = seed
        self.rng = rng
        template = prompt_template(spec.template, spec.answer_prefix, template_kind, tokenizer)
        self.type_needle_v = config.type_needle_v
        if config.num_needle_q * config.num_needle_v == 1:
            # RULER's singular rewrite: plain substring replacements over the whole assembled template.
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template = template.replace(old, new)
            self.type_needle_v = config.type_needle_v[:-1]
        self.template = template
        if config.type_haystack == "essay":
            self.incremental = 500
        else:
            self.incremental = 5 if target_length < 4096 else 25

    def _random(self, kind: str) -> str:
        if kind == "numbers":
            return str(self.rng.randint(10**6, 10**7 - 1))
        if kind == "words":
            return self.rng.choice(niah_word_keys())
        if kind == "uuids":
            return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        raise ValueError(f"unknown needle type {kind!r}")

    def _essay_context(self, num_words: int, needles: List[str]) -> str:
        words = essay_words()
        if num_words > len(words):
            words = words * -(-num_words // len(words))
        sentences = split_sentences(" ".join(words[:num_words]).strip())
        depths = self.rng.sample(DEPTHS, len(needles))
        positions = [0] + sorted(int(len(sentences) * (depth / 100)) for depth in depths) + [len(sentences)]
        parts = []
        for i in range(1, len(positions)):
            parts.append(" ".join(sentences[positions[i - 1] : positions[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        return " ".join(parts)

    def _line_context(self, num_lines: int, needles: List[str]) -> str:
        config = self.config
        if config.type_haystack == "noise":
            lines = [NOISE_SENTENCE] * num_lines
        else:  # "needle": the haystack is distractor needles
            lines = [
                NEEDLE.format(
                    type_needle_v=config.type_needle_v,
                    key=self._random(config.type_needle_k),
                    value=self._random(config.type_needle_v),
                )
                for _ in range(num_lines)
            ]
        for index, needle in zip(sorted(self.rng.sample(range(num_lines), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        return "\n".join(lines)

    def make(self, num_haystack: int) -> Prompt:
        config = self.config
        keys, values, needles = [], [], []
        for _ in range(self.num_needle_k):
            keys.append(self._random(config.type_needle_k))
            values.append([])
            for _ in range(config.num_needle_v):
                values[-1].append(self._random(config.type_needle_v))
                needles.append(NEEDLE.format(type_needle_v=config.type_needle_v, key=keys[-1], value=values[-1][-1]))
        random.Random(self.seed).shuffle(needles)

        if config.type_haystack == "essay":
            context = self._essay_context(num_haystack, needles)
        else:
            context = self._line_context(num_haystack, needles)

        indices = self.rng.sample(range(self.num_needle_k), config.num_needle_q)
        queries = [keys[i] for i in indices]
        answers = [value for i in indices for value in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        return self.template.format(type_needle_v=self.type_needle_v, context=context, query=query), answers

    def samples(self, num_samples: int) -> Iterator[Tuple[str, List[str], int]]:
        size = self.search_size(lambda n: self.make(n)[0], self.incremental, self.tripled_estimate)
        for _ in range(num_samples):
            yield self.fit_sample(self.make, size, self.incremental)


class VariableTracking(_Sizer):
    """``scripts/data/synthetic/variable_tracking.py`` with its defaults: one chain of four hops, noise haystack."""

    num_chains = 1
    num_hops = 4
    icl_max_length = 500

    def __init__(self, spec, target_length, tokenizer, template_kind, seed, rng, np_rng):
        super().__init__(spec, target_length, tokenizer)
        self.rng = rng
        self.np_rng = np_rng
        self.template = prompt_template(spec.template, spec.answer_prefix, template_kind, tokenizer)
        # RULER formats its one-shot example with the bare task template, without the model's wrapper.
        self.icl_template = VT_TEMPLATE + VT_ANSWER_PREFIX
        self.incremental = 5 if target_length < 4096 else 10

    def _names(self, count: int, letters: int) -> List[str]:
        names = ["".join(self.rng.choices(string.ascii_uppercase, k=letters)) for _ in range(count)]
        while len(set(names)) < count:
            names.append("".join(self.rng.choices(string.ascii_uppercase, k=letters)))
        # RULER keeps a duplicate in the list, which then crashes building the chains; drop it instead.
        return list(dict.fromkeys(names))

    def _chains(self, is_icl: bool) -> Tuple[List[List[str]], List[List[str]]]:
        hops = min(10, self.num_hops) if is_icl else self.num_hops
        names = self._names((hops + 1) * self.num_chains, 3 if is_icl else 5)
        all_vars, chains = [], []
        for i in range(0, len(names), hops + 1):
            chain_vars = names[i : i + hops + 1]
            value = "12345" if is_icl else str(self.np_rng.randint(10000, 99999))
            chain = [f"VAR {chain_vars[0]} = {value}"]
            chain += [f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]} " for j in range(hops)]
            all_vars.append(chain_vars)
            chains.append(chain)
        return all_vars, chains

    def make(self, num_noises: int, is_icl: bool = False) -> Prompt:
        all_vars, chains = self._chains(is_icl)
        value = chains[0][0].split("=")[-1].strip()
        lines = [NOISE_SENTENCE] * num_noises
        for chain in chains:
            positions = sorted(self.rng.sample(range(len(lines)), len(chain)))
            for offset, (position, line) in enumerate(zip(positions, chain)):
                lines.insert(position + offset, line)
        context = "\n".join(lines).replace(". \n", ".\n")
        template = self.icl_template if is_icl else self.template
        return template.format(context=context, query=value, num_v=self.num_hops + 1), all_vars[0]

    def _one_shot_example(self) -> str:
        """RULER's first pass: one sample sized to 500 tokens, no generation allowance, 3-letter names, 12345."""
        icl_sizer = _Sizer(
            TaskSpec("vt (one-shot example)", "vt", "", "", 0, self.spec.metric), self.icl_max_length, self.tokenizer
        )
        incremental = 5

        def make(n: int) -> Prompt:
            return self.make(n, is_icl=True)

        size = icl_sizer.search_size(lambda n: make(n)[0], incremental, icl_sizer.tripled_estimate)
        prompt, names, _ = icl_sizer.fit_sample(make, size, incremental)
        return prompt + " " + " ".join(names) + "\n"

    def _randomize_example(self, example: str) -> str:
        for name in example.strip().split()[-(self.num_hops + 1) :]:
            example = example.replace(name, "".join(self.rng.choices(string.ascii_uppercase, k=len(name))))
        return example.replace("12345", str(self.np_rng.randint(10000, 99999)))

    def samples(self, num_samples: int) -> Iterator[Tuple[str, List[str], int]]:
        example = self._one_shot_example()
        size = self.search_size(
            lambda n: self.make(n)[0], self.incremental, self.tripled_estimate,
            extra_tokens=self.tokenizer.count(example),
        )
        task_start = VT_TEMPLATE[:20]

        def make_with_example(n: int) -> Prompt:
            prompt, names = self.make(n)
            cut = prompt.index(task_start)
            return prompt[:cut] + self._randomize_example(example) + "\n" + prompt[cut:], names

        for _ in range(num_samples):
            yield self.fit_sample(make_with_example, size, self.incremental)


class CommonWordsExtraction(_Sizer):
    """``scripts/data/synthetic/common_words_extraction.py`` (freq_cw 30, freq_ucw 3, num_cw 10, one shot)."""

    num_common = 10
    incremental = 10
    probe_words = 4096

    def __init__(self, spec, target_length, tokenizer, template_kind, seed, rng, np_rng):
        super().__init__(spec, target_length, tokenizer)
        self.seed = seed
        self.rng = rng
        self.template = prompt_template(spec.template, spec.answer_prefix, template_kind, tokenizer)
        self.pool = list(cwe_word_pool())
        random.Random(seed).shuffle(self.pool)
        if target_length < 4096:
            self.shot_shape, self.repeats = (20, 3, 1), (6, 1)
        else:
            self.shot_shape, self.repeats = (40, 10, 3), (30, 3)

    def _word_list(self, num_words: int, common_repeats: int, uncommon_repeats: int) -> Tuple[str, List[str]]:
        if num_words > len(self.pool):
            # RULER switches to english_words.json here, a Git-LFS file that is not available.
            raise WordPoolExhausted(f"cwe needs {num_words} distinct words; the wonderwords pool has {len(self.pool)}")
        words = self.rng.sample(self.pool, num_words)
        common, uncommon = words[: self.num_common], words[self.num_common :]
        listed = common * common_repeats + uncommon * uncommon_repeats
        random.Random(self.seed).shuffle(listed)
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(listed)), common

    def make(self, num_words: int) -> Prompt:
        shot_words, shot_common, shot_uncommon = self.shot_shape
        shot_context, shot_answer = self._word_list(shot_words, shot_common, shot_uncommon)
        context, answer = self._word_list(num_words, *self.repeats)
        # The example is the full template (model wrapper and answer prefix included) followed by its answer.
        shot = self.template.format(num_cw=self.num_common, context=shot_context, query="")
        shot += " " + " ".join(f"{i + 1}. {word}" for i, word in enumerate(shot_answer))
        return shot + "\n" + self.template.format(num_cw=self.num_common, context=context, query=""), answer

    def samples(self, num_samples: int) -> Iterator[Tuple[str, List[str], int]]:
        size = self.search_size(
            lambda n: self.make(n)[0], self.incremental,
            lambda tokens_per_word: int(self.target_length // tokens_per_word) * 2,
            probe_size=self.probe_words,
        )
        if size == len(self.pool):
            warnings.warn(
                f"cwe at {self.target_length} tokens is capped by the {len(self.pool)}-word pool; "
                "its samples are shorter than the target",
                stacklevel=2,
            )
        for _ in range(num_samples):
            yield self.fit_sample(self.make, size, self.incremental)


class FrequentWordsExtraction(_Sizer):
    """``scripts/data/synthetic/freq_words_extraction.py`` (alpha 2.0, 6-letter coded words)."""

    alpha = 2.0
    word_length = 6

    def __init__(self, spec, target_length, tokenizer, template_kind, seed, rng, np_rng):
        super().__init__(spec, target_length, tokenizer)
        self.seed = seed
        self.rng = rng
        self.template = prompt_template(spec.template, spec.answer_prefix, template_kind, tokenizer)
        self.max_len = target_length - spec.tokens_to_generate
        self.vocab_size = self.max_len // 50
        self.incremental = self.max_len // 32
        if self.vocab_size < 4 or self.incremental < 1:
            raise TargetTooShort(f"fwe: {target_length} tokens is too short")

    def _vocabulary(self) -> List[str]:
        def coded_word() -> str:
            return "".join(self.rng.choices(string.ascii_lowercase, k=self.word_length))

        vocab = [coded_word() for _ in range(self.vocab_size)]
        while len(set(vocab)) < self.vocab_size:
            vocab.append(coded_word())
        vocab = sorted(set(vocab))
        random.Random(self.seed).shuffle(vocab)
        vocab[0] = "..."  # the most frequent "word" is noise
        return vocab

    def _text(self, vocab: List[str], num_words: int) -> Prompt:
        ranks = np.arange(1, len(vocab) + 1)
        counts = (num_words * (ranks**-self.alpha) / ZETA_2).astype(int)
        words = [word for word, count in zip(vocab, counts) for _ in range(int(count))]
        random.Random(self.seed).shuffle(words)
        return self.template.format(context=" ".join(words), query=""), vocab[1:4]

    def _size_search(self) -> int:
        """RULER's original incremental search: grow by max_len // 32 words while under max_len, step back once."""
        vocab = self._vocabulary()
        num_words = self.max_len // self.word_length
        while self.tokenizer.count(self._text(vocab, num_words)[0]) < self.max_len:
            num_words += self.incremental
        return num_words - self.incremental

    def samples(self, num_samples: int) -> Iterator[Tuple[str, List[str], int]]:
        size = self._size_search()
        for _ in range(num_samples):
            vocab = self._vocabulary()
            num_words = size
            prompt, answers = self._text(vocab, num_words)
            tokens = self.tokenizer.count(prompt)
            while tokens > self.max_len:
                num_words -= self.incremental
                if num_words <= 0:
                    raise TargetTooShort(f"fwe: {self.target_length} tokens is too short")
                prompt, answers = self._text(vocab, num_words)
                tokens = self.tokenizer.count(prompt)
            yield prompt, answers, tokens


QUESTION_HEAD_CHARS = 40


def question_of(input_text: str, template: str) -> str:
    """The end of ``input_text`` that follows the haystack: the question, and the chat template's tail after it.

    kvpress splits RULER prompts into context and question the same way (the question is not compressed in its
    default, question-excluded protocol). Every RULER template puts the question after ``{context}``; its first
    literal piece (up to the next placeholder, at most 40 characters: fwe's runs on into the answer prefix, which
    is not part of ``input``) starts the question, searched from the end because cwe's one-shot example holds the
    same words.
    """
    after_context = template.rsplit("{context}", 1)[-1]
    head = after_context.split("{", 1)[0].replace("}}", "}")[:QUESTION_HEAD_CHARS]
    if not head.strip():
        raise ValueError("the task template has no text between {context} and its next placeholder")
    start = input_text.rfind(head)
    if start < 0:
        raise ValueError(f"the prompt does not contain the question's start {head!r}")
    return input_text[start:]


GENERATORS = {"niah": Niah, "vt": VariableTracking, "cwe": CommonWordsExtraction, "fwe": FrequentWordsExtraction}


def generate(
    task: str, target_length: int, num_samples: int, tokenizer: Tokenizer, template: str = "chat", seed: int = 42
) -> Iterator[dict]:
    """Yield ``num_samples`` RULER samples of ``task`` sized to ``target_length`` tokens (generation included)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    spec = TASKS[task]
    # RULER seeds the global random and numpy.random.RandomState with the seed in every task's script.
    rng, np_rng = random.Random(seed), np.random.RandomState(seed)
    generator = GENERATORS[spec.kind](spec, target_length, tokenizer, template, seed, rng, np_rng)
    for index, (prompt, answers, tokens) in enumerate(generator.samples(num_samples)):
        input_text, answer_prefix = split_answer_prefix(prompt, spec.answer_prefix)
        yield {
            "index": index,
            "task": task,
            "input": input_text,
            "question": question_of(input_text, generator.template),
            "answer_prefix": answer_prefix,
            "outputs": answers,
            "metric": spec.metric,
            "length": tokens,
            "max_new_tokens": spec.tokens_to_generate,
            "target_length": target_length,
            "template": template,
        }
