"""RULER task definitions: templates, answer prefixes and per-task settings, word for word from RULER.

Sources: ``scripts/data/synthetic/constants.py`` (templates, answer prefixes, tokens to generate) and
``scripts/synthetic.yaml`` (per-task arguments) of NVIDIA/RULER.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assigned the value {query}, they are: "
)

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\n"
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)

# The repeated sentence of the "noise" haystack (niah_single_1, vt).
NOISE_SENTENCE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."


@dataclass(frozen=True)
class NiahConfig:
    type_haystack: str  # "noise", "essay" or "needle"
    type_needle_k: str  # "words", "numbers" or "uuids"
    type_needle_v: str
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1


@dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: str  # "niah", "vt", "cwe" or "fwe"
    template: str
    answer_prefix: str
    tokens_to_generate: int
    metric: str
    niah: Optional[NiahConfig] = None

    @property
    def needs_essay(self) -> bool:
        return self.niah is not None and self.niah.type_haystack == "essay"


def _niah(name: str, config: NiahConfig) -> TaskSpec:
    return TaskSpec(name, "niah", NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, 128, "string_match_all", config)


TASKS = {
    spec.name: spec
    for spec in (
        _niah("niah_single_1", NiahConfig("noise", "words", "numbers")),
        _niah("niah_single_2", NiahConfig("essay", "words", "numbers")),
        _niah("niah_single_3", NiahConfig("essay", "words", "uuids")),
        _niah("niah_multikey_1", NiahConfig("essay", "words", "numbers", num_needle_k=4)),
        _niah("niah_multikey_2", NiahConfig("needle", "words", "numbers")),
        _niah("niah_multikey_3", NiahConfig("needle", "uuids", "uuids")),
        _niah("niah_multivalue", NiahConfig("essay", "words", "numbers", num_needle_v=4)),
        _niah("niah_multiquery", NiahConfig("essay", "words", "numbers", num_needle_q=4)),
        TaskSpec("vt", "vt", VT_TEMPLATE, VT_ANSWER_PREFIX, 30, "string_match_all"),
        TaskSpec("cwe", "cwe", CWE_TEMPLATE, CWE_ANSWER_PREFIX, 120, "string_match_all"),
        TaskSpec("fwe", "fwe", FWE_TEMPLATE, FWE_ANSWER_PREFIX, 50, "string_match_all"),
    )
}

SYNTHETIC_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
ESSAY_TASKS = tuple(name for name, spec in TASKS.items() if spec.needs_essay)
