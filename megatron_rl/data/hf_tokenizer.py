"""A Hugging Face model's own tokenizer (its `tokenizer.json`), for RL on a real checkpoint.

    tok = HfTokenizer("/models/Qwen3-0.6B")        # data.tokenizer=hf with model.hf_dir
    tok.encode("What is 12+7?")                     # ids, no special tokens added
    tok.decode(response_ids)                        # what the reward sees

It reads `tokenizer.json` with the `tokenizers` library, which runs no code from the folder (no
`trust_remote_code`, no Python tokenizer class), and the special tokens from
`tokenizer_config.json` (`eos_token`, `pad_token`, `bos_token`), with `generation_config.json`'s
first `eos_token_id` where the config names no eos. Prompts are encoded as plain text: a chat
template is the data's business (write it into the JSONL prompts).

`decode` follows the character tokenizer's rules, which are the ones that matter for a reward:
leading pad/bos are skipped, decoding stops at the first eos, trailing pads are dropped, and any
other special token, or an id past the tokenizer's vocabulary (a model's padded vocabulary is
larger: Qwen3's 151,936 rows for 151,669 tokens), becomes U+FFFD instead of vanishing, so a
policy cannot turn a wrong answer into a right one by sampling a special token between digits.
A negative id raises ValueError.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable

from megatron_rl.data.tokenizer import REPLACEMENT, CharTokenizer, response_ids


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


class HfTokenizer:
    """The tokenizer of an HF model folder (see the module docstring).

    vocab_size: the tokenizer's ids, added tokens included (the model's embedding may be larger).
    eos_id (required), pad_id (the pad token, else eos), bos_id (or None).
    """

    def __init__(self, folder: str | os.PathLike, *, where: str = "data.tokenizer"):
        from tokenizers import Tokenizer

        folder = os.fspath(folder)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"{where}: {folder} has no tokenizer.json (the fast-tokenizer file every HF model "
                             f"folder ships); copy the model's tokenizer files there, or use data.tokenizer=char")
        self.folder = folder
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))

        def token_id(name: str) -> int | None:
            text = _token_text(config.get(name))
            if text is None:
                return None
            i = self._tok.token_to_id(text)
            if i is None:
                raise ValueError(f"{where}: {folder}/tokenizer_config.json names {name}={text!r}, which "
                                 f"tokenizer.json does not have")
            return i

        eos = token_id("eos_token")
        if eos is None:
            gen = _read_json(os.path.join(folder, "generation_config.json")).get("eos_token_id")
            eos = gen[0] if isinstance(gen, list) and gen else gen
        if not isinstance(eos, int) or not 0 <= eos < self.vocab_size:
            raise ValueError(f"{where}: {folder} names no end-of-sequence token (tokenizer_config.json eos_token, "
                             f"or generation_config.json eos_token_id): the rollouts could never stop")
        self.eos_id = eos
        pad = token_id("pad_token")
        self.pad_id = eos if pad is None else pad
        self.bos_id = token_id("bos_token")
        self._special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        self._special_ids = {self._tok.token_to_id(t) for t in self._special}

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """text -> ids as the model was trained to read it, no special tokens added (but `add_bos`,
        `add_eos`). Raises ValueError where the text contains a special token's spelling, which
        would otherwise become a control token the data did not mean."""
        for s in self._special:
            if s in text:
                raise ValueError(f"the text contains the special token {s!r}; remove it from the data")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"{self.folder} has no bos token")
            ids = [self.bos_id, *ids]
        return [*ids, self.eos_id] if add_eos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """ids -> text under the rules of the module docstring. Accepts a list or a 1-D tensor."""
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError(f"negative token id {min(ids)}")
        out, run = [], []
        for i in response_ids(ids, self.eos_id, self.pad_id, self.bos_id):
            if i >= self.vocab_size or i in self._special_ids:
                out += [self._tok.decode(run, skip_special_tokens=False), REPLACEMENT]
                run = []
            else:
                run.append(i)
        out.append(self._tok.decode(run, skip_special_tokens=False))
        return "".join(out)


def make_tokenizer(choice: str, hf_dir: str | None):
    """data.tokenizer -> the tokenizer: "char" (the toy CharTokenizer), "hf" (model.hf_dir's own),
    or a folder path holding a tokenizer.json."""
    if choice == "char":
        return CharTokenizer()
    if choice == "hf":
        if not hf_dir:
            raise ValueError("data.tokenizer=hf reads model.hf_dir's tokenizer, and model.hf_dir is not set; set it, "
                             "or name a tokenizer folder (data.tokenizer=/path/to/folder)")
        return HfTokenizer(hf_dir, where="data.tokenizer=hf")
    return HfTokenizer(choice, where=f"data.tokenizer={choice}")
