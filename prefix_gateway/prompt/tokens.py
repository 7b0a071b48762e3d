"""The engine's tokens: prompts tokenized as the engine tokenizes them (`--tokenizer`), so the
prefix index's blocks are the engine's own blocks of token ids rather than blocks of characters.

The tokenizer is the model's `tokenizer.json` (read with `tokenizers`); a chat is first rendered
with the model's chat template (`chat_template` of `tokenizer_config.json`, jinja2 in a sandbox,
as transformers renders it) with the generation prompt appended, then encoded without added
special tokens, as vLLM does for chat; a completion's text is encoded with them. Ids are packed
as 4-byte words, so the chained block hashing of `hashing.py` works on them unchanged, in blocks
of `TOKEN_BYTES * block_size` bytes.

Encoding costs about a microsecond a token, and most of a prompt was seen before (a shared
system prompt, a conversation's earlier turns). Every encode goes through `encode_batch`, which
releases the GIL while it runs (`encode` holds it): a long prompt tokenized on a worker thread
leaves the event loop free meanwhile (see `prefix_gateway.proxy.handler`).

The tokenizer splits text at its added tokens before anything else, so the text between two of
them is encoded the same alone: those pieces are encoded once and kept (`PieceCache`). Whether
that holds for a tokenizer is checked when it is loaded; where it does not, every prompt is
encoded whole.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from prefix_gateway.config import ConfigError

TOKEN_BYTES = 4
"""Bytes of one packed token id."""
_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
_PROBE = [
    {"role": "system", "content": "  Be brief;\n\tsay 12 things, ok?  "},
    {"role": "user", "content": "héllo  wörld\n\n- one\n- two  "},
    {"role": "assistant", "content": " Sure: 3.14 and x_y."},
    {"role": "user", "content": "again?"},
]
"""A conversation whose rendering checks that encoding piece by piece equals encoding whole."""


class TokenizerError(ConfigError):
    """A `--tokenizer` path that does not hold a usable tokenizer; raised at start-up."""


def pack(ids: Sequence[int]) -> bytes:
    """Token ids as the bytes that block hashing chains (4 bytes each, native order)."""
    return array("I", ids).tobytes()


def encoded(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> bytes:
    """The packed ids of `text`, encoded without holding the GIL."""
    return pack(tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def unpack(packed: bytes) -> list[int]:
    ids = array("I")
    ids.frombytes(packed)
    return ids.tolist()


class EngineTokenizer:
    """A model's tokenizer and chat template; `chat` and `text` give packed ids, or None when
    the template cannot render the request (routing then falls back to characters)."""

    def __init__(
        self, tokenizer: Tokenizer, chat_template: str | None, special: dict[str, str]
    ) -> None:
        self._tokenizer = tokenizer
        self._special = special
        self._pieces: PieceCache | None = None
        self._template = None
        if chat_template is not None:
            environment = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            environment.filters["tojson"] = _tojson
            environment.globals["raise_exception"] = _raise
            environment.globals["strftime_now"] = _strftime_now
            self._template = environment.from_string(chat_template)
            self._pieces = PieceCache.checked(tokenizer, self._render(_PROBE))
        self.merges_inline_system = _refuses_inline_system(chat_template)
        """The template takes a system message only first: vLLM's Messages endpoint moves
        later ones into the first (as `prefix_gateway.prompt.messages_api` does then)."""

    @classmethod
    def load(cls, path: str | Path) -> EngineTokenizer:
        """From a model folder (`tokenizer.json`, `tokenizer_config.json`) or a `tokenizer.json`
        (with the config beside it, if any: without a chat template, chats are routed by
        characters)."""
        location = Path(path)
        folder = location if location.is_dir() else location.parent
        file = folder / "tokenizer.json" if location.is_dir() else location
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            raise TokenizerError(f"cannot read a tokenizer from {file}: {exc}") from exc
        config_file = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_file.is_file():
            config = json.loads(config_file.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {item.get("name"): item.get("template") for item in template}
            template = named.get("default")
        template_file = folder / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        special = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        return cls(tokenizer, template if isinstance(template, str) else None, special)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def chat(self, messages: list[Any], tools: list[Any] | None) -> bytes | None:
        """The packed ids of a chat's prompt, the generation prompt included."""
        rendered = self.rendered(messages, tools)
        if rendered is None:
            return None
        if self._pieces is not None:
            return self._pieces.encode(rendered)
        return encoded(self._tokenizer, rendered, False)

    def rendered(self, messages: list[Any], tools: list[Any] | None = None) -> str | None:
        """A chat's prompt as the template renders it (None: it cannot render it)."""
        if self._template is None:
            return None
        try:
            return self._render(messages, tools)
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError):
            return None

    @property
    def pieces(self) -> PieceCache | None:
        """The cache of encoded pieces (None: this tokenizer encodes prompts whole)."""
        return self._pieces

    def text(self, prompt: str, add_special_tokens: bool = True) -> bytes:
        """The packed ids of a completion's prompt (or, without special tokens, of an answer)."""
        return encoded(self._tokenizer, prompt, add_special_tokens)

    def _render(self, messages: list[Any], tools: list[Any] | None = None) -> str:
        assert self._template is not None
        return self._template.render(
            messages=messages, tools=tools, add_generation_prompt=True, **self._special
        )


