"""A model folder's tokenizer without importing transformers, for the folders where that is exact.

``specdec generate`` spent ~0.75 s of its start-up on the tokenizer: transformers' import (~0.5 s,
most of it building the package's lazy module table) and ``TokenizersBackend``'s construction
(~0.25 s).  What a plain prompt needs of a tokenizer — encode, decode, the vocabulary, the
end-of-sequence id, the incremental decoder — is the ``tokenizers`` library's own ``Tokenizer``,
which transformers' fast tokenizer wraps; it loads in ~0.1 s.  :class:`FastTokenizer` answers
those from it, renders the chat template for plain conversations (role and content strings) in a
Jinja sandbox set up as transformers sets up its own, and hands everything else (other template
calls, special-token lists, saving, what llguidance reads) to the transformers tokenizer, loaded
the first time something asks for it.

Only folders whose ``tokenizer_config.json`` says nothing that would make transformers change the
``tokenizers`` object or post-process its output get one (:func:`plain_config`); the others load
transformers' tokenizer as before.  A folder that declares one of the classes in :data:`REBUILT`
(Qwen2's, Gemma's) gets what that class makes of the file — its vocabulary, merges, post-processor and added
tokens, the rest of the pipeline the class's own — where the file already has that rest, the
normaliser aside, which is then set as the class sets it (:meth:`FastTokenizer.load`).  Tested against transformers' on the shipped folders: encodings
with and without special tokens, decodings with and without them, the vocabulary, its size, the
end-of-sequence id, and rendered conversations (also under a template that exercises the
sandbox's loop controls, namespaces, ``tojson``, ``raise_exception`` and special-token names).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import threading
import weakref
from datetime import datetime
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
_OTHER_SOURCES = ("special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                  "chat_template.json", "additional_chat_templates")
#: the named special tokens a chat template sees by name (transformers' ``special_tokens_map``)
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: message fields transformers copies under other names before rendering (reasoning): such
#: conversations go to transformers
_ALIASED = ("reasoning_content", "thinking", "reasoning")
#: transformers' ``apply_chat_template`` options other than the conversation, tools, documents,
#: ``add_generation_prompt`` and ``tokenize``: a call that sets one goes to transformers
_HF_CHAT_OPTIONS = frozenset({"chat_template", "continue_final_message", "sanitize_control_tokens", "padding", "truncation",
                              "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                              "tokenizer_kwargs"})


#: Qwen2's pre-tokenisation pattern (the split before byte-level encoding), as its tokenizer files carry it
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
#: transformers' tokenizer classes that keep tokenizer.json's vocabulary, merges, post-processor and
#: added tokens but build the rest of the pipeline themselves, by the name a folder declares: the
#: parts they build (as the ``tokenizers`` library serialises them; a test checks each against the
#: installed transformers) — the normaliser, set on the file's parse, and the parts the file must
#: already have as the class builds them, else the folder loads transformers' tokenizer
REBUILT: dict[str, dict[str, Any]] = {
    "Qwen2Tokenizer": {
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False},
    },
    # Gemma's (SentencePiece-style BPE: spaces as "▁", bytes for what the vocabulary lacks)
    "GemmaTokenizer": {
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
        "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                                                     {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False},
    },
}


def added_vocab(tokenizer: Any) -> dict[str, int]:
    """A tokenizer's added tokens by their text (``get_added_vocab``; empty for a tokenizer without one)."""
    added = getattr(tokenizer, "get_added_vocab", None)
    return dict(added()) if added is not None else {}


_DIGESTS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def vocab_digest(tokenizer: Any) -> str:
    """A fingerprint of ``tokenizer``'s vocabulary: the SHA-256 of its (token, id) pairs in id order
    (added tokens included), as hex.  Two tokenizers with the same digest map every id to the same
    token; the edge sends it when it opens a remote session, and a server whose tokenizer differs
    refuses the session instead of verifying drafts whose ids mean other text.  The loaders agree:
    this package's tokenizer and transformers' give the same digest for a folder (~0.1 s for a
    150k vocabulary; kept per tokenizer object)."""
    try:
        return _DIGESTS[tokenizer]
    except (KeyError, TypeError):
        pass
    pairs = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    digest = hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()
    try:
        _DIGESTS[tokenizer] = digest
    except TypeError:  # not weakly referable: computed again next time
        pass
    return digest


