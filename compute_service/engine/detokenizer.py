"""Incremental detokenization of one completion, with stop strings matched across token boundaries.

Why not decode each new token on its own: a token is not a string. A byte-level BPE token may hold
half of a UTF-8 character (the rest comes with the next token), and sentencepiece tokenizers drop
or keep a token's leading space depending on what precedes it. Why not decode the whole output each
step: it costs O(length) per token, times every running sequence, every step.

So the text grows from a small window of tokens: ``prefix_offset`` .. ``read_offset`` are tokens
already turned into text, kept as context; each step decodes the window plus the new tokens and
keeps what lies past the context's own decode. The new text counts only once it does not end in
U+FFFD (an incomplete character that the next token may complete); then the window slides. The
pieces concatenate to the decode of the whole output.

Stop strings: the text is searched from a little before its previous end (a match may straddle
it), and the last ``longest stop string - 1`` characters are not handed out while the completion
runs: they may be the start of a stop string that the next token completes. What was handed out
never has to be taken back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

_REPLACEMENT = "\ufffd"


class StopMatch(NamedTuple):
    """Where a stop string matched: ``text[:offset]`` is the completion's final text."""

    stop: str
    offset: int


def _plain_backend(tokenizer: Any | None) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind a Hugging Face tokenizer whose ``decode`` does nothing
    but call it (no clean-up of spaces, no subclass decoding its own way), else None.

    Why: each token costs two decodes of a few ids, and transformers' Python wrapper takes most of
    the time of each; the text is the same.
    """
    if tokenizer is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # not a transformers tokenizer
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast) or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not PreTrainedTokenizerFast._decode or not hasattr(backend, "decode")):
        return None
    return backend


class IncrementalDetokenizer:
    """Text of one completion, handed out in pieces as tokens arrive.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``), or None (no text; stop strings unused).
        stop: stop strings; the first one found ends the completion, and is not part of its text.
    """

    def __init__(self, tokenizer: Any | None, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self._backend = _plain_backend(tokenizer)
        self.stop = tuple(stop)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # settled text (a stop string cut off once matched)
        self._prefix_offset = 0  # token window: [prefix, read) is context already in self.text
        self._read_offset = 0
        self.num_emitted_chars = 0
        self._num_scanned_chars = 0
        self.stop_match: StopMatch | None = None

    def _decode(self, start: int, end: int | None = None) -> str:
        if self._backend is not None:
            return self._backend.decode(self.token_ids[start:end], skip_special_tokens=True)
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True)

    def _settle(self, *, flush: bool = False) -> None:
        """Move the window's new text into ``self.text`` unless it ends mid-character (or ``flush``)."""
        context = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset)
        if len(window) > len(context) and (flush or not window.endswith(_REPLACEMENT)):
            self.text += window[len(context):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)

    def add_tokens(self, token_ids: Sequence[int], *, check_stop: bool = True) -> StopMatch | None:
        """Append tokens; returns the stop match when one of the stop strings now appears.

        With ``check_stop`` False (under ``min_tokens``) the new text is not searched, and never
        will be: a stop string generated before ``min_tokens`` does not end the completion later.
        """
        self.token_ids.extend(token_ids)
        if self.tokenizer is None or self.stop_match is not None:
            return None
        self._settle()
        if self.stop and not check_stop:
            self._num_scanned_chars = len(self.text) + self._holdback  # nothing before here matches
        elif self.stop:
            start = max(0, self._num_scanned_chars - self._holdback)
            hits = [StopMatch(s, i) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            self._num_scanned_chars = len(self.text)
            if hits:
                self.stop_match = min(hits, key=lambda m: m.offset)
                self.text = self.text[: self.stop_match.offset]
        return self.stop_match

    def next_piece(self, is_finished: bool) -> str:
        """The settled text not handed out yet (all of it once the completion finished)."""
        if is_finished and self.tokenizer is not None and self.stop_match is None:
            self._settle(flush=True)  # an incomplete character at the very end: as decode shows it
        end = len(self.text)
        if not is_finished and self.stop_match is None:
            end -= self._holdback
        if end <= self.num_emitted_chars:
            return ""
        piece = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return piece

    @property
    def emitted_text(self) -> str:
        return self.text[: self.num_emitted_chars]
