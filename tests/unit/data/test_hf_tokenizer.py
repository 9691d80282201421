"""HfTokenizer: a model folder's tokenizer.json, with the reward-safe decode rules of the toy tokenizer."""
import json

import pytest

from megatron_rl.data.hf_tokenizer import REPLACEMENT, HfTokenizer, make_tokenizer, padded_vocab
from megatron_rl.data.tokenizer import CharTokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


TEXTS = [f"{a}+{b}={a + b}" for a in range(50) for b in range(20)] + ["sort: 3 1 2 -> 1 2 3"]


def write_tokenizer(folder, config: dict | None = None, generation: dict | None = None, bos: bool = False):
    """A small byte-level BPE (as Qwen's and Llama 3's are) trained here on task-like text, saved as
    an HF model folder's tokenizer files; bos: a post-processor that starts every prompt with
    <|begin_of_text|> (as Llama 3's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[*SPECIALS, "<|begin_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    if bos:
        first = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", first)])
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
    assert tok.bos_id is None and tok.vocab_size == 300 and tok.stop_ids == (tok.eos_id,)
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


def test_prompts_carry_chat_templates_and_the_models_bos(tmp_path):
    """Special-token spellings in a prompt become control tokens (a chat template in the data); the
    tokenizer's post-processor adds its BOS to a prompt, never to a continuation."""
    tok = HfTokenizer(write_tokenizer(tmp_path / "m"))
    start, end = (tok._tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    ids = tok.encode_prompt("<|im_start|>user 1+2=<|im_end|><|im_start|>assistant ")
    assert ids.count(start) == 2 and ids.count(end) == 1 and ids[0] == start and tok.prompt_overhead == 0
    llama = HfTokenizer(write_tokenizer(tmp_path / "bos", bos=True))
    bos = llama._tok.token_to_id("<|begin_of_text|>")
    assert llama.encode_prompt("1+2=") == [bos, *llama.encode("1+2=")] and llama.prompt_overhead == 1
    assert llama.decode(llama.encode_prompt("1+2=")) == "1+2="   # a leading BOS is skipped
    assert llama.encode_prompt("<|begin_of_text|>1+2=") == llama.encode_prompt("1+2=")   # no second BOS
    with pytest.raises(ValueError, match="only a prompt may hold"):
        tok.encode("4<|im_end|>")   # a label (continuation) may not spell a control token


def test_every_end_token_stops_the_response(tmp_path):
    """generation_config's eos_token_id list (Qwen: <|im_end|> and <|endoftext|>): each one ends
    what the reward reads, and each is a stop id of the engines."""
    tok = HfTokenizer(write_tokenizer(tmp_path / "m", generation={"eos_token_id": [7, 0, 2]}))
    end, text = tok._tok.token_to_id("<|im_end|>"), tok._tok.token_to_id("<|endoftext|>")
    assert tok.eos_id == end == 2 and tok.stop_ids == (2, 7, 0) and text == 0
    assert tok.decode(tok.encode("19") + [0] + tok.encode("junk")) == "19"


def test_unrepresentable_text_is_refused(tmp_path):
    """Text that would need <unk> is refused, as the char tokenizer refuses a character it lacks
    (JSONL loading names the line at start-up)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    word = Tokenizer(models.WordLevel({c: i for i, c in enumerate(["<unk>", "<eos>", *"0123456789+="])},
                                      unk_token="<unk>"))
    word.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    (tmp_path / "w").mkdir()
    word.save(str(tmp_path / "w" / "tokenizer.json"))
    (tmp_path / "w" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    chars = HfTokenizer(tmp_path / "w")
    assert chars.encode("1+2=") == [3, 12, 4, 13]
    with pytest.raises(ValueError, match="cannot represent 'x' \\(character 2\\)"):
        chars.encode("1+x")
    from tokenizers import models as m

    uni = Tokenizer(m.Unigram([("<unk>", 0.0), ("<eos>", 0.0), ("a", -1.0), ("b", -1.0)], unk_id=0))
    (tmp_path / "u").mkdir()
    uni.save(str(tmp_path / "u" / "tokenizer.json"))
    (tmp_path / "u" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    unigram = HfTokenizer(tmp_path / "u")
    assert unigram.encode("ab") == [2, 3]
    with pytest.raises(ValueError, match="cannot represent 'z'"):
        unigram.encode("abz")


def test_token_bound_holds_for_a_sentencepiece_style_tokenizer(tmp_path):
    """The start-up length check bounds a task prompt's tokens by its characters: true for a
    SentencePiece-style tokenizer that prepends a word-boundary piece (Mistral, Llama 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    # few merges: the prepended "▁" stays a token of its own, one more than the characters
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=25, special_tokens=["<unk>", "</s>"]))
    (tmp_path / "sp").mkdir()
    tok.save(str(tmp_path / "sp" / "tokenizer.json"))
    (tmp_path / "sp" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    sp = HfTokenizer(tmp_path / "sp")
    for text in ["012+045=", "1 2 3", "sort: 3 1 2 ->", "9", *TEXTS[::37]]:
        assert len(sp.encode_prompt(text)) <= sp.token_bound(len(text)), text
    assert any(len(sp.encode_prompt(t)) > len(t) for t in ["012+045=", "1 2 3"])   # the bound is needed


def test_preset_vocabulary_under_an_hf_tokenizer(tmp_path):
    """The preset's own vocabulary when it holds the tokenizer, else a multiple of 128; never
    dependent on TP (a resume may change it); model.hf_dir's config brings its own."""
    from megatron_rl.config.schema import ModelSection
    from megatron_rl.trainer.startup import preset_vocab

    assert padded_vocab(151_669, 151_936) == 151_936   # the preset's real shape holds the tokenizer
    assert padded_vocab(300, 64) == 384 and padded_vocab(300, 320) == 320
    tok = HfTokenizer(write_tokenizer(tmp_path / "m"))
    assert preset_vocab(ModelSection(arch="qwen3", size="tiny"), tok) == 384
    assert preset_vocab(ModelSection(arch="qwen3", size="qwen3-0.6b"), tok) == 151_936
    assert preset_vocab(ModelSection(hf_dir=str(tmp_path), size="qwen3-0.6b"), tok) is None
    assert preset_vocab(ModelSection(arch="qwen3", size="tiny"), CharTokenizer()) == 64


def test_bos_is_only_a_leading_special_token(tmp_path):
    """A post-processor that appends (an EOS after the text) adds no BOS; an ordinary token it
    puts first is not taken for one (decode would drop a real first response token)."""
    from tokenizers import Tokenizer, processors

    folder = write_tokenizer(tmp_path / "m")
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    end = raw.token_to_id("<|im_end|>")
    raw.post_processor = processors.TemplateProcessing(single="$A <|im_end|>", special_tokens=[("<|im_end|>", end)])
    raw.save(str(folder / "tokenizer.json"))
    tok = HfTokenizer(folder)
    assert tok.bos_id is None and tok.encode_prompt("1") == [*tok.encode("1"), end] and tok.prompt_overhead == 1
    h = raw.token_to_id("1")
    raw.post_processor = processors.TemplateProcessing(single="1 $A", special_tokens=[("1", h)])
    raw.save(str(folder / "tokenizer.json"))
    tok = HfTokenizer(folder)
    assert tok.bos_id is None and tok.decode(tok.encode("12")) == "12"


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
    from megatron_rl.config.schema import RunConfig
    from megatron_rl.configure import load_config

    with pytest.raises(ValueError, match="data.tokenizer=hf .*model.hf_dir is not set"):
        load_config(None, ["data.tokenizer=hf"])
    assert RunConfig().data.tokenizer == "char"


def _rewrite(folder, edit=lambda raw: None, pairs: bool = False):
    """tokenizer.json re-saved as compact JSON (another library release or editor would), after
    `edit`; pairs: merges written as ["a", "b"] pairs, as newer `tokenizers` releases write them."""
    raw = json.loads((folder / "tokenizer.json").read_text())
    edit(raw)
    if pairs:
        raw["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in raw["model"]["merges"]]
    (folder / "tokenizer.json").write_text(json.dumps(raw, separators=(",", ":")))
    return folder


def test_fingerprint_names_the_token_ids(tmp_path):
    """What a checkpoint records of its tokenizer: the same for the same content wherever it lies and
    however the file is formatted, different when the vocabulary, the merges, the post-processor or
    the end tokens differ."""
    from megatron_rl.data.hf_tokenizer import folder_fingerprint

    base = HfTokenizer(write_tokenizer(tmp_path / "a")).fingerprint
    assert base.startswith("hf:") and HfTokenizer(write_tokenizer(tmp_path / "b")).fingerprint == base
    assert HfTokenizer(_rewrite(write_tokenizer(tmp_path / "compact"))).fingerprint == base
    assert HfTokenizer(_rewrite(write_tokenizer(tmp_path / "pairs"), pairs=True)).fingerprint == base

    def drop_merge(raw):   # one merge fewer: other ids for some texts
        raw["model"]["merges"] = raw["model"]["merges"][:-1]

    assert HfTokenizer(_rewrite(write_tokenizer(tmp_path / "edit"), drop_merge)).fingerprint != base
    assert HfTokenizer(write_tokenizer(tmp_path / "bos", bos=True)).fingerprint != base   # another post-processor
    other_eos = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    assert HfTokenizer(write_tokenizer(tmp_path / "eos", config=other_eos)).fingerprint != base
    stops = HfTokenizer(write_tokenizer(tmp_path / "gen", generation={"eos_token_id": [0, 1]})).fingerprint
    assert stops != base   # more end tokens; their order does not matter
    assert HfTokenizer(write_tokenizer(tmp_path / "gen2", generation={"eos_token_id": [1, 0]})).fingerprint == stops
    assert CharTokenizer().fingerprint == CharTokenizer().fingerprint and CharTokenizer().fingerprint.startswith("char:")
    assert folder_fingerprint(tmp_path / "a") == (base, None)
    assert folder_fingerprint(tmp_path / "nothing")[0] is None
    (tmp_path / "lfs").mkdir()
    (tmp_path / "lfs" / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\n")
    fp, why = folder_fingerprint(tmp_path / "lfs")   # tokenizers raises a bare Exception on it
    assert fp is None and why


@pytest.mark.parametrize("case", ["plain", "flags", "llama_flags", "bos_post_processor", "flag_off_post_processor"])
def test_prompts_encode_as_transformers_encodes_them(tmp_path, case):
    """encode_prompt against transformers' AutoTokenizer on the same folder (the independent
    reference): the post-processor written in tokenizer.json decides the added tokens, and
    tokenizer_config's add_bos_token/add_eos_token do not change it (transformers 5 builds a
    tokenizer.json-backed tokenizer as the file says). Not compared: the classes that transformers 5
    rebuilds from the vocabulary with their own pre-tokenizer (Qwen2Tokenizer, GemmaTokenizer): on this
    test's made-up tokenizer.json they split text differently from the file."""
    from transformers import AutoTokenizer
    from transformers import __version__ as transformers_version

    specials = {"eos_token": "<|im_end|>", "bos_token": "<|begin_of_text|>"}
    config, bos = {
        "plain": ({"eos_token": "<|im_end|>"}, False),
        "flags": ({**specials, "add_bos_token": True, "add_eos_token": True,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, False),
        "llama_flags": ({**specials, "add_bos_token": True, "tokenizer_class": "LlamaTokenizerFast"}, False),
        "bos_post_processor": ({**specials, "tokenizer_class": "PreTrainedTokenizerFast"}, True),
        "flag_off_post_processor": ({**specials, "add_bos_token": False,
                                     "tokenizer_class": "PreTrainedTokenizerFast"}, True),
    }[case]
    folder = write_tokenizer(tmp_path / case, config=config, bos=bos)
    ours, ref = HfTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    file_pre = json.loads((folder / "tokenizer.json").read_text())["pre_tokenizer"]
    if json.loads(ref.backend_tokenizer.to_str())["pre_tokenizer"] != file_pre:
        # transformers 5.17 (the GPU machine's) rebuilds LlamaTokenizerFast from the vocabulary with a
        # Metaspace pre-tokenizer, as 5.23 does for the classes named above: no longer a reference
        pytest.skip(f"transformers {transformers_version} rebuilds {config['tokenizer_class']} with its own "
                    "pre-tokenizer instead of the file's")
    for text in ["1+2=", "What is 49+19?", "<|im_start|>user 3+4=<|im_end|><|im_start|>assistant ", "sort: 3 1 2 ->"]:
        assert ours.encode_prompt(text) == ref(text)["input_ids"], text
