"""Each config field's one-line description, read from the comment above it.

The config dataclasses document a field in the comment block right above it
(or one at the end of its line); that block stays the single place a field
is described, and ``--help`` shows its first sentence. The class's source is
parsed (ast for the fields, tokenize for the comments), so strings holding a
``#`` or a field spanning lines do not confuse it.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from functools import lru_cache

# Longer first sentences are cut at a word, so that --help's lines stay readable.
MAX_CHARS = 90
# A sentence ends at a full stop before a capital (so "e.g. [15" and "1.5 %" do not end one).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(])")


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> one-line description for the dataclass ``cls`` ("" where none is written)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # a class built at run time has no source
        return {f.name: "" for f in dataclasses.fields(cls)}
    lines = source.splitlines()
    comments = _comments(source)
    body = ast.parse(source).body[0].body
    fields = [n for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return {n.target.id: one_line(_block_above(n.lineno, lines, comments) or comments.get(n.end_lineno, ""))
            for n in fields}


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on it."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}


def _block_above(lineno: int, lines: list[str], comments: dict[int, str]) -> str:
    """The comment lines directly above line ``lineno`` (1-based), joined."""
    block = []
    line = lineno - 1
    while line >= 1 and line in comments and lines[line - 1].lstrip().startswith("#"):
        block.append(comments[line])
        line -= 1
    return " ".join(reversed(block))


def one_line(text: str) -> str:
    """The first sentence of ``text``, cut at a word past MAX_CHARS."""
    sentence = _SENTENCE_END.split(" ".join(text.split()), maxsplit=1)[0]
    if len(sentence) <= MAX_CHARS:
        return sentence
    return sentence[:MAX_CHARS].rsplit(" ", 1)[0] + " ..."
