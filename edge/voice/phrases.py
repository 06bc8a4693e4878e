"""Streamed answer text -> speakable pieces, and what of a piece was heard.

:class:`PhraseCutter` cuts at sentence ends, at phrase marks once a piece is long enough,
and at a word boundary when a piece grows past a limit (lower for the first piece, so the
first sound comes early). The pieces always join back to exactly the text fed in.
"""

from __future__ import annotations

import re

SENTENCE_END = ".!?…"
WIDE_END = "。！？\n"  # cut right after these, no space needed
PHRASE_MARK = ",;:"
WIDE_MARK = "，、；："
CLOSERS = "\"')]}”’»"


class PhraseCutter:
    def __init__(self, first_max_chars: int = 24, max_chars: int = 160, min_chars: int = 12) -> None:
        if not (0 < min_chars <= first_max_chars and min_chars <= max_chars):
            raise ValueError(f"need 0 < min_chars <= first_max_chars, max_chars; got {min_chars}, "
                             f"{first_max_chars}, {max_chars}")
        self.first_max_chars, self.max_chars, self.min_chars = first_max_chars, max_chars, min_chars
        self._buf = ""
        self._emitted = 0

    def feed(self, text: str) -> list[str]:
        self._buf += text
        pieces = []
        while (cut := self._cut()) is not None:
            pieces.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            self._emitted += 1
        return pieces

    def flush(self) -> str | None:
        piece, self._buf = self._buf, ""
        return piece or None

    def _cut(self) -> int | None:
        """Where the next piece ends, or None to wait for more text."""
        buf = self._buf
        limit = self.first_max_chars if self._emitted == 0 else self.max_chars
        for i, ch in enumerate(buf[:limit]):
            if ch in WIDE_END:
                return i + 1
            if ch in WIDE_MARK and i + 1 >= self.min_chars:
                return i + 1
            if ch in SENTENCE_END or (ch in PHRASE_MARK and i + 1 >= self.min_chars):
                j = i + 1
                while j < len(buf) and buf[j] in CLOSERS:
                    j += 1
                if j <= limit and j < len(buf) and buf[j].isspace():  # "3.14" and "e.g.x" are not boundaries
                    return j
        if len(buf) <= limit:
            return None
        space = max((m.start() for m in re.finditer(r"\s", buf[1:limit + 1])), default=-1) + 1
        return space if space > 0 else limit


def has_words(text: str) -> bool:
    return any(ch.isalnum() for ch in text)


def word_starts_by_length(text: str, n_samples: int) -> tuple[tuple[int, int], ...]:
    """Where words start in the audio when the engine does not say: in proportion to characters."""
    if not text:
        return ()
    return tuple((m.start(), n_samples * m.start() // len(text)) for m in re.finditer(r"\S+", text))


def spoken_prefix(text: str, n_samples: int, played: int, word_starts: tuple[tuple[int, int], ...] = ()) -> str:
    """The part of ``text`` heard after ``played`` of its ``n_samples`` samples: the words
    whose audio was played to their end (a word ends where the next one starts)."""
    if played >= n_samples:
        return text
    if played <= 0:
        return ""
    cut = 0
    for char, sample in word_starts or word_starts_by_length(text, n_samples):
        if sample > played:
            break
        cut = char
    return text[:cut].rstrip()
