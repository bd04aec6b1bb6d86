"""The model's own chat template, rendered as llama-cpp-python renders it (messages -> prompt text)."""
from __future__ import annotations

from typing import Callable, Dict, List

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter


def chat_renderer(llm: llama_cpp.Llama) -> Callable[[List[Dict[str, str]]], str]:
    """A function from chat messages to the prompt text of ``llm``'s GGUF chat template (``tokenizer.chat_template``),
    with the model's own BOS and EOS text; built once, called per chat."""
    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        raise ValueError("the model has no chat template (tokenizer.chat_template)")
    formatter = Jinja2ChatFormatter(template=template,
                                    eos_token=llm.detokenize([llm.token_eos()], special=True).decode(),
                                    bos_token=llm.detokenize([llm.token_bos()], special=True).decode())  # fmt: skip
    return lambda messages: formatter(messages=messages).prompt
