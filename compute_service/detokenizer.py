"""Incremental detokenization of one completion, with stop strings matched across token boundaries.

Why decode the whole output each step rather than only the new token: a token is not a string. A
byte-level BPE token may hold half of a UTF-8 character (the rest comes with the next token), and
sentencepiece tokenizers drop or add a leading space depending on what precedes the token. Decoding
the full output and handing out only what lies past the text already emitted gives pieces that
concatenate exactly to the full decode. Two things are held back until they are settled:

- a trailing U+FFFD: the decode of an incomplete UTF-8 sequence; the next token may complete it;
- the last ``longest stop string - 1`` characters: they may be the start of a stop string that
  the next token completes. The emitted text never has to be taken back, because it never holds
  a stop string or the start of one.

Cost: one decode of the output so far per token (fast tokenizers decode thousands of tokens in
well under a millisecond); the stop scan looks only at the new characters plus an overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

_REPLACEMENT = "\ufffd"


class StopMatch(NamedTuple):
    """Where a stop string matched: ``text[:offset]`` is the completion's final text."""

    stop: str
    offset: int


class IncrementalDetokenizer:
    """Text of one completion, handed out in pieces as tokens arrive.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``), or None (no text; stop strings unused).
        stop: stop strings; the first one found ends the completion, and is not part of its text.
    """

    def __init__(self, tokenizer: Any | None, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # the full decode of token_ids (stop string included, until cut)
        self.num_emitted_chars = 0
        self._num_scanned_chars = 0
        self.stop_match: StopMatch | None = None

    def add_tokens(self, token_ids: Sequence[int], *, check_stop: bool = True) -> StopMatch | None:
        """Append tokens; returns the stop match when one of the stop strings now appears.

        With ``check_stop`` False (under ``min_tokens``) the new text is not searched, and never
        will be: a stop string generated before ``min_tokens`` does not end the completion later.
        """
        self.token_ids.extend(token_ids)
        if self.tokenizer is None or self.stop_match is not None:
            return None
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if self.stop and not check_stop:
            # Nothing before here may match later (an unfinished character at the end may).
            self._num_scanned_chars = len(self.text.rstrip(_REPLACEMENT)) + self._holdback
        elif self.stop:
            # A match may straddle the previous end: rescan the last (longest stop - 1) chars.
            start = max(0, self._num_scanned_chars - self._holdback)
            hits = [StopMatch(s, i) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            self._num_scanned_chars = len(self.text.rstrip(_REPLACEMENT))
            if hits:
                self.stop_match = min(hits, key=lambda m: m.offset)
                self.text = self.text[: self.stop_match.offset]
        return self.stop_match

    def next_piece(self, is_finished: bool) -> str:
        """The text not handed out yet that is settled (all of it once the completion finished)."""
        end = len(self.text)
        if not is_finished and self.stop_match is None:
            # An incomplete character (the next token may complete it) is not a character yet:
            # drop it first, then keep back what may start a stop string.
            end = len(self.text.rstrip(_REPLACEMENT)) - self._holdback
        if end <= self.num_emitted_chars:
            return ""
        piece = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return piece

    @property
    def emitted_text(self) -> str:
        return self.text[: self.num_emitted_chars]
