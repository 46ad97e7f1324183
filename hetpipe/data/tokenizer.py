"""Tokenizers: a dependency-free byte tokenizer and local Hugging Face tokenizers.

Preprocessing, the demo corpus and the loader's vocabulary check all need the
same small surface (encode, decode, end-of-document id, vocabulary size), so
both kinds present it. The byte tokenizer lets everything run with no
tokenizer files at all; real runs point at a local tokenizer directory (the
machines that train usually cannot reach a model hub, so nothing is fetched).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
import numpy.typing as npt

from hetpipe.errors import DataError


class ByteTokenizer:
    """UTF-8 bytes are the ids 0..255; 256 marks the end of a document."""

    name = "byte"
    vocab_size = 257

    @property
    def eod(self) -> int:
        """End-of-document id."""
        return 256

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int32) of ``text``'s UTF-8 bytes."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:meth:`encode` for each text."""
        return [self.encode(text) for text in texts]

    def special_ids(self) -> dict[str, int | None]:
        """The ids a Hugging Face config names: no beginning-of-text token, the
        end of document as end and padding."""
        return {"bos_token_id": None, "eos_token_id": self.eod, "pad_token_id": self.eod}

    def decode(self, ids: npt.ArrayLike) -> str:
        """Text of ``ids``; EOD ids are dropped and invalid UTF-8 is replaced."""
        ids = np.asarray(ids).reshape(-1)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (``save_pretrained`` output)."""

    def __init__(self, path: str | Path) -> None:
        # transformers is heavy to import; only runs that use it pay for it.
        from transformers import AutoTokenizer

        self.path = Path(path)
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as exc:  # transformers raises many kinds; all mean "can't load this"
            reason = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise DataError(
                f"tokenizer '{self.path}' could not be loaded as a Hugging Face tokenizer "
                f"directory ({reason})"
            ) from exc
        if self._tokenizer.eos_token_id is None:
            raise DataError(
                f"tokenizer '{self.path}' has no eos token, so documents cannot be separated "
                "(set eos_token in its tokenizer_config.json)"
            )

    @cached_property
    def name(self) -> str:
        """Directory name plus a digest of the tokenizer's definition, so two
        different tokenizers never share a cache entry."""
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is not None:
            definition = backend.to_str()
        else:
            definition = repr(sorted(self._tokenizer.get_vocab().items()))
        digest = hashlib.sha256(definition.encode("utf-8")).hexdigest()[:12]
        return f"{self.path.resolve().name}-{digest}"

    @property
    def eod(self) -> int:
        """End-of-document id: the tokenizer's eos token."""
        return int(self._tokenizer.eos_token_id)

    @property
    def vocab_size(self) -> int:
        """All ids the tokenizer can emit, added tokens included."""
        return len(self._tokenizer)

    def special_ids(self) -> dict[str, int | None]:
        """The ids a Hugging Face config names; padding falls back to the end of
        document where the tokenizer has no pad token (generate() needs one)."""
        tok = self._tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else self.eod
        return {"bos_token_id": tok.bos_token_id, "eos_token_id": self.eod, "pad_token_id": pad}

    def save_pretrained(self, out: Path) -> None:
        """Write the tokenizer's files into ``out`` (AutoTokenizer loads them)."""
        self._tokenizer.save_pretrained(str(out))

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int32) of ``text``, without special tokens."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:meth:`encode` for each text, in one call into the Rust tokenizer."""
        # verbose=False: documents are routinely longer than model_max_length,
        # and the warning about it is meaningless for pretraining data.
        ids = self._tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [np.asarray(row, dtype=np.int32) for row in ids]

    def decode(self, ids: npt.ArrayLike) -> str:
        """Text of ``ids`` with special tokens (EOD included) skipped."""
        return self._tokenizer.decode(
            np.asarray(ids).reshape(-1).tolist(), skip_special_tokens=True
        )


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` gives :class:`ByteTokenizer`; anything else is a local HF tokenizer directory."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise DataError(
            f"tokenizer '{spec}' not found: expected 'byte' or a local Hugging Face "
            "tokenizer directory"
        )
    return HFTokenizer(path)
