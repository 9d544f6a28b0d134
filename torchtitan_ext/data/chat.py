"""Chat / SFT conversations: JSONL lines ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered
with the tokenizer's chat template (jinja2: its own from ``tokenizer_config.json`` when it has one, else
``DEFAULT_TEMPLATE``) into tokens, with a mask of the tokens the loss counts: the assistant's replies (each
with the template's text after it) and the end-of-text token that closes the conversation.

The mask comes from rendering prefixes: the reply to turn i spans from the end of ``render(messages[:i],
add_generation_prompt=True)`` to the end of ``render(messages[:i + 1])``, so any template that renders a
conversation as the concatenation of its turns works."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from torchtitan_ext.errors import ConfigError

DEFAULT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ROLES = ("system", "user", "assistant", "tool")


def _environment():
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat data needs the jinja2 package: pip install -e '.[data]'") from None
    # transformers' apply_chat_template renders with both on: a template must give the exported tokenizer's text
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)


class ChatTemplate:
    def __init__(self, source: str | None = None):
        self.source = source or DEFAULT_TEMPLATE
        self._template = _environment().from_string(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)


def read_conversations(path: Path) -> Iterator[tuple[int, list[dict]]]:
    """(line number, messages) of a chat JSONL file; a malformed line is one ConfigError naming it."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
                ok = isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                    for m in messages)
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                raise ConfigError(f"{path}:{number}: expected {{\"messages\": [{{\"role\": one of {', '.join(ROLES)}, "
                                  f"\"content\": text}}, ...]}}")
            yield number, messages


def conversation_tokens(messages: list[dict], tokenizer, template: ChatTemplate, where: str
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss mask) of one conversation, closed by the end-of-text token (in the mask when the last
    turn is the assistant's)."""
    tokens = np.asarray(tokenizer.encode(template.render(messages)), dtype=np.int64)
    mask = np.zeros(len(tokens), dtype=bool)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = np.asarray(tokenizer.encode(template.render(messages[:i], add_generation_prompt=True)))
        end_tokens = np.asarray(tokenizer.encode(template.render(messages[:i + 1])), dtype=np.int64)
        start = len(prefix)
        if not (np.array_equal(end_tokens, tokens[:len(end_tokens)]) and np.array_equal(prefix, tokens[:start])):
            raise ConfigError(f"{where}: the chat template does not render this conversation as the concatenation "
                              "of its turns (the assistant tokens cannot be located)")
        mask[start:len(end_tokens)] = True
    eot = np.array([tokenizer.eot_id], dtype=np.int64)
    return np.concatenate([tokens, eot]), np.concatenate([mask, [messages[-1]["role"] == "assistant"]])
