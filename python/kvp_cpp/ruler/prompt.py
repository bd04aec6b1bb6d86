"""Token counting with the model's own tokenizer, and prompt templates (RULER's model template + answer prefix)."""
from __future__ import annotations

from typing import Optional, Protocol, Tuple

TEMPLATE_KINDS = ("chat", "base")
_USER_MESSAGE = "<<kvp-ruler-user-message>>"


class Tokenizer(Protocol):
    chat_template: Optional[str]
    bos_token: str
    eos_token: str

    def count(self, text: str) -> int:
        """Number of tokens of ``text`` as the prompt is fed to the model (no BOS added, special tokens parsed)."""


class LlamaTokenizer:
    """The tokenizer and chat template of a GGUF model, loaded through llama-cpp-python without weights."""

    def __init__(self, model_path: str):
        import llama_cpp

        self.model_path = model_path
        self._llm = llama_cpp.Llama(model_path, vocab_only=True, verbose=False)
        self.chat_template = self._llm.metadata.get("tokenizer.chat_template")
        self.bos_token = self._token_text(self._llm.token_bos())
        self.eos_token = self._token_text(self._llm.token_eos())

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._llm.detokenize([token], special=True).decode("utf-8", errors="replace")

    def count(self, text: str) -> int:
        return len(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))


def _escape_braces(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def chat_wrapper(tokenizer: Tokenizer) -> Tuple[str, str]:
    """The text the model's chat template puts before and after a single user message, generation prompt included."""
    if not tokenizer.chat_template:
        raise ValueError("the model has no chat template (tokenizer.chat_template); use the 'base' template")
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = Jinja2ChatFormatter(
        tokenizer.chat_template,
        eos_token=tokenizer.eos_token,
        bos_token=tokenizer.bos_token,
        add_generation_prompt=True,
    )
    rendered = formatter(messages=[{"role": "user", "content": _USER_MESSAGE}]).prompt
    if rendered.count(_USER_MESSAGE) != 1:
        raise ValueError("the chat template does not render the user message verbatim")
    head, tail = rendered.split(_USER_MESSAGE)
    return head, tail


def prompt_template(task_template: str, answer_prefix: str, kind: str, tokenizer: Tokenizer) -> str:
    """RULER's ``model_template.format(task_template=...) + answer_prefix``, as one ``str.format`` template.

    With ``chat`` the task is the single user message and the answer prefix follows the assistant header, so the
    model's reply continues the answer prefix. ``base`` is the bare task template.
    """
    if kind == "base":
        return task_template + answer_prefix
    if kind != "chat":
        raise ValueError(f"unknown template {kind!r}; expected one of {TEMPLATE_KINDS}")
    head, tail = chat_wrapper(tokenizer)
    return _escape_braces(head) + task_template + _escape_braces(tail) + answer_prefix


def split_answer_prefix(prompt: str, answer_prefix: str) -> Tuple[str, str]:
    """RULER's cut: at the last occurrence of the first 10 characters of the task's answer prefix."""
    cut = prompt.rfind(answer_prefix[:10])
    if cut < 0:
        raise ValueError(f"the prompt does not contain the answer prefix {answer_prefix[:10]!r}")
    return prompt[:cut], prompt[cut:]
