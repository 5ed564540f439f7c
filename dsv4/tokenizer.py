"""Text in and out: a checkpoint's `tokenizer.json` through the `tokenizers` package.

A model directory without tokenizer.json works with token ids only; `load_tokenizer` returns None then.
A chat template is applied only when tokenizer_config.json carries one (and only to str prompts): it is
rendered with jinja2 if that is installed, in a sandbox as transformers does; otherwise `encode` says how to proceed.
`encode_chat` renders a whole conversation (system / user / assistant turns) the same way; a tokenizer without a
template falls back to `FALLBACK_CHAT_FORMAT`: one "role: content" line per message, then "assistant:".
"""

from __future__ import annotations

import json
import os


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


FALLBACK_CHAT_FORMAT = "{role}: {content}\n"
"""How `render_chat` writes each message when the tokenizer has no chat template (then "assistant:" follows)."""


def _compile_template(source: str):
    """A chat template compiled as transformers does: jinja2's sandbox, trim_blocks / lstrip_blocks, plus the
    raise_exception() and tojson helpers that checkpoint templates call."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError(
            "the tokenizer has a chat template (tokenizer_config.json) but jinja2 is not installed: "
            "`pip install jinja2`, or encode the prompt without it (chat_template=False, --no-chat-template)"
        ) from None

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(source)


class TextTokenizer:
    def __init__(self, tokenizer, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = None  # the compiled chat template, on first use

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
            return self.encode_chat([{"role": "user", "content": text}])
        return self.tokenizer.encode(text).ids

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model reads it: the checkpoint's chat template (tokenizer_config.json) rendered
        with jinja2, or, without one, `FALLBACK_CHAT_FORMAT`. A template's raise_exception() raises ValueError."""
        if not self.chat_template:
            lines = [FALLBACK_CHAT_FORMAT.format(role=m["role"], content=m["content"]) for m in messages]
            return "".join(lines) + ("assistant:" if add_generation_prompt else "")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")  # fmt: skip

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation: [{"role": "system" | "user" | "assistant", "content": str}, ...]. A template
        writes its own special tokens (BOS included); the fallback format gets the tokenizer's usual ones."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=not self.chat_template).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


def load_tokenizer(model_dir: str | os.PathLike | None) -> TextTokenizer | None:
    """The directory's tokenizer, or None when it has no tokenizer.json (token ids only)."""
    if model_dir is None or not os.path.isfile(os.path.join(os.fspath(model_dir), "tokenizer.json")):
        return None
    return TextTokenizer.from_dir(model_dir)
