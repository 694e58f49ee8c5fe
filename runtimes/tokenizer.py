"""A bundle's tokenizer (its tokenizer/ folder: transformers' save_pretrained files), read with
transformers, which a target needs only to give a prompt as text: the prompt's token ids, in the
tokenizer's chat template where asked, and the generated tokens as text as they come.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TokenizerRefused(Exception):
    """The tokenizer cannot be read, or cannot do what is asked (a chat template it lacks)."""


def read(folder: Path) -> Any:
    """The tokenizer saved in `folder`, as transformers' own classes read it: no code of the
    checkpoint's runs, and nothing is fetched."""
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise TokenizerRefused(
            f"reading the bundle's tokenizer ({folder}) needs transformers, which cannot be "
            f"imported here ({error}): install it (pip install transformers), or give the "
            "prompt's token ids with --ids"
        ) from error
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as error:
        raise TokenizerRefused(
            f"{folder}: transformers cannot read the tokenizer: {type(error).__name__}: {error}"
        ) from error


def prompt_ids(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """`text` encoded as the tokenizer encodes a prompt (with its BOS where it adds one); with
    `chat`, as a user's turn in its chat template with the assistant's turn opened."""
    if not chat:
        return list(tokenizer.encode(text))
    if not tokenizer.chat_template:
        raise TokenizerRefused(
            "the bundle's tokenizer has no chat template: give the prompt without --chat, "
            "written as the model expects it"
        )
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    # transformers 5 returns the encoding (a mapping), earlier versions the ids.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


class TextStream:
    """Generated tokens as text, a piece per token as it comes. A piece is what decoding the
    tokens so far adds to the text printed before: a byte-level token may hold part of a
    character, which decodes as U+FFFD until the rest of its bytes come, so such text waits
    for them. Special tokens (EOS) are not shown."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self._shown = 0

    def piece(self, token: int) -> str:
        self._tokens.append(token)
        text = self._decoded()
        if text.endswith("\ufffd"):
            return ""
        return self._advance(text)

    def rest(self) -> str:
        """What the last tokens left waiting: bytes that never completed a character."""
        return self._advance(self._decoded())

    def _decoded(self) -> str:
        return self._tokenizer.decode(self._tokens, skip_special_tokens=True)

    def _advance(self, text: str) -> str:
        piece, self._shown = text[self._shown :], len(text)
        return piece
