"""A Hugging Face model's own tokenizer (its `tokenizer.json`), for RL on a real checkpoint.

    tok = HfTokenizer("/models/Qwen3-0.6B")        # data.tokenizer=hf with model.hf_dir
    tok.encode_prompt("<|im_start|>user\nWhat is 12+7?<|im_end|>\n<|im_start|>assistant\n")
    tok.decode(response_ids)                        # what the reward sees

It reads `tokenizer.json` with the `tokenizers` library, which runs no code from the folder (no
`trust_remote_code`, no Python tokenizer class), and the special tokens from
`tokenizer_config.json` (`eos_token`, `pad_token`, `bos_token`) and `generation_config.json`
(`eos_token_id`, one id or a list: every one of them ends a response, as in `generate`).

Encoding. A prompt is encoded as `transformers` encodes a text by default: the tokenizer's own
post-processor adds what the model was trained with (Llama 3's `<|begin_of_text|>`; nothing for
Qwen). `tokenizer_config.json`'s `add_bos_token`/`add_eos_token` change nothing, as in transformers
5, which builds a tokenizer.json-backed tokenizer as the file says (its model-specific classes that
rebuild the pipeline from the vocabulary, such as GemmaTokenizer, are not followed). Special-token
spellings in the text become those tokens, so a chat template written into the JSONL prompts
reaches the model as control tokens; a prompt that already starts with the BOS (Llama 3's template
writes it) gets no second one. A continuation (an SFT label) gets no added tokens, and may not
spell a special token. Text the vocabulary cannot represent (an `<unk>` in the ids) raises
ValueError, so JSONL loading names the line at start-up.

Chat template. `chat_template` is the folder's (tokenizer_config.json's "chat_template", a string
or the "default" of a list of named ones, else chat_template.jinja), or None; `render_chat` writes a
conversation with it through transformers' `apply_chat_template`. The rollouts never use it (a
prompt carries its template, observations their delimiters: env.observation_prefix/suffix); the
multi-turn render check does, to report where a chat-template pipeline would train other ids
(rollout/trajectory.py: rerender_chat).

Decoding follows the character tokenizer's rules, which are the ones that matter for a reward:
leading pad/bos are skipped, decoding stops at the first end token, trailing pads are dropped,
and any other special token, or an id the tokenizer does not have (a model's padded vocabulary is
larger: Qwen3's 151,936 rows for 151,669 tokens), becomes U+FFFD instead of vanishing, so a policy
cannot turn a wrong answer into a right one by sampling a control token between digits. A
negative id raises ValueError.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable

from megatron_rl.data.byte_tokenizer import ByteTokenizer
from megatron_rl.data.tokenizer import REPLACEMENT, CharTokenizer, fingerprint, response_ids


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError: name the file
        raise ValueError(f"{path} is not valid JSON ({e}); is the file complete?") from None
    return data if isinstance(data, dict) else {}


def _canonical(spec: dict) -> str:
    """The tokenizer as `tokenizers` understands it (`spec`: its `to_str()` parsed, not modified), in
    one spelling: what decides the ids of every text, not how the file was formatted (pretty or
    compact JSON, merges as "a b" strings or as pairs, as releases of the library write them), so
    re-saving a folder keeps its fingerprint."""
    data = {k: v for k, v in spec.items() if k != "version"}
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("merges"), list):
        data["model"] = {**model, "merges": [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]}
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _chat_template(folder: str, config: dict) -> str | None:
    """The folder's chat template (module docstring), or None."""
    value = config.get("chat_template")
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(value, str) and value:
        return value
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read() or None
    return None


def _added_prefix(tok) -> list[int]:
    """The ids the post-processor puts before a text's own (BOS-like), not those it appends."""
    full = tok.encode("0", add_special_tokens=True).ids
    plain = tok.encode("0", add_special_tokens=False).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i]
    return []


