"""A fixed character-level tokenizer for the toy tasks (one token per character, no merges).

Vocabulary (64 ids, so tensor-parallel sizes 1, 2 and 4 divide it):

    0 <pad>   1 <eos>   2 <bos>   3 <unk>     specials (<unk> is only produced by the HF copy)
    4..13     0 1 2 3 4 5 6 7 8 9
    14..25    " " + - * / = , . : > ? _
    26..51    a .. z
    52..63    <unused52> .. <unused63>    never produced by encode()

    tok = CharTokenizer()
    tok.encode("123+456=")              # [5, 6, 7, 15, 8, 9, 10, 19]
    tok.decode(tok.encode("975") + [tok.eos_id, tok.pad_id])    # "975"
    tok.save_pretrained("ckpt/tokenizer")  # loadable by transformers.AutoTokenizer and vLLM

`encode` raises ValueError naming any character outside the vocabulary. `decode` is the one the
reward sees, so it is strict in the direction that matters for RL: a special or unused id in the
middle of a response becomes U+FFFD instead of vanishing (a policy must not be able to turn a wrong
answer into a right one by sampling <pad> between digits).
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIALS = (PAD, EOS, BOS, UNK)
CHARS = "0123456789" + " +-*/=,.:>?_" + "abcdefghijklmnopqrstuvwxyz"
VOCAB_SIZE = 64
REPLACEMENT = "\ufffd"


def fingerprint(kind: str, *parts: bytes) -> str:
    """`kind:` + the first 16 hex digits of the sha256 of `parts`: what a checkpoint records of its
    tokenizer, so that a resume under other token ids is refused (trainer/loop.py)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return f"{kind}:{h.hexdigest()[:16]}"


def response_ids(ids: list[int], stop_ids: tuple[int, ...], pad_id: int, bos_id: int | None) -> list[int]:
    """The ids a reward reads: up to the first end token, without leading pad/bos or trailing pad."""
    ends = [k for k, i in enumerate(ids) if i in stop_ids]
    if ends:
        ids = ids[: ends[0]]
    start, end = 0, len(ids)
    while start < end and ids[start] in (pad_id, bos_id):
        start += 1
    while end > start and ids[end - 1] == pad_id:
        end -= 1
    return ids[start:end]


class SpecialsFirst:
    """What the tokenizers of models trained from scratch share (this character tokenizer, the byte
    tokenizer): the four SPECIALS at ids 0..3, <eos> the one end token, nothing added to a prompt, no
    chat template. A subclass turns text into ids in `text_ids`."""

    pad_id = 0
    eos_id = 1
    bos_id = 2
    unk_id = 3
    stop_ids = (eos_id,)
    prompt_overhead = 0
    chat_template = None  # no chat template (hf_tokenizer.py has render_chat)

    def text_ids(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """text -> ids (`text_ids`), with <bos> before and <eos> after when asked."""
        return [self.bos_id] * add_bos + self.text_ids(text) + [self.eos_id] * add_eos

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids: `encode(text)` (nothing is added to a prompt)."""
        return self.encode(text)


class CharTokenizer(SpecialsFirst):
    """The fixed toy vocabulary above. Stateless; every instance is the same tokenizer."""

    vocab_size = VOCAB_SIZE

    def __init__(self):
        tokens = list(SPECIALS) + list(CHARS)
        tokens += [f"<unused{i}>" for i in range(len(tokens), VOCAB_SIZE)]
        assert len(tokens) == VOCAB_SIZE, len(tokens)
        self._id_to_token = tokens
        self._char_to_id = {c: i for i, c in enumerate(tokens) if i >= len(SPECIALS) and len(c) == 1}
        self.fingerprint = fingerprint("char", json.dumps(tokens).encode())

    @property
    def vocab(self) -> dict[str, int]:
        """token string -> id, all 64 entries (specials and unused included)."""
        return {t: i for i, t in enumerate(self._id_to_token)}

    def can_encode(self, text: str) -> bool:
        return all(c in self._char_to_id for c in text)

    def text_ids(self, text: str) -> list[int]:
        """text -> ids, one per character. Raises ValueError naming the first character (and its
        position) that is not in the vocabulary."""
        ids = []
        for pos, c in enumerate(text):
            i = self._char_to_id.get(c)
            if i is None:
                raise ValueError(
                    f"character {c!r} (U+{ord(c):04X}) at position {pos} of {_around(text, pos)} is not in the "
                    f"toy tokenizer's vocabulary; allowed characters: {CHARS!r}"
                )
            ids.append(i)
        return ids

    def token_bound(self, num_chars: int) -> int:
        """Tokens of a text of `num_chars` characters: one per character."""
        return num_chars

    def decode(self, ids: Iterable[int]) -> str:
        """ids -> text. Leading <pad>/<bos> are skipped, decoding stops at the first <eos>, trailing
        <pad> are dropped; any other special or unused id becomes U+FFFD. Ids outside [0, 64) raise
        ValueError. Accepts a list or a 1-D tensor."""
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < VOCAB_SIZE:
                raise ValueError(f"token id {i} is outside the toy vocabulary [0, {VOCAB_SIZE})")
        n_special = len(SPECIALS)
        return "".join(
            self._id_to_token[i] if n_special <= i < n_special + len(CHARS) else REPLACEMENT
            for i in response_ids(ids, self.stop_ids, self.pad_id, self.bos_id)
        )

    def to_hf(self):
        """The same vocabulary as a `transformers.PreTrainedTokenizerFast` (WordLevel model, one
        token per character, <unk> for characters outside the vocabulary, no BOS/EOS added)."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel(self.vocab, unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([PAD, EOS, BOS, UNK])
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            pad_token=PAD,
            eos_token=EOS,
            bos_token=BOS,
            unk_token=UNK,
            clean_up_tokenization_spaces=False,
            model_max_length=4096,
        )

    def save_pretrained(self, directory: str | os.PathLike) -> list[str]:
        """Write an HF fast-tokenizer directory (tokenizer.json, tokenizer_config.json, and whatever
        else the installed transformers writes) plus `char_vocab.json` (this vocabulary, for humans).
        tokenizer_config's class is set to "PreTrainedTokenizerFast", which transformers 4.x and 5.x
        (and so vLLM) both resolve. Returns the written file paths."""
        os.makedirs(directory, exist_ok=True)
        files = list(self.to_hf().save_pretrained(str(directory)))
        config_path = os.path.join(directory, "tokenizer_config.json")
        with open(config_path) as f:
            config = json.load(f)
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
        path = os.path.join(directory, "char_vocab.json")
        with open(path, "w") as f:
            json.dump({"kind": "megatron_rl.CharTokenizer", "vocab": self.vocab}, f, indent=1)
        return [*files, path]


def _around(text: str, pos: int, width: int = 40) -> str:
    """`text` quoted, or for a long one the `width` characters each side of `pos` and its length
    (an error message quotes the place, not a megabyte of text)."""
    if len(text) <= 2 * width + 1:
        return repr(text)
    a, b = max(pos - width, 0), min(pos + width + 1, len(text))
    return f"{'...' if a else ''}{text[a:b]!r}{'...' if b < len(text) else ''} ({len(text)} characters)"
