"""Text in and out: a checkpoint's `tokenizer.json` through the `tokenizers` package.

A model directory without tokenizer.json works with token ids only; `load_tokenizer` returns None then.
A chat template is applied only when tokenizer_config.json carries one (and only to str prompts): it is
rendered with jinja2 if that is installed, as transformers does; otherwise `encode` says how to proceed.
"""

from __future__ import annotations

import json
import os


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class TextTokenizer:
    def __init__(self, tokenizer, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> TextTokenizer:
        from tokenizers import Tokenizer

        model_dir = os.fspath(model_dir)
        tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        config = {}
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return cls(tokenizer, chat_template=template, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")))  # fmt: skip

    def encode(self, text: str, *, chat_template: bool = True) -> list[int]:
        """Token ids of a user prompt, wrapped in the chat template when there is one and `chat_template`."""
        if chat_template and self.chat_template:
            try:
                import jinja2
            except ImportError:
                raise ValueError(
                    "the tokenizer has a chat template (tokenizer_config.json) but jinja2 is not installed: "
                    "`pip install jinja2`, or encode the prompt without it (chat_template=False, --no-chat-template)"
                ) from None
            text = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(self.chat_template).render(
                messages=[{"role": "user", "content": text}], add_generation_prompt=True,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )  # fmt: skip
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


def load_tokenizer(model_dir: str | os.PathLike | None) -> TextTokenizer | None:
    """The directory's tokenizer, or None when it has no tokenizer.json (token ids only)."""
    if model_dir is None or not os.path.isfile(os.path.join(os.fspath(model_dir), "tokenizer.json")):
        return None
    return TextTokenizer.from_dir(model_dir)