class PieceCache:
    """Encodes text piece by piece between the tokenizer's added tokens, keeping the most
    recently used pieces' ids (bounded in pieces and in characters). Safe to share between the
    event loop and a tokenizing thread: the lock guards the kept pieces, never an encode."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_pieces: int = 4096,
        max_chars: int = 16 * 1024 * 1024,
        min_chars: int = 32,
    ) -> None:
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self._ids = {token.content: pack([id]) for id, token in added.items()}
        ordered = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None
        self._kept: OrderedDict[str, bytes] = OrderedDict()
        self._chars = 0
        self._max_pieces, self._max_chars, self._min_chars = max_pieces, max_chars, min_chars
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def checked(cls, tokenizer: Tokenizer, probe: str) -> PieceCache | None:
        """A cache for `tokenizer` if piecewise encoding gives its ids for `probe`, else None."""
        added = tokenizer.get_added_tokens_decoder().values()
        if any(token.lstrip or token.rstrip or token.single_word for token in added):
            return None  # such tokens take the spaces around them: pieces are not independent
        cache = cls(tokenizer)
        whole = pack(tokenizer.encode(probe, add_special_tokens=False).ids)
        return cache if cache.encode(probe) == whole else None

    def encode(self, text: str) -> bytes:
        """The packed ids of `text`, as encoding it whole without added special tokens."""
        if self._split is None:
            return self._encode(text)
        ids = self._ids
        return b"".join(
            ids[piece] if piece in ids else self._encode(piece)
            for piece in self._split.split(text)
            if piece
        )

    def _encode(self, piece: str) -> bytes:
        kept = self._kept
        with self._lock:
            found = kept.get(piece)
            if found is not None:
                kept.move_to_end(piece)
                self.hits += 1
                return found
            self.misses += 1
        packed = encoded(self._tokenizer, piece, False)
        if self._min_chars <= len(piece) <= self._max_chars // 4:
            with self._lock:
                if piece not in kept:  # another thread may have encoded it meanwhile
                    kept[piece] = packed
                    self._chars += len(piece)
                while len(kept) > self._max_pieces or self._chars > self._max_chars:
                    oldest, _ = kept.popitem(last=False)
                    self._chars -= len(oldest)
        return packed


def _refuses_inline_system(chat_template: str | None) -> bool:
    """vLLM's test, in a bare sandbox as its own: no template, or one that fails to render a
    system message after the first user message."""
    if not chat_template:
        return True
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    system, user = {"role": "system", "content": "t"}, {"role": "user", "content": "t"}
    try:
        environment.from_string(chat_template).render(
            messages=[system, user, system, user], add_generation_prompt=False
        )
    except TemplateError:
        return True
    return False


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken map."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
