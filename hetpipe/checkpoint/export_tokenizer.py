"""The tokenizer half of ``python -m hetpipe.export``: which tokenizer the run
used, its files beside the exported weights, and the token ids the HF config names.

The trainer records ``data.tokenizer`` in every checkpoint's trainer state
(``"tokenizer"``: ``byte`` or the tokenizer directory's absolute path). A Hugging
Face tokenizer is written into the export so that ``AutoTokenizer`` loads it
from the same directory as the model; the byte tokenizer has no Hugging Face
form, so the export holds a note saying how ids map to text instead.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from hetpipe.checkpoint.errors import CheckpointError
from hetpipe.data.tokenizer import load_tokenizer

NOTE = "TOKENIZER_NOTE.txt"
# What a Hugging Face tokenizer's save_pretrained may write, and our note:
# files a previous export of ours may have left, replaced by the next one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", NOTE)
NO_IDS: dict[str, Optional[int]] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

BYTE_NOTE = """This model was trained with hetpipe's byte tokenizer, which has no Hugging Face form:
ids 0-255 are the UTF-8 bytes of the text and id 256 ends a document (eos_token_id and
pad_token_id in config.json). Encode text as list(text.encode("utf-8")); decode ids below
256 with bytes(ids).decode("utf-8", errors="replace").
"""
UNKNOWN_NOTE = """The checkpoint this model was exported from does not record its tokenizer (it was
written before hetpipe kept it), so no tokenizer is included and config.json names no
token ids. Export again with --tokenizer DIR (the run's data.tokenizer) or --tokenizer byte.
"""


def tokenizer_record(spec: str) -> str:
    """What a checkpoint records of ``data.tokenizer``: ``byte``, or the directory's
    absolute path (the export may run from another working directory)."""
    return spec if spec == "byte" else str(Path(spec).expanduser().resolve())


def recorded_tokenizer(trainer_state: dict[str, Any]) -> Optional[str]:
    """The run's ``data.tokenizer`` as its checkpoint recorded it, or None."""
    return (trainer_state.get("extra") or {}).get("tokenizer")


def write_tokenizer(spec: Optional[str], out: Path) -> tuple[dict[str, Optional[int]], str]:
    """Write the tokenizer (or the note standing for it) into ``out``; returns
    the bos/eos/pad ids for the HF configs and one line saying what was written."""
    if spec is None:
        (out / NOTE).write_text(UNKNOWN_NOTE)
        return dict(NO_IDS), f"note: the checkpoint does not record its tokenizer; none exported ({NOTE})"
    if spec != "byte" and not Path(spec).is_dir():
        raise CheckpointError(f"the run's tokenizer directory {spec} does not exist any more: "
                              "export with --tokenizer DIR (a copy of it)")
    tokenizer = load_tokenizer(spec)
    if spec == "byte":
        (out / NOTE).write_text(BYTE_NOTE)
        return tokenizer.special_ids(), (f"note: the run used the byte tokenizer, which has no Hugging Face "
                                         f"form: ids are UTF-8 bytes, 256 ends a document ({NOTE})")
    tokenizer.save_pretrained(out)
    return tokenizer.special_ids(), f"tokenizer {spec} written beside the weights"