@functools.lru_cache(maxsize=4)
def parsed(tokenizer_json: bytes, normalizer: str | None = None) -> Any:
    """The ``tokenizers`` library's ``Tokenizer`` for these tokenizer.json bytes, parsed once per
    process for each distinct file (~0.1 s a parse for SmolLM2's, ~0.8 s for Qwen2's; a target, its
    draft and the quantised models' calibration text share one).  ``normalizer`` (JSON of a
    normaliser, e.g. ``'{"type": "NFC"}'``): set in place of the file's (a separate parse).  Shared:
    callers must not change it."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    if normalizer is not None:
        tokenizer.normalizer = _normalizer(json.loads(normalizer))
    return tokenizer


def _normalizer(spec: dict) -> Any:
    """A ``tokenizers`` normaliser from its JSON (the forms :data:`REBUILT` names)."""
    from tokenizers import normalizers

    if spec == {"type": "NFC"}:
        return normalizers.NFC()
    if spec.get("type") == "Replace" and set(spec) == {"type", "pattern", "content"} and set(spec["pattern"]) == {"String"}:
        return normalizers.Replace(spec["pattern"]["String"], spec["content"])
    raise ValueError(f"no normaliser for {spec}")


def _state(part: Any) -> Any:
    """A pipeline part as the ``tokenizers`` library serialises it (None for none)."""
    return None if part is None else json.loads(part.__getstate__())


def _model_options(model: Any) -> dict:
    """A BPE model's options (not its vocabulary or merges), in the form :data:`REBUILT` names them."""
    names = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", "byte_fallback",
             "ignore_merges")
    return {"type": type(model).__name__, **{n: getattr(model, n, None) for n in names}}


def _token_name(value: Any) -> str | None:
    """A special token as tokenizer_config.json names it: a string, or an added token's ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def plain_config(folder: Path) -> dict | None:
    """``folder``'s tokenizer_config.json when :class:`FastTokenizer` reproduces transformers' tokenizer
    for it (only :data:`PLAIN_KEYS`, no clean-up of decoded spaces, no other tokenizer source file,
    at most one chat template source, a tokenizer.json), else None."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not (folder / "tokenizer.json").is_file():
        return None
    keys = set(config) - PLAIN_KEYS
    if config.get("tokenizer_class") in REBUILT:
        if config.get("add_prefix_space") in (None, False):
            keys.discard("add_prefix_space")  # what such a class builds its pre-tokenizer with (checked by load)
        keys.discard("mask_token")  # a special token's name, which load checks the file has (Gemma's)
    if keys or config.get("clean_up_tokenization_spaces") or any((folder / f).exists() for f in _OTHER_SOURCES):
        return None
    if "chat_template" in config and (folder / "chat_template.jinja").exists():  # which one wins is transformers' call
        return None
    return config