class HfTokenizer:
    """The tokenizer of an HF model folder (see the module docstring).

    vocab_size: the highest id + 1, added tokens included (the model's embedding may be larger).
    eos_id: tokenizer_config's eos_token, else generation_config's first eos_token_id (required);
    stop_ids: eos_id and every generation_config eos_token_id; pad_id (the pad token, else eos);
    bos_id (tokenizer_config's, else the post-processor's first token, else None);
    prompt_overhead: the tokens the post-processor adds to a prompt;
    chat_template: the folder's chat template or None (render_chat);
    fingerprint: "hf:" + a hash of tokenizer.json's content (`_canonical`) and the special ids (a
        checkpoint records it).
    """

    def __init__(self, folder: str | os.PathLike, *, where: str = "data.tokenizer"):
        from tokenizers import Tokenizer

        folder = os.fspath(folder)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"{where}: {folder} has no tokenizer.json (the fast-tokenizer file every HF model "
                             f"folder ships); copy the model's tokenizer files there")
        self.folder = folder
        self._tok = Tokenizer.from_file(path)
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(ids) + 1   # ids may have holes: the count would be too small
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

        gen = _read_json(os.path.join(folder, "generation_config.json")).get("eos_token_id")
        gen = [i for i in (gen if isinstance(gen, list) else [gen]) if isinstance(i, int) and 0 <= i < self.vocab_size]
        eos = token_id("eos_token")
        eos = gen[0] if eos is None and gen else eos
        if eos is None:
            raise ValueError(f"{where}: {folder} names no end-of-sequence token (tokenizer_config.json eos_token, "
                             f"or generation_config.json eos_token_id): the rollouts could never stop")
        self.eos_id = eos
        self.stop_ids = tuple(dict.fromkeys([eos, *gen]))
        pad = token_id("pad_token")
        self.pad_id = eos if pad is None else pad
        self.bos_id = token_id("bos_token")
        added = self._tok.get_added_tokens_decoder()
        self._special_ids = {i for i, t in added.items() if t.special}
        self._special_text = [t.content for t in added.values() if t.special]
        spec = json.loads(self._tok.to_str())   # what the library parsed: one source for unk and fingerprint
        model = spec["model"]   # BPE/WordLevel/WordPiece name the unk token, Unigram numbers it
        unk = model.get("unk_id") if model.get("type") == "Unigram" else model.get("unk_token")
        self._unk_id = self._tok.token_to_id(unk) if isinstance(unk, str) else unk
        self._prefix = _added_prefix(self._tok)
        self.prompt_overhead = len(self._tok.encode("", add_special_tokens=True).ids)
        if self.bos_id is None and self._prefix and self._prefix[0] in self._special_ids:
            self.bos_id = self._prefix[0]   # the post-processor's leading token (Llama 3's begin-of-text)
        self.fingerprint = fingerprint("hf", _canonical(spec).encode(), json.dumps(
            [self.eos_id, self.pad_id, self.bos_id, sorted(self.stop_ids)]).encode())
        self.chat_template = _chat_template(folder, config)  # decides no id: not in the fingerprint
        self._special_names = {k: t for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                               if (t := _token_text(config.get(k))) is not None}
        self._chat = None  # the transformers tokenizer render_chat builds once

    def _ids(self, text: str, added: bool) -> list[int]:
        enc = self._tok.encode(text, add_special_tokens=added)
        if self._unk_id is not None and self._unk_id in enc.ids:
            a, b = enc.offsets[enc.ids.index(self._unk_id)]
            raise ValueError(f"the tokenizer of {self.folder} cannot represent {text[a:b]!r} (character {a})")
        return enc.ids

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids, with what the tokenizer's post-processor adds (a BOS where the model was
        trained with one), unless the text already starts with it (a chat template that writes
        the BOS itself, as Llama 3's does). Special-token spellings become those tokens."""
        plain = self._ids(text, added=False)
        if self._prefix and plain[:len(self._prefix)] == self._prefix:
            return plain
        return self._ids(text, added=True)

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        """A continuation's ids (no tokens added but `add_eos`). A special token's spelling is
        refused: in an answer it would be a control token the reward's decode turns to U+FFFD."""
        for s in self._special_text:
            if s in text:
                raise ValueError(f"the text contains the special token {s!r}, which only a prompt may hold")
        ids = self._ids(text, added=False)
        return [*ids, self.eos_id] if add_eos else ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """`messages` ([{"role": ..., "content": ...}]) as the chat template writes them, with the
        tokenizer's special tokens as its variables (transformers' apply_chat_template, which runs
        the template in a sandboxed Jinja environment). ValueError without a template, or when the
        template fails (it may raise on a conversation it does not take)."""
        if self.chat_template is None:
            raise ValueError(f"the tokenizer of {self.folder} has no chat template")
        if self._chat is None:
            from tokenizers import Tokenizer
            from transformers import PreTrainedTokenizerFast

            copy = Tokenizer.from_str(self._tok.to_str())  # transformers may set options on the one it gets
            self._chat = PreTrainedTokenizerFast(tokenizer_object=copy, **self._special_names)
        try:
            return self._chat.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja2's errors, and the template's own raise_exception
            raise ValueError(f"the chat template of {self.folder} failed: {type(e).__name__}: {e}") from None

    def token_bound(self, num_chars: int) -> int:
        """At most this many prompt tokens for an ASCII text of `num_chars` characters (the built-in
        tasks' prompts, checked at start-up): a byte is at most one token, plus a word-boundary piece
        a SentencePiece-style pre-tokenizer may prepend, plus the post-processor's tokens."""
        return num_chars + 1 + self.prompt_overhead

    def decode(self, ids: Iterable[int]) -> str:
        """ids -> text under the rules of the module docstring. Accepts a list or a 1-D tensor."""
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError(f"negative token id {min(ids)}")
        out, run = [], []
        for i in response_ids(ids, self.stop_ids, self.pad_id, self.bos_id):
            if i >= self.vocab_size or i in self._special_ids or self._tok.id_to_token(i) is None:
                out += [self._tok.decode(run, skip_special_tokens=False), REPLACEMENT]
                run = []
            else:
                run.append(i)
        out.append(self._tok.decode(run, skip_special_tokens=False))
        return "".join(out)


def folder_fingerprint(folder: str | os.PathLike) -> tuple[str | None, str | None]:
    """(the fingerprint of the tokenizer a model folder ships, None) or, when it has no usable one,
    (None, why): what tools/convert_hf_to_mcore.py records beside the converted weights. Any
    failure to read it counts as unusable: `tokenizers` raises a bare Exception on a file it cannot
    parse (a git-lfs pointer, a newer format)."""
    try:
        return HfTokenizer(folder).fingerprint, None
    except Exception as e:  # noqa: BLE001 - see the docstring
        return None, f"{type(e).__name__}: {e}"


def make_tokenizer(choice: str, hf_dir: str | None):
    """data.tokenizer -> the tokenizer: "char" (the toy CharTokenizer), "byte" (ByteTokenizer: UTF-8
    bytes, for a model trained from scratch on any text), "hf" (model.hf_dir's own), or a folder path
    holding a tokenizer.json."""
    if choice == "char":
        return CharTokenizer()
    if choice == "byte":
        return ByteTokenizer()
    if choice == "hf":
        if not hf_dir:
            raise ValueError("data.tokenizer=hf reads model.hf_dir's tokenizer, and model.hf_dir is not set; set it, "
                             "or name a tokenizer folder (data.tokenizer=/path/to/folder)")
        return HfTokenizer(hf_dir, where=f"data.tokenizer=hf (model.hf_dir={hf_dir})")
    return HfTokenizer(choice, where=f"data.tokenizer={choice}")


def padded_vocab(tokenizer_vocab: int, preset_vocab: int) -> int:
    """The vocabulary of a preset model read through an HF tokenizer: the preset's own when it holds
    every id (a real shape: Qwen3's 151,936), else the tokenizer's padded to a multiple of 128
    (megatron's make-vocab-size-divisible-by: any power-of-two TP up to 128 divides it). It does
    not depend on the parallel layout, which a resume may change."""
    if preset_vocab >= tokenizer_vocab:
        return preset_vocab
    return -(-tokenizer_vocab // 128) * 128
