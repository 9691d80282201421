import json
import re

import pytest

from megatron_rl.data import CharTokenizer, DataError, Example, JsonlPrompts, load_jsonl

GOOD = '{"prompt": "1+2=", "label": "3"}'


def _write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _error(tmp_path, bad_row, line=3, **kwargs) -> str:
    """Put bad_row on `line` between good rows; return the DataError message."""
    lines = [GOOD] * (line - 1) + [bad_row, GOOD]
    path = _write(tmp_path, lines)
    with pytest.raises(DataError) as info:
        load_jsonl(path, **kwargs)
    msg = str(info.value)
    assert msg.startswith(f"{path}:{line}: "), msg
    return msg


def test_loads_rows_and_ignores_extra_fields(tmp_path):
    path = _write(tmp_path, [GOOD, "", '{"prompt": "s:2,1=", "label": "12", "task": "sorting", "id": 7}', "  "])
    assert load_jsonl(path) == ([Example("1+2=", "3", "jsonl"), Example("s:2,1=", "12", "sorting")], 0)
    assert load_jsonl(path, default_task="add")[0][0].task == "add"


def test_invalid_json(tmp_path):
    msg = _error(tmp_path, '{"prompt": "1+2=", "label": "3"', line=7)
    assert "invalid JSON" in msg and "one JSON object" in msg


def test_not_an_object(tmp_path):
    msg = _error(tmp_path, '["1+2=", "3"]')
    assert "expected a JSON object, got array" in msg


@pytest.mark.parametrize("field", ["prompt", "label"])
def test_missing_field(tmp_path, field):
    row = json.loads(GOOD)
    del row[field]
    msg = _error(tmp_path, json.dumps(row), line=7)
    assert msg.endswith(f'data.jsonl:7: field "{field}" is missing; every row needs "prompt" and "label" strings')


@pytest.mark.parametrize("field,value", [("prompt", 12), ("label", 3), ("label", None), ("task", ["a"])])
def test_wrong_type(tmp_path, field, value):
    row = {**json.loads(GOOD), field: value}
    msg = _error(tmp_path, json.dumps(row))
    assert f'field "{field}" must be a string' in msg and json.dumps(json.dumps(value)) in msg


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt(tmp_path, prompt):
    msg = _error(tmp_path, json.dumps({"prompt": prompt, "label": "3"}), line=2)
    assert 'field "prompt" is empty' in msg


def test_not_utf8_and_empty_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"prompt": "\xff", "label": "1"}\n')
    with pytest.raises(DataError, match="^" + re.escape(f"{path}:2: not valid UTF-8")):
        load_jsonl(path)
    empty = _write(tmp_path, [""], name="empty.jsonl")
    with pytest.raises(DataError, match="^" + re.escape(f"{empty}: no rows")):
        load_jsonl(empty)


def test_tokenizer_validation_names_line_field_and_character(tmp_path):
    msg = _error(tmp_path, json.dumps({"prompt": "1+2=", "label": "Three"}), line=4, tokenizer=CharTokenizer())
    assert 'field "label" cannot be tokenized' in msg and "'T'" in msg and "position 0" in msg


def test_jsonl_prompts_epochs_and_determinism(tmp_path):
    rows = [json.dumps({"prompt": f"{i}+0=", "label": str(i)}) for i in range(10)]
    path = _write(tmp_path, rows)
    src = JsonlPrompts(path, seed=1)
    assert len(src) == 10
    epoch0 = [e for step in range(5) for e in src.batch(step, 2)]
    epoch1 = [e for step in range(5, 10) for e in src.batch(step, 2)]
    assert sorted(e.label for e in epoch0) == sorted(e.label for e in epoch1) == sorted(map(str, range(10)))
    assert epoch0 != epoch1  # each epoch has its own permutation
    assert JsonlPrompts(path, seed=1).batch(7, 2) == src.batch(7, 2)  # pure in (seed, step, size)
    assert JsonlPrompts(path, seed=2).batch(0, 10) != src.batch(0, 10)
    # a batch spanning an epoch boundary; unshuffled order is file order
    plain = JsonlPrompts(path, seed=0, shuffle=False)
    assert [e.label for e in plain.batch(1, 7)] == ["7", "8", "9", "0", "1", "2", "3"]
    assert src.epoch(5, 2) == 1.0
    src.load_state_dict(JsonlPrompts(path, seed=1).state_dict())
    with pytest.raises(ValueError, match="seed"):
        src.load_state_dict(JsonlPrompts(path, seed=2).state_dict())
    assert JsonlPrompts([Example("a", "b", "t")], seed=0).batch(3, 2) == [Example("a", "b", "t")] * 2


