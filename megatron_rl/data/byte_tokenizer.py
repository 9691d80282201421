"""A byte-level tokenizer for models trained from scratch on any text (`data.tokenizer=byte`): one
token per UTF-8 byte, so every string has ids and nothing is ever `<unk>` (reasoning-gym's
questions, any language, emoji).

Vocabulary (264 ids, so tensor-parallel sizes 1, 2, 4 and 8 divide it):

    0 <pad>   1 <eos>   2 <bos>   3 <unk>     specials (as the character tokenizer's; <unk> is never produced)
    4..259    the bytes 0x00..0xFF (id = byte + 4)
    260..263  <unused260> .. <unused263>       never produced by encode()

    tok = ByteTokenizer()
    tok.encode("é=")                   # [199, 173, 65]: 0xC3 0xA9 '='
    tok.decode(tok.encode("975") + [tok.eos_id])    # "975"

`decode` follows the character tokenizer's rules for what a reward reads: leading <pad>/<bos> are
skipped, decoding stops at the first <eos>, trailing <pad> are dropped, and any other special or
unused id, or one past the vocabulary (a model with padded rows), becomes U+FFFD instead of
vanishing. Bytes that are not valid UTF-8 (a policy can sample any byte sequence) decode as
U+FFFD too (`errors="replace"`), so `decode(encode(s)) == s` for every string and never raises.
"""
from __future__ import annotations

import json
from collections.abc import Iterable

from megatron_rl.data.tokenizer import REPLACEMENT, SPECIALS, SpecialsFirst, fingerprint, response_ids

BYTE_OFFSET = len(SPECIALS)
BYTE_VOCAB_SIZE = 264


class ByteTokenizer(SpecialsFirst):
    """The byte vocabulary above. Stateless; every instance is the same tokenizer."""

    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self):
        tokens = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256))]
        tokens += [f"<unused{i}>" for i in range(len(tokens), BYTE_VOCAB_SIZE)]
        self.fingerprint = fingerprint("byte", json.dumps(tokens).encode())

    def can_encode(self, text: str) -> bool:
        return _utf8(text) is not None

    def text_ids(self, text: str) -> list[int]:
        """text -> one id per UTF-8 byte. A lone surrogate (a str no UTF-8 holds) raises ValueError."""
        data = _utf8(text)
        if data is None:
            raise ValueError(f"{text[:60]!r} holds a lone surrogate, which UTF-8 cannot encode")
        return [b + BYTE_OFFSET for b in data]

    def token_bound(self, num_chars: int) -> int:
        """Tokens of a text of `num_chars` characters: at most 4 (UTF-8's longest character)."""
        return 4 * num_chars

    def decode(self, ids: Iterable[int]) -> str:
        """ids -> text under the rules of the module docstring. Accepts a list or a 1-D tensor;
        a negative id raises ValueError."""
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError(f"negative token id {min(ids)}")
        out, run = [], bytearray()
        for i in response_ids(ids, self.stop_ids, self.pad_id, self.bos_id):
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                run.append(i - BYTE_OFFSET)
            else:
                out += [run.decode("utf-8", errors="replace"), REPLACEMENT]
                run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def _utf8(text: str) -> bytes | None:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return None
