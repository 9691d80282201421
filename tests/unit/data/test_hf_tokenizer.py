"""HfTokenizer: a model folder's tokenizer.json, with the reward-safe decode rules of the toy tokenizer."""
import json

import pytest

from megatron_rl.data.hf_tokenizer import REPLACEMENT, HfTokenizer, make_tokenizer
from megatron_rl.data.tokenizer import CharTokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(folder, config: dict | None = None, generation: dict | None = None):
    """A small byte-level BPE (as Qwen's and Llama 3's are) trained here on task-like text, saved as
    an HF model folder's tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"{a}+{b}={a + b}" for a in range(50) for b in range(20)] + ["sort: 3 1 2 -> 1 2 3"],
                            trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"} if config is None else config
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_round_trip_and_special_ids(tmp_path):
    tok = HfTokenizer(write_tokenizer(tmp_path / "m"))
    assert tok.eos_id == tok._tok.token_to_id("<|im_end|>") and tok.pad_id == tok._tok.token_to_id("<|endoftext|>")
    assert tok.bos_id is None and tok.vocab_size == 300
    for text in ("12+7=", "What is 49+19?", "sort: 3 1 2 -> 1 2 3", "ünïcödé ok"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.encode("1+1=", add_eos=True)[-1] == tok.eos_id


def test_decode_is_strict_where_rewards_need_it(tmp_path):
    """Stops at eos, skips leading/trailing pad; a special token or an id past the tokenizer (a
    padded model vocabulary) in the middle becomes U+FFFD instead of vanishing."""
    tok = HfTokenizer(write_tokenizer(tmp_path / "m"))
    one, two = tok.encode("1"), tok.encode("2")
    im_start = tok._tok.token_to_id("<|im_start|>")
    assert tok.decode([tok.pad_id, *one, *two, tok.eos_id, *one]) == "12"
    assert tok.decode([*one, im_start, *two]) == f"1{REPLACEMENT}2"
    assert tok.decode([*one, tok.vocab_size + 5, *two, tok.pad_id, tok.pad_id]) == f"1{REPLACEMENT}2"
    assert tok.decode([]) == ""
    with pytest.raises(ValueError, match="negative token id"):
        tok.decode([*one, -1])


def test_text_holding_a_special_token_is_refused(tmp_path):
    tok = HfTokenizer(write_tokenizer(tmp_path / "m"))
    with pytest.raises(ValueError, match=r"special token '<\|im_end\|>'"):
        tok.encode("2+2=<|im_end|>4")


def test_eos_from_generation_config_and_refusals(tmp_path):
    tok = HfTokenizer(write_tokenizer(tmp_path / "g", config={}, generation={"eos_token_id": [2, 0]}))
    assert tok.eos_id == 2 and tok.pad_id == 2
    with pytest.raises(ValueError, match="names no end-of-sequence token"):
        HfTokenizer(write_tokenizer(tmp_path / "none", config={}))
    with pytest.raises(ValueError, match="eos_token='<eos>', which tokenizer.json does not have"):
        HfTokenizer(write_tokenizer(tmp_path / "bad", config={"eos_token": {"content": "<eos>"}}))
    with pytest.raises(ValueError, match=r"data.tokenizer=.*has no tokenizer.json"):
        make_tokenizer(str(tmp_path / "missing"), None)


def test_make_tokenizer_choices(tmp_path):
    folder = write_tokenizer(tmp_path / "m")
    assert isinstance(make_tokenizer("char", str(folder)), CharTokenizer)
    assert make_tokenizer("hf", str(folder)).vocab_size == 300
    assert make_tokenizer(str(folder), None).vocab_size == 300
    with pytest.raises(ValueError, match="data.tokenizer=hf .*model.hf_dir is not set"):
        make_tokenizer("hf", None)


def test_config_refuses_hf_without_a_model_folder():
    from megatron_rl.config.loader import load_config
    from megatron_rl.config.schema import RunConfig

    with pytest.raises(ValueError, match="data.tokenizer=hf .*model.hf_dir is not set"):
        load_config(None, ["data.tokenizer=hf"])
    assert RunConfig().data.tokenizer == "char"
