import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_rl.data.tokenizer import CHARS, REPLACEMENT, CharTokenizer

tok = CharTokenizer()


def test_layout():
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert tok.vocab_size == 64 and len(tok.vocab) == 64
    for tp in (1, 2, 4):
        assert tok.vocab_size % tp == 0
    assert tok.encode("123+456=") == [5, 6, 7, 15, 8, 9, 10, 19]
    assert tok.encode("s:5,3,1,4=") == [26 + 18, 22, 9, 20, 7, 20, 5, 20, 8, 19]


@given(st.text(alphabet=CHARS, max_size=40))
def test_round_trip(text):
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, add_bos=True, add_eos=True) + [tok.pad_id] * 3) == text


def test_encode_error_names_character():
    with pytest.raises(ValueError, match=r"character 'A' \(U\+0041\) at position 2"):
        tok.encode("12A")
    with pytest.raises(ValueError, match="'€'"):
        tok.encode("€")
    assert not tok.can_encode("a\n") and tok.can_encode("a b")


def test_decode_stops_at_eos_and_marks_stray_specials():
    ids = tok.encode("97")
    assert tok.decode([tok.pad_id, tok.bos_id, *ids, tok.eos_id, *tok.encode("5")]) == "97"
    assert tok.decode([*ids, tok.pad_id, tok.pad_id]) == "97"  # truncated, right-padded
    # a pad / bos / unused id between digits must not vanish (would turn "9?75" into "975")
    for stray in (tok.pad_id, tok.bos_id, tok.unk_id, 63):
        assert tok.decode([ids[0], stray, ids[1]]) == "9" + REPLACEMENT + "7"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([64])


def test_decode_accepts_tensor():
    torch = pytest.importorskip("torch")
    assert tok.decode(torch.tensor(tok.encode("ab") + [1])) == "ab"


def test_save_pretrained_loads_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    text = "s:5,3,1,4= 123+456=975 hello"
    ids = hf.encode(text, add_special_tokens=True)
    assert ids == tok.encode(text)
    assert hf.decode(ids) == text
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (1, 0, 2)
    assert len(hf) == 64
    assert hf.decode(ids + [1, 0], skip_special_tokens=True) == text
    assert hf.encode("ab€")[-1] == tok.unk_id  # unknown characters become <unk>, not an error
