import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_rl.data.byte_tokenizer import ByteTokenizer
from megatron_rl.data.hf_tokenizer import make_tokenizer
from megatron_rl.data.tokenizer import REPLACEMENT

tok = ByteTokenizer()
# every str that UTF-8 holds (hypothesis's text() leaves out lone surrogates by default)
texts = st.text(max_size=60)


def test_layout():
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2) and tok.stop_ids == (1,)
    assert tok.vocab_size == 264
    for tp in (1, 2, 4, 8):
        assert tok.vocab_size % tp == 0
    # id = byte + 4, checked against the bytes Python writes
    assert tok.encode("Az") == [ord("A") + 4, ord("z") + 4]
    assert tok.encode("é") == [0xC3 + 4, 0xA9 + 4]
    assert tok.encode("9", add_bos=True, add_eos=True) == [2, ord("9") + 4, 1]
    assert isinstance(make_tokenizer("byte", None), ByteTokenizer)
    assert tok.fingerprint.startswith("byte:") and tok.fingerprint == ByteTokenizer().fingerprint


@given(texts)
def test_round_trip_any_utf8(text):
    ids = tok.encode(text)
    assert ids == [b + 4 for b in text.encode("utf-8")]
    assert all(4 <= i < 260 for i in ids) and len(ids) <= tok.token_bound(len(text))
    assert tok.decode(ids) == text
    assert tok.decode([tok.pad_id, *tok.encode(text, add_bos=True, add_eos=True), tok.pad_id, tok.pad_id]) == text


@given(st.lists(st.integers(0, 299), max_size=40))
def test_decode_never_raises_on_any_ids(ids):
    """A policy samples any ids: decode always gives text (invalid UTF-8 and stray ids as U+FFFD)."""
    assert isinstance(tok.decode(ids), str)


def test_decode_stops_at_eos_and_marks_stray_ids():
    ids = tok.encode("97")
    assert tok.decode([tok.pad_id, tok.bos_id, *ids, tok.eos_id, *tok.encode("5")]) == "97"
    assert tok.decode([*ids, tok.pad_id, tok.pad_id]) == "97"
    # a special, unused or padded-row id between digits must not vanish (would turn "9?7" into "97")
    for stray in (tok.pad_id, tok.bos_id, tok.unk_id, 260, 263, 300):
        assert tok.decode([ids[0], stray, ids[1]]) == "9" + REPLACEMENT + "7"
    # bytes that are not UTF-8: a lone continuation byte, a cut-off two-byte character
    assert tok.decode([0x80 + 4, *ids]) == REPLACEMENT + "97"
    assert tok.decode([*ids, 0xC3 + 4]) == "97" + REPLACEMENT
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])


def test_lone_surrogate_is_refused():
    assert not tok.can_encode("a\ud800") and tok.can_encode("a€")
    with pytest.raises(ValueError, match="surrogate"):
        tok.encode("a\ud800")