class FastTokenizer:
    """The ``tokenizers`` library's tokenizer of a folder, with transformers' tokenizer behind it for
    everything this class does not answer itself (see the module's description)."""

    #: decoded text is never rewritten around punctuation (:func:`plain_config` admits no clean-up)
    clean_up_tokenization_spaces = False

    def __init__(self, folder: str | Path, config: dict, tokenizer: Any = None) -> None:
        """``tokenizer``: the file's parse as :meth:`load` prepared it (None: parsed here, as written)."""
        self.folder = Path(folder)
        data = (self.folder / "tokenizer.json").read_bytes()
        if tokenizer is None:
            tokenizer = parsed(data)
        #: the transformers class behind this one (:attr:`hf`): the declared class where it rebuilds the file
        self._hf_class = config.get("tokenizer_class") if config.get("tokenizer_class") in REBUILT else None
        if tokenizer.truncation is not None or tokenizer.padding is not None:
            from tokenizers import Tokenizer

            normalizer = tokenizer.normalizer
            tokenizer = Tokenizer.from_str(data.decode("utf-8"))  # its own, changed: not the shared one
            tokenizer.normalizer = normalizer
            tokenizer.no_truncation()  # transformers' wrapper encodes with neither unless asked
            tokenizer.no_padding()
        self._tokenizer = tokenizer  # the name transformers' fast tokenizers give it (see text.TextStream)
        eos = _token_name(config.get("eos_token"))
        self.eos_token_id: int | None = tokenizer.token_to_id(eos) if eos is not None else None
        #: the chat template: chat_template.jinja, else the config's string (None: none, or named ones)
        jinja = self.folder / "chat_template.jinja"
        template = jinja.read_text(encoding="utf-8") if jinja.is_file() else config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._named_templates = isinstance(template, (dict, list))
        self._template_tokens = {k: t for k in _TEMPLATE_TOKENS if (t := _token_name(config.get(k))) is not None}
        self._compiled: Any = None
        self._override: str | None = None  # a chat template set in place of the folder's (set_chat_template)
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    @classmethod
    def load(cls, folder: str | Path, config: dict) -> "FastTokenizer | None":
        """The folder's tokenizer as transformers' declared class makes it: tokenizer.json as written
        for ``TokenizersBackend``; for a class in :data:`REBUILT`, the file with that class's
        normaliser, where the file's pre-tokenizer, decoder and model options are the ones the class
        builds and every special token the config names is one of the file's special added tokens
        (such a class adds the named ones as special tokens; else None: transformers' tokenizer
        decides).  ``config``: :func:`plain_config`'s."""
        rebuilt = REBUILT.get(config.get("tokenizer_class"))
        if rebuilt is None:
            return cls(folder, config)
        tokenizer = parsed((Path(folder) / "tokenizer.json").read_bytes(), json.dumps(rebuilt["normalizer"]))
        if (_state(tokenizer.pre_tokenizer) != rebuilt["pre_tokenizer"] or _state(tokenizer.decoder) != rebuilt["decoder"]
                or _model_options(tokenizer.model) != rebuilt["model"]):
            return None
        special = {t.content: t.special for t in tokenizer.get_added_tokens_decoder().values()}
        if any(special.get(name) is not True for k in _TEMPLATE_TOKENS if (name := _token_name(config.get(k))) is not None):
            return None
        return cls(folder, config, tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def get_added_vocab(self) -> dict[str, int]:
        """The added tokens by their text (transformers' method of the name, without building it)."""
        return {t.content: i for i, t in self._tokenizer.get_added_tokens_decoder().items()}

    def backend_json(self) -> str:
        """The tokenizer as the ``tokenizers`` library serialises it (what transformers' fast class
        would hand on: the same vocabulary, added tokens, normaliser and pipeline; no padding or
        truncation), for libraries that read it (llguidance)."""
        return self._tokenizer.to_str()

    def decode(self, ids: Any, skip_special_tokens: bool = False, **kw: Any) -> str:
        if kw:  # options only transformers' decode knows
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, **kw)
        if isinstance(ids, int):
            ids = [ids]
        elif hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: Any, tools: Any = None, documents: Any = None, *,
                            add_generation_prompt: bool = False, tokenize: bool = True, **kw: Any) -> Any:
        """The conversation rendered with the chat template (``tokenize=False``; messages, tools and
        the template's own variables made of JSON's types alone — strings, numbers, booleans, None,
        lists, string-keyed dicts — which transformers hands the template unchanged, as a server's
        requests are; no documents; other keywords are the template's own variables, as transformers
        passes them); any other call goes to transformers' ``apply_chat_template``."""
        plain = (not tokenize and documents is None and self.chat_template is not None
                 and not set(kw) & _HF_CHAT_OPTIONS
                 and type(conversation) is list and len(conversation) > 0  # empty: transformers' error
                 and all(type(m) is dict and not any(f in m for f in _ALIASED) for m in conversation)
                 and _json_data(conversation) and (tools is None or type(tools) is list and _json_data(tools))
                 and _json_data(kw))
        template = self._template() if plain else None
        if template is None:
            return self.hf.apply_chat_template(conversation, tools=tools, documents=documents,
                                               add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kw)
        # copies, as transformers renders copies, without a message's None-valued keys, as transformers
        # drops them (OpenAI's content: null beside tool calls)
        messages = [{k: copy.deepcopy(v) for k, v in m.items() if v is not None} for m in conversation]
        return template.render(messages=messages, tools=copy.deepcopy(tools), documents=None,
                               add_generation_prompt=add_generation_prompt, **{**self._template_tokens, **copy.deepcopy(kw)})

    def _template(self) -> Any:
        """The compiled chat template, or None where this class leaves it to transformers (named
        templates, or a template its sandbox cannot compile, e.g. one with generation tags)."""
        if self._compiled is None:
            compiled = False
            if self.chat_template is not None and not self._named_templates:
                import jinja2

                try:
                    compiled = _sandbox().from_string(self.chat_template)
                except jinja2.TemplateError:
                    compiled = False
            self._compiled = compiled
        return self._compiled or None

    def set_chat_template(self, template: str) -> None:
        """Render conversations with ``template`` instead of the folder's (``serve --chat-template``),
        here and in transformers' tokenizer behind this one, whenever it loads."""
        self.chat_template = self._override = template
        self._named_templates = False
        self._compiled = None
        if self._hf is not None:
            self._hf.chat_template = template

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
                    if self._hf_class is not None:  # the class AutoTokenizer picks for it (tested)
                        from transformers import AutoTokenizer

                        self._hf = AutoTokenizer.from_pretrained(str(self.folder))
                    else:
                        from transformers.tokenization_utils_tokenizers import TokenizersBackend

                        self._hf = TokenizersBackend.from_pretrained(str(self.folder))
                    if self._override is not None:  # the template in use here
                        self._hf.chat_template = self._override
        return self._hf

    def __getattr__(self, name: str) -> Any:  # special-token lists, save_pretrained, ...
        if name.startswith("__") or name in ("_hf", "_hf_lock", "_hf_class", "_tokenizer", "folder", "_compiled", "chat_template",
                                             "_override"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __getstate__(self) -> dict:  # picklable (a lock, a compiled template and transformers' object are rebuilt)
        return {k: v for k, v in self.__dict__.items() if k not in ("_hf", "_hf_lock", "_compiled")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _hf=None, _hf_lock=threading.Lock(), _compiled=None)

    def __repr__(self) -> str:
        return f"FastTokenizer({str(self.folder)!r}, vocab={len(self)})"


def _json_data(value: Any) -> bool:
    """Whether ``value`` is made of JSON's types alone (exactly: no subclasses, no tuples), which
    transformers' rendering passes to a template as they are."""
    kind = type(value)
    if value is None or kind in (str, int, float, bool):
        return True
    if kind is list:
        return all(_json_data(v) for v in value)
    if kind is dict:
        return all(type(k) is str and _json_data(v) for k, v in value.items())
    return False


def _sandbox() -> Any:
    """A Jinja environment for chat templates as transformers builds its own: sandboxed and
    immutable, blocks trimmed, loop controls, ``tojson`` without HTML escaping, ``raise_exception``,
    ``strftime_now``, and ``dict`` / ``namespace`` that refuse underscore-prefixed names."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed names ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = Namespace
    return env


@functools.lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary stands for.  Such vocabularies
    (GPT-2's scheme, used by SmolLM2 and Qwen2) spell every byte as one printable character: the
    printable Latin-1 bytes as themselves, the other 68 (controls, space, soft hyphen, ...) as
    the characters from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars: dict[str, int] = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(0x100 + extra)] = byte
            extra += 1
    return chars


def _decoder_kinds(part: dict | None) -> set[str]:
    """The types of a serialised ``tokenizers`` decoder and of the decoders a ``Sequence`` holds."""
    if not part:
        return set()
    return {part.get("type", ""), *(k for sub in part.get("decoders") or () for k in _decoder_kinds(sub))}


class TokenBytes:
    """Each token's own bytes, as OpenAI's logprobs report them (``bytes``): a token that holds
    part of a character (a byte-level BPE splits emoji and most CJK characters over several tokens)
    is that part, not U+FFFD, so the bytes of consecutive tokens join to the text's UTF-8.  Read
    from the vocabulary of a ``tokenizers``-backed tokenizer: byte-level entries through
    :func:`_byte_level_chars`, byte-fallback entries (``<0x41>``) as their byte, added tokens as
    their text; elsewhere, or for any other tokenizer, the token's decoded text in UTF-8."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if hasattr(backend, "id_to_token") else None
        kinds = _decoder_kinds(_state(self._backend.decoder)) if self._backend is not None else set()
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._added = ({i: t.content for i, t in self._backend.get_added_tokens_decoder().items()}
                       if self._backend is not None else {})

    def __call__(self, token: int) -> bytes:
        if self._backend is not None and token not in self._added:
            piece = self._backend.id_to_token(token)
            if piece is not None:
                if self._byte_level:
                    chars = _byte_level_chars()
                    if all(c in chars for c in piece):
                        return bytes(chars[c] for c in piece)
                elif self._byte_fallback:
                    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                        return bytes([int(piece[3:5], 16)])
                    return piece.replace("\u2581", " ").encode("utf-8")
        if token in self._added:
            return self._added[token].encode("utf-8")
        return self.tokenizer.decode([token]).encode("utf-8")


def read_chat_template(value: str) -> str:
    """A ``--chat-template`` value: a file's text, or the template itself where it is written
    inline (it holds ``{{`` or ``{%``); checked to compile (ConfigError otherwise)."""
    from specdec.errors import ConfigError

    path = Path(value).expanduser()
    inline = "{{" in value or "{%" in value
    try:
        is_file = not inline and path.is_file()
    except OSError:  # a name no file can have (too long): not a file
        is_file = False
    if inline:
        text = value
    elif is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the chat template {value}: {exc}") from None
    else:
        shown = repr(value) if len(value) <= 200 else repr(value[:200]) + f" (… {len(value)} characters)"
        raise ConfigError(f"--chat-template: {shown} is neither a file nor a Jinja template (no '{{{{' or '{{%')")
    return check_chat_template(text)


def check_chat_template(text: str) -> str:
    """``text`` if it compiles as a chat template (in the sandbox conversations render in), else a
    one-line ConfigError: a broken template fails when it is given, not at the first chat."""
    from specdec.errors import ConfigError

    if not text.strip():
        raise ConfigError("the chat template is empty")
    import jinja2

    try:
        _sandbox().from_string(text)
    except jinja2.TemplateError as exc:
        raise ConfigError(f"the chat template does not compile: {exc}") from None
    return text


def set_chat_template(tokenizer: Any, template: str) -> None:
    """Make ``tokenizer`` (specdec's or transformers') render conversations with ``template``."""
    if isinstance(tokenizer, FastTokenizer):
        tokenizer.set_chat_template(template)
    else:
        tokenizer.chat_template = template


def hf_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer behind ``tokenizer`` (itself unless it is a :class:`FastTokenizer`),
    for libraries that need transformers' class (llguidance)."""
    return tokenizer.hf if isinstance(tokenizer, FastTokenizer) else tokenizer


__all__ = ["FastTokenizer", "PLAIN_KEYS", "REBUILT", "TokenBytes", "hf_tokenizer", "parsed", "plain_config",
           "check_chat_template", "read_chat_template", "set_chat_template"]
