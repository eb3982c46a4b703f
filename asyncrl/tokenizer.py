"""Tokenizer: a thin wrapper over the `tokenizers` library that loads any HF tokenizer.json.

The runtime never needs transformers: an engine, the gateway and the trainer all load tokenizers
through `load_tokenizer`, which accepts
  * `builtin:tiny`: the byte-level BPE shipped in asyncrl/assets (built by
    scripts/build_tiny_tokenizer.py), with GLM-5.1's special tokens;
  * a tokenizer.json file, or a directory holding one (an HF model directory such as GLM-5.1's).
    A tokenizer_config.json next to it supplies `eos_token`.

Two ways to encode text, because the chat template needs both:
  * `encode(text)` recognises special-token strings, as HF tokenizers do by default
    ("<|user|>" becomes the <|user|> id). Use it for text the template itself writes.
  * `encode(text, allow_special=False)` encodes special-token strings as plain text. Use it for
    message content, so a tool output that happens to contain "<|user|>" cannot forge a role token.
Encoding never adds BOS/EOS: the chat template writes every structural token itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import tokenizers

BUILTIN_TINY = "builtin:tiny"
"""`load_tokenizer` spec of the tokenizer shipped with asyncrl (asyncrl/assets/tiny_tokenizer.json)."""

TINY_TOKENIZER_PATH = Path(__file__).parent / "assets" / "tiny_tokenizer.json"

LONG_TEXT_CHARS = 65536
"""Texts longer than this are encoded without holding the GIL (~0.5 s of tokenizing at ~2 us a token),
so a server tokenizing one in a thread keeps answering; shorter ones take the ~10% faster call.
encode_batch_fast (the same ids, no offsets) also holds the GIL less afterwards: for 2.2M tokens ~120 ms
(the ids list) against ~300 ms for encode_batch, which also frees each token's string under it."""

DEFAULT_EOS_TOKEN = "<|endoftext|>"
"""EOS when no tokenizer_config.json names one (GLM's end-of-text token)."""


class Tokenizer:
    """Encode/decode plus lookups of special tokens by name, over a `tokenizers.Tokenizer`."""

    def __init__(self, backend: tokenizers.Tokenizer, eos_token: str | None = DEFAULT_EOS_TOKEN):
        self._backend = backend
        # A second instance that treats special-token strings as plain text (`allow_special=False`).
        self._literal = tokenizers.Tokenizer.from_str(backend.to_str())
        self._literal.encode_special_tokens = True
        self._special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.eos_token = eos_token if eos_token is not None and self.has_token(eos_token) else None

    @classmethod
    def from_file(cls, path: str | Path, eos_token: str | None = DEFAULT_EOS_TOKEN) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)), eos_token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the embedding needs at least this many rows)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special (added) token name -> id."""
        return dict(self._special)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.token_id(self.eos_token)

    def has_token(self, name: str) -> bool:
        return self._backend.token_to_id(name) is not None

    def token_id(self, name: str) -> int:
        """Id of a token by its exact string (e.g. "<|user|>"); KeyError naming it if absent."""
        token_id = self._backend.token_to_id(name)
        if token_id is None:
            raise KeyError(f"token {name!r} is not in the tokenizer's vocabulary")
        return token_id

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`, without BOS/EOS. allow_special=False: special strings stay text."""
        backend = self._backend if allow_special else self._literal
        if len(text) > LONG_TEXT_CHARS:  # the batch call releases the GIL (encode holds it throughout)
            return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs `bytes`): exact for byte-level BPE, where a token
        may hold part of a UTF-8 character and decode([id]) is then only '\ufffd'; else its decoded text."""
        if self._byte_level and token_id not in self._added:
            piece = self._backend.id_to_token(token_id)
            if piece is not None and all(ch in _UNICODE_TO_BYTE for ch in piece):
                return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
        return self.decode([token_id]).encode()

    @property
    def _byte_level(self) -> bool:
        return type(self._backend.decoder).__name__ == "ByteLevel"

    @property
    def _added(self) -> dict:
        return self._backend.get_added_tokens_decoder()


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte -> printable character table of byte-level BPE, inverted (character -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_UNICODE_TO_BYTE = _byte_level_alphabet()


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """`builtin:tiny`, a tokenizer.json path, or a directory holding tokenizer.json."""
    if str(spec) == BUILTIN_TINY:
        return Tokenizer.from_file(TINY_TOKENIZER_PATH)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path} (tokenizer spec {str(spec)!r})")
    return Tokenizer.from_file(path, _eos_from_config(path.parent / "tokenizer_config.json"))


def _eos_from_config(config_path: Path) -> str | None:
    """`eos_token` of an HF tokenizer_config.json (a string or {"content": ...}); default if absent."""
    if not config_path.is_file():
        return DEFAULT_EOS_TOKEN
    eos = json.loads(config_path.read_text()).get("eos_token", DEFAULT_EOS_TOKEN)
    return eos["content"] if isinstance(eos, dict) else eos
