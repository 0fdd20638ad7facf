"""Incremental detokenization with a byte-level tokenizer: characters of 2-4 bytes arrive one byte
(token) at a time, so every piece boundary and every stop string straddles tokens."""

from __future__ import annotations

import pytest

from compute_service.engine.detokenizer import IncrementalDetokenizer
from pagedserve_testing.tiny_model import build_byte_tokenizer

TEXT = "héllo wörld € 😀 done"


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def feed(detok: IncrementalDetokenizer, token_ids: list[int], min_tokens: int = 0) -> list[str]:
    pieces = []
    for i, token in enumerate(token_ids):
        match = detok.add_tokens([token], check_stop=i + 1 >= min_tokens)
        pieces.append(detok.next_piece(is_finished=match is not None))
        if match is not None:
            break
    else:
        pieces.append(detok.next_piece(is_finished=True))
    return pieces


@pytest.mark.unit
def test_pieces_are_whole_characters_and_concatenate_to_the_decode(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT)  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tokenizer)
    pieces = feed(detok, ids)
    assert "".join(pieces) == TEXT == detok.emitted_text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 3 + 2 + 3  # the bytes held back inside é, ö, € and 😀


@pytest.mark.unit
def test_stop_string_across_tokens_is_cut_and_never_emitted(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, stop=("ld €", "zzz"))
    pieces = feed(detok, ids)
    # Pieces are never taken back: the "l" that starts the stop string was never handed out.
    assert "".join(pieces) == "héllo wör"
    assert detok.stop_match is not None and detok.stop_match.stop == "ld €"
    # Generation stopped on the token that completed the stop string (the last byte of €).
    assert len(detok.token_ids) == len(tokenizer.encode("héllo wörld €"))


@pytest.mark.unit
def test_the_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=("done", "o w"))
    assert "".join(feed(detok, tokenizer.encode(TEXT))) == "héll"
    assert detok.stop_match.stop == "o w"


@pytest.mark.unit
def test_stop_strings_before_min_tokens_do_not_count(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, stop=("l",))
    # The first "l"s fall under min_tokens; the one in "wörld" ends the completion.
    pieces = feed(detok, ids, min_tokens=len(tokenizer.encode("héllo")))
    assert "".join(pieces) == "héllo wör"


@pytest.mark.unit
def test_without_a_tokenizer_there_is_no_text() -> None:
    detok = IncrementalDetokenizer(None)
    assert detok.add_tokens([1, 2, 3]) is None
    assert detok.next_piece(is_finished=True) == "" and detok.token_ids == [1, 2, 3]


@pytest.mark.slow
def test_default_model_tokenizer_pieces_concatenate_to_the_decode(default_model) -> None:
    tok = default_model.tokenizer
    text = "Grüße aus Köln — 東京は晴れ 🌤️; naïve café, x² + y² = z²\n\tdone."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=("never",))
    pieces = feed(detok, ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.unit
def test_a_tokenizer_that_decodes_its_own_way_is_called_as_is(tokenizer) -> None:
    """The text comes straight from the Rust tokenizer only where ``decode`` would do nothing more:
    a subclass's own ``_decode`` (or clean-up of spaces) still runs."""
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    shouting = Shouting(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<s>", eos_token="</s>")
    assert "".join(feed(IncrementalDetokenizer(shouting), tokenizer.encode("héllo wörld"))) == "HÉLLO WÖRLD"
    tokenizer.clean_up_tokenization_spaces = True
    try:
        detok = IncrementalDetokenizer(tokenizer)
        assert detok._backend is None  # clean-up on: transformers' decode decides what it does
        assert "".join(feed(detok, tokenizer.encode(TEXT))) == tokenizer.decode(tokenizer.encode(TEXT))
    finally:
        tokenizer.clean_up_tokenization_spaces = False
    assert IncrementalDetokenizer(tokenizer)._backend is tokenizer.backend_tokenizer  # the plain case: direct