def test_jsonl_reserve_draws_rows_without_moving_the_epochs(tmp_path):
    rows = [json.dumps({"prompt": f"{i}+0=", "label": str(i)}) for i in range(10)]
    src = JsonlPrompts(_write(tmp_path, rows), seed=1)
    before = [src.batch(step, 3) for step in range(6)]
    r = src.reserve(2, 0, 8)
    assert [src.batch(step, 3) for step in range(6)] == before  # no batch changes
    assert src.reserve(2, 3, 5) == r[3:] and JsonlPrompts(_write(tmp_path, rows), seed=1).reserve(2, 0, 8) == r
    assert src.reserve(3, 0, 8) != r and all(e in src.examples for e in r)


def test_a_checkpoints_source_must_have_the_same_rows(tmp_path):
    """Same rows in another file (moved, reformatted) pass; one edited row fails even at the same
    row count, since step k would map to other prompts."""
    rows = [{"prompt": f"{i}+{i}=", "label": str(2 * i)} for i in range(6)]
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in rows))
    b.write_text("".join(json.dumps(r, indent=None, separators=(", ", ":  ")) + "\n\n" for r in rows))
    rows[3]["label"] = "7"
    c.write_text("".join(json.dumps(r) + "\n" for r in rows))
    saved = JsonlPrompts(a, seed=1).state_dict()
    JsonlPrompts(b, seed=1).load_state_dict(saved)
    with pytest.raises(ValueError, match="sha256"):
        JsonlPrompts(c, seed=1).load_state_dict(saved)
    old = {k: v for k, v in saved.items() if k != "sha256"}  # a checkpoint from before the hash
    JsonlPrompts(c, seed=1).load_state_dict(old)


def test_overlong_prompts_error_or_skip(tmp_path):
    """A prompt that does not fit the model is refused at load (first line named, all counted),
    or dropped and counted with overlong="skip"."""
    rows = [json.dumps({"prompt": "x" * n, "label": "1"}) for n in (3, 30, 4, 300)]
    path = _write(tmp_path, rows)

    def fits(e):
        return None if len(e.prompt) <= 10 else f"{len(e.prompt)} prompt tokens > 10"

    with pytest.raises(DataError, match=re.escape(f"{path}:2: the prompt is too long (30 prompt tokens > 10); "
                                                  f"2 row(s)")) as err:
        load_jsonl(path, fits=fits)
    assert "data.overlong_prompts=skip" in str(err.value)
    examples, skipped = load_jsonl(path, fits=fits, overlong="skip")
    assert [len(e.prompt) for e in examples] == [3, 4] and skipped == 2
    src = JsonlPrompts(path, seed=0, fits=fits, overlong="skip")
    assert len(src) == 2 and src.skipped_overlong == 2
    with pytest.raises(DataError, match="no rows that fit"):
        load_jsonl(path, fits=lambda e: "too long", overlong="skip")


def test_a_row_may_name_its_environment_and_its_settings(tmp_path):
    rows = [GOOD, json.dumps({"prompt": "guess 0-99 n0042:", "label": "57", "env": "guess"}),
            json.dumps({"prompt": "1*2=", "label": "2", "env": "calculator", "env_settings": {"call_open": "c:"}})]
    examples, _ = load_jsonl(_write(tmp_path, rows))
    assert [(e.env, e.env_settings) for e in examples] == [(None, None), ("guess", None),
                                                         ("calculator", {"call_open": "c:"})]
    # rows without an environment hash as before (a checkpoint's source check still passes)
    plain = JsonlPrompts([Example("1+2=", "3", "jsonl")], seed=0).state_dict()["sha256"]
    import hashlib
    assert plain == hashlib.sha256(json.dumps([["1+2=", "3", "jsonl"]]).encode()).hexdigest()
    other = JsonlPrompts([Example("1+2=", "3", "jsonl", env="guess")], seed=0).state_dict()["sha256"]
    assert other != plain


@pytest.mark.parametrize("extra,message", [
    ({"env": "nope"}, "field \"env\" names an unknown environment 'nope'; available: calculator, guess"),
    ({"env": ""}, 'field "env" must name an environment, got ""'),
    ({"env": 3}, 'field "env" must name an environment, got 3'),
    ({"env_settings": {"call_open": "c:"}}, 'field "env_settings" without "env"'),
    ({"env": "guess", "env_settings": [1]}, "field \"env_settings\" must be an object of 'guess''s settings, got array"),
    ({"env": "guess", "env_settings": {"bogus": 1}}, "field \"env_settings\" does not fit environment 'guess'"),
    ({"env": "calculator", "env_settings": {"call_open": ""}}, "call_open must not be empty"),
    ({"env": "calculator", "env_settings": {"call_open": 5}}, "calculator's setting call_open=5: a string"),
    ({"env": "guess", "env_settings": {"higher": True}}, "guess's setting higher=True: a string"),
], ids=["unknown", "empty", "number", "settings_alone", "settings_array", "unknown_setting", "bad_setting",
        "setting_type", "bool_for_string"])
def test_a_rows_environment_is_checked_at_load_naming_the_row(tmp_path, extra, message):
    msg = _error(tmp_path, json.dumps({**json.loads(GOOD), **extra}), line=5)
    assert message in msg, msg
