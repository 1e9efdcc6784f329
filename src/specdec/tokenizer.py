"""A model folder's tokenizer without importing transformers, for the folders where that is exact.

``specdec generate`` spent ~0.75 s of its start-up on the tokenizer: transformers' import (~0.5 s,
most of it building the package's lazy module table) and ``TokenizersBackend``'s construction
(~0.25 s).  What a plain prompt needs of a tokenizer — encode, decode, the vocabulary, the
end-of-sequence id, the incremental decoder — is the ``tokenizers`` library's own ``Tokenizer``,
which transformers' fast tokenizer wraps; it loads in ~0.1 s.  :class:`FastTokenizer` answers
those from it and hands everything else (the chat template, special-token lists, saving, what
llguidance reads) to the transformers tokenizer, loaded the first time something asks for it.

Only folders whose ``tokenizer_config.json`` says nothing that would make transformers change the
``tokenizers`` object or post-process its output get one (:func:`plain_config`); the others load
transformers' tokenizer as before.  Tested against transformers' on the shipped folders: encodings
with and without special tokens, decodings with and without them, the vocabulary, its size and the
end-of-sequence id.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

#: tokenizer_config.json keys that change nothing :class:`FastTokenizer` does itself: metadata, the
#: special tokens' names (the end-of-sequence one is read here), the added tokens (already in
#: tokenizer.json) and the chat template (asked of transformers).  Any other key — ``add_bos_token``,
#: ``add_prefix_space``, ``clean_up_tokenization_spaces`` set true, ... — keeps transformers' tokenizer.
PLAIN_KEYS = frozenset({
    "backend", "tokenizer_class", "is_local", "local_files_only", "model_max_length", "bos_token", "eos_token",
    "pad_token", "unk_token", "added_tokens_decoder", "chat_template", "clean_up_tokenization_spaces",
    "model_input_names", "padding_side", "truncation_side", "name_or_path",
})
#: files besides tokenizer.json and tokenizer_config.json that would feed transformers' tokenizer
_OTHER_SOURCES = ("special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt")


def _token_name(value: Any) -> str | None:
    """A special token as tokenizer_config.json names it: a string, or an added token's ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def plain_config(folder: Path) -> dict | None:
    """``folder``'s tokenizer_config.json when :class:`FastTokenizer` reproduces transformers' tokenizer
    for it (only :data:`PLAIN_KEYS`, no clean-up of decoded spaces, no other tokenizer source file,
    a tokenizer.json), else None."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not (folder / "tokenizer.json").is_file():
        return None
    if set(config) - PLAIN_KEYS or config.get("clean_up_tokenization_spaces") or any((folder / f).exists() for f in _OTHER_SOURCES):
        return None
    return config


class FastTokenizer:
    """The ``tokenizers`` library's tokenizer of a folder, with transformers' tokenizer behind it for
    everything this class does not answer itself (see the module's description)."""

    #: decoded text is never rewritten around punctuation (:func:`plain_config` admits no clean-up)
    clean_up_tokenization_spaces = False

    def __init__(self, folder: str | Path, config: dict) -> None:
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        tokenizer.no_truncation()  # transformers' wrapper encodes with neither unless asked
        tokenizer.no_padding()
        self._tokenizer = tokenizer  # the name transformers' fast tokenizers give it (see text.TextStream)
        eos = _token_name(config.get("eos_token"))
        self.eos_token_id: int | None = tokenizer.token_to_id(eos) if eos is not None else None
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Any, skip_special_tokens: bool = False, **kw: Any) -> str:
        if kw:  # options only transformers' decode knows
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, **kw)
        if isinstance(ids, int):
            ids = [ids]
        elif hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def hf(self) -> Any:
        """transformers' tokenizer of the same folder, loaded on first use (thread-safe)."""
        if self._hf is None:
            with self._hf_lock:
                if self._hf is None:
                    from transformers.tokenization_utils_tokenizers import TokenizersBackend

                    self._hf = TokenizersBackend.from_pretrained(str(self.folder))
        return self._hf

    def __getattr__(self, name: str) -> Any:  # the chat template, special-token lists, save_pretrained, ...
        if name.startswith("__") or name in ("_hf", "_hf_lock", "_tokenizer", "folder"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __repr__(self) -> str:
        return f"FastTokenizer({str(self.folder)!r}, vocab={len(self)})"


def hf_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer behind ``tokenizer`` (itself unless it is a :class:`FastTokenizer`),
    for libraries that need transformers' class (llguidance)."""
    return tokenizer.hf if isinstance(tokenizer, FastTokenizer) else tokenizer


__all__ = ["FastTokenizer", "PLAIN_KEYS", "hf_tokenizer", "plain_config"]
