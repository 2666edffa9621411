"""Tokenizers behind the `Tokenizer` protocol: a dependency-free byte tokenizer and an HF adapter.

`ByteTokenizer` lets tests, demos and random-init models run with no downloads: ids 0..2 are the
specials (pad, bos, eos) and byte b is id b + 3, so vocab_size is 259. `HFTokenizer` wraps a
`transformers` or raw `tokenizers` tokenizer loaded from a local directory, for real checkpoints;
both packages are imported lazily so the byte path needs neither.

Chat models: `HFTokenizer.chat_template` is the template of a transformers tokenizer (None without one), and
`apply_chat_template(messages)` returns exactly `tokenizer.apply_chat_template(messages,
add_generation_prompt=True)`'s ids, the prompt a chat model was trained to answer. A raw `tokenizers`
tokenizer (no transformers installed) has no template engine, so it has no chat template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moerl.tasks.base import TaskError, Tokenizer

# Tokens that end a turn or a document in chat templates (Qwen/ChatML, Llama 3): a model stops on them as on EOS.
# What a tokenizer directory must hold, one of these sets (a model directory without them loaded as a tokenizer of
# one id, and every prompt became zero tokens).
VOCABULARY_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",),
                    ("spiece.model",), ("tiktoken.model",))
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


class ByteTokenizer:
    """UTF-8 bytes shifted past three specials. `encode` adds no specials; `decode` skips them."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    stop_token_ids = (2,)
    offset = 3
    vocab_size = 256 + offset
    chat_template = None  # no chat template: prompts are raw text
    directory = None  # not loaded from files: `moerl export` has no tokenizer files to copy

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """Bytes of the non-special ids; callers cut at EOS first. Broken UTF-8 (a sampled
        partial character) becomes U+FFFD rather than an error; an id outside the vocab raises."""
        out = bytearray()
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside the byte vocabulary [0, {self.vocab_size})")
            if i >= self.offset:
                out.append(i - self.offset)
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """Adapter over a `transformers` tokenizer or a `tokenizers.Tokenizer`.

    Special ids come from the wrapped tokenizer (transformers) or must be given (raw `tokenizers`,
    which knows no roles). pad falls back to eos; bos may be None (Qwen-style tokenizers have none).
    `stop_token_ids`: EOS, then those of END_TOKENS that the vocabulary has.
    """

    def __init__(self, inner: Any, *, eos_token_id: int | None = None, pad_token_id: int | None = None,
                 bos_token_id: int | None = None, directory: str | None = None) -> None:
        self.inner = inner
        self.directory = directory  # the local directory it was loaded from (its files travel with checkpoints)
        self._raw = hasattr(inner, "token_to_id") and not hasattr(inner, "convert_tokens_to_ids")
        eos = eos_token_id if eos_token_id is not None else getattr(inner, "eos_token_id", None)
        if eos is None:
            raise TaskError("tokenizer has no EOS token: completions could never end")
        pad = pad_token_id if pad_token_id is not None else getattr(inner, "pad_token_id", None)
        self.eos_token_id: int = int(eos)
        self.pad_token_id: int = int(pad) if pad is not None else self.eos_token_id
        bos = bos_token_id if bos_token_id is not None else getattr(inner, "bos_token_id", None)
        self.bos_token_id: int | None = None if bos is None else int(bos)
        found = [self._special_id(t) for t in END_TOKENS]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys([self.eos_token_id] + [i for i in found
                                                                                         if i is not None]))

    def _special_id(self, token: str) -> int | None:
        """The id of a token string, or None when the vocabulary lacks it (never the unknown token's id)."""
        if self._raw:
            return self.inner.token_to_id(token)
        try:
            i = self.inner.convert_tokens_to_ids(token)
        except (KeyError, ValueError, TypeError):
            return None
        unk = getattr(self.inner, "unk_token_id", None)
        return None if i is None or (unk is not None and i == unk) else int(i)

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True) if self._raw else len(self.inner)

    def encode(self, text: str) -> list[int]:
        out = self.inner.encode(text, add_special_tokens=False)
        return list(out.ids if self._raw else out)

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return None if self._raw else (getattr(self.inner, "chat_template", None) or None)

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
        """Ids of `messages` rendered with the chat template and the assistant's generation prompt appended.
        kwargs go to the template (e.g. Qwen3's `enable_thinking=False`)."""
        if self.chat_template is None:
            raise TaskError("this tokenizer has no chat template")
        out = self.inner.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                             **kwargs)
        if isinstance(out, Mapping):  # a BatchEncoding despite return_dict=False (some transformers versions)
            out = out["input_ids"]
        return [int(i) for i in out]

    def render_chat(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        """The text `apply_chat_template` tokenizes (what the model reads), for logs and trajectories."""
        if self.chat_template is None:
            raise TaskError("this tokenizer has no chat template")
        return self.inner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> HFTokenizer:
        """Load from a local directory only (never the network, never its code: trust_remote_code=False):
        transformers if installed, else `tokenizers` from tokenizer.json with special tokens read from
        tokenizer_config.json."""
        directory = Path(path)
        if not directory.is_dir():
            raise TaskError(f"tokenizer directory {str(directory)!r} not found")
        _check_vocabulary_files(directory)
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return cls._from_tokenizers_json(directory)
        try:  # a tokenizer directory is data, never code: an `auto_map` there is refused, not asked about on stdin
            inner = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError) as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            cause = ("it names custom code (auto_map in tokenizer_config.json), which moerl never runs: use a "
                     "tokenizer that transformers implements" if "custom code" in str(exc) else
                     lines[0] if lines else type(exc).__name__)
            raise TaskError(f"cannot load tokenizer from {str(directory)!r}: {cause}") from None
        return cls(inner, directory=str(directory))

    @classmethod
    def _from_tokenizers_json(cls, directory: Path) -> HFTokenizer:
        try:
            from tokenizers import Tokenizer as RawTokenizer
        except ImportError as exc:
            raise TaskError("loading an HF tokenizer needs `transformers` or `tokenizers` installed") from exc
        file = directory / "tokenizer.json"
        if not file.is_file():
            raise TaskError(f"no tokenizer.json in {str(directory)!r}")
        raw = RawTokenizer.from_file(str(file))
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}

        def special(role: str) -> int | None:
            token = config.get(f"{role}_token")
            token = token.get("content") if isinstance(token, dict) else token
            return raw.token_to_id(token) if token else None

        return cls(raw, eos_token_id=special("eos"), pad_token_id=special("pad"), bos_token_id=special("bos"),
                   directory=str(directory))


def _check_vocabulary_files(directory: Path) -> None:
    """TaskError naming what `directory` lacks when it holds none of VOCABULARY_FILES' sets."""
    if any(all((directory / name).is_file() for name in names) for names in VOCABULARY_FILES):
        return
    held = sorted(p.name for p in directory.iterdir())
    wanted = ", ".join(" + ".join(names) for names in VOCABULARY_FILES)
    raise TaskError(f"tokenizer directory {str(directory)!r} has no tokenizer files (none of {wanted}; it holds "
                    f"{', '.join(held[:8]) + (' ...' if len(held) > 8 else '') or 'nothing'}): download the model's "
                    "tokenizer files into it, or set task.options.tokenizer to a tokenizer directory")


def make_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` -> ByteTokenizer, anything else is a local HF tokenizer directory."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer.from_pretrained(spec)
