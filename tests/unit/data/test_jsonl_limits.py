"""JSON read from users' files is bounded in depth: a row nested past the parser's stack is a
DataError naming file:line (it was `maximum recursion depth exceeded` with no location)."""
import json

import pytest

from megatron_rl.data.jsonl import DataError, load_jsonl


def test_a_row_nested_too_deeply_names_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError, match=rf"^{path}:2: the JSON is nested too deeply to read; each line must be"):
        load_jsonl(path)


def test_a_tokenizer_file_nested_too_deeply_names_the_file(tmp_path):
    from megatron_rl.data.hf_tokenizer import HfTokenizer
    from tests.unit.data.test_hf_tokenizer import write_tokenizer

    folder = write_tokenizer(tmp_path / "tok")
    (folder / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=rf"{folder / 'tokenizer_config.json'}: JSON nested too deeply to read"):
        HfTokenizer(str(folder))
    (folder / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(ValueError, match=rf"{folder / 'tokenizer_config.json'} is not valid JSON"):
        HfTokenizer(str(folder))
