"""Prompts from Parquet files and folders saved by HF `datasets` (data/tables.py) are the prompts of
the equivalent JSONL, with the same per-row checks, each error naming the row. The datasets folder
is written as `Dataset.save_to_disk` writes it (Arrow IPC streams listed in state.json), with
pyarrow alone."""
import json
import sys

import pytest

from megatron_rl.configure import load_config
from megatron_rl.data import CharTokenizer, DataError, Example, JsonlPrompts, load_jsonl, load_prompts
from megatron_rl.trainer.startup import make_prompts

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # the data extra is optional; dev (CI) installs it
    pa = pq = None
needs_pyarrow = pytest.mark.skipif(pa is None, reason="reading tables needs pyarrow (the data extra; dev installs it)")

ROWS = [
    {"prompt": "1+2=", "label": "3"},
    {"prompt": "s:2,1=", "label": "12", "task": "sorting", "source": "kept out"},
    {"prompt": "guess 0-99 n0042:", "label": "57", "task": "guessing", "env": "guess"},
    {"prompt": "123*45=", "label": "5535", "env": "calculator", "env_settings": {"call_open": "c:"}},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def table(rows) -> "pa.Table":
    """The rows as one table: every column in every row, null where a row has no value."""
    names = list(dict.fromkeys(k for r in rows for k in r))
    return pa.Table.from_pylist([{k: r.get(k) for k in names} for r in rows])


def write_parquet(path, rows, row_group_size=None):
    pq.write_table(table(rows), path, row_group_size=row_group_size)
    return path


def write_dataset(folder, rows, shards=2):
    """What `Dataset.from_list(rows).save_to_disk(folder, num_shards=shards)` writes."""
    folder.mkdir()
    whole, files = table(rows), []
    per = -(-len(rows) // shards)
    for i in range(shards):
        name = f"data-{i:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, whole.schema) as writer:
            writer.write_table(whole.slice(i * per, per))
        files.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": files, "_fingerprint": "f", "_format_type": None}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return folder


@needs_pyarrow
@pytest.mark.parametrize("write", [
    lambda tmp, rows: write_parquet(tmp / "p.parquet", rows),
    lambda tmp, rows: write_parquet(tmp / "p.parquet", rows, row_group_size=1),   # several record batches
    lambda tmp, rows: write_dataset(tmp / "saved", rows),
    lambda tmp, rows: write_dataset(tmp / "saved", rows, shards=1),
], ids=["parquet", "parquet-row-groups", "datasets-folder", "datasets-one-shard"])
def test_a_table_gives_the_prompts_of_the_equivalent_jsonl(tmp_path, write):
    jsonl = load_jsonl(write_jsonl(tmp_path / "p.jsonl", ROWS), tokenizer=CharTokenizer())
    path = write(tmp_path, ROWS)
    assert load_prompts(path, tokenizer=CharTokenizer()) == jsonl
    assert jsonl[0][3] == Example("123*45=", "5535", "jsonl", env="calculator", env_settings={"call_open": "c:"})
    a, b = JsonlPrompts(tmp_path / "p.jsonl", seed=3), JsonlPrompts(path, seed=3)
    assert a.batch(5, 3) == b.batch(5, 3)
    assert {**a.state_dict(), "path": None} == {**b.state_dict(), "path": None}   # a resume takes either


def _error(tmp_path, rows, kind):
    path = write_parquet(tmp_path / "bad.parquet", rows) if kind == "parquet" else write_dataset(tmp_path / "bad", rows)
    with pytest.raises(DataError) as e:
        load_prompts(path, tokenizer=CharTokenizer())
    return str(e.value), str(path)


@needs_pyarrow
@pytest.mark.parametrize("kind", ["parquet", "datasets"])
@pytest.mark.parametrize("bad,message", [
    ({"prompt": "  ", "label": "1"}, 'row 2: field "prompt" is empty'),
    ({"prompt": "1+1=", "label": None}, 'row 2: field "label" must be a string, got null'),
    ({"prompt": "1+1=", "label": "2", "task": ""}, 'row 2: field "task" is empty'),
    ({"prompt": "1+1=", "label": "2", "env": "nowhere"}, 'row 2: field "env" names an unknown environment'),
    ({"prompt": "1+1=", "label": "2", "env": "guess", "env_settings": {"colour": "red"}},
     "row 2: field \"env_settings\" does not fit environment 'guess'"),
    ({"prompt": "ÄÖ=", "label": "2"}, 'row 2: field "prompt" cannot be tokenized'),
])
def test_a_bad_row_is_named(tmp_path, kind, bad, message):
    """Row 2 (from 0, as dataset[2]) of a table, across the datasets folder's two shards."""
    rows = [{"prompt": "1+2=", "label": "3"}, {"prompt": "2+2=", "label": "4"}, bad, {"prompt": "3+3=", "label": "6"}]
    text, path = _error(tmp_path, rows, kind)
    assert text.startswith(f"{path} {message}"), text


@needs_pyarrow
def test_a_column_of_numbers_is_named_like_a_json_number(tmp_path):
    text, path = _error(tmp_path, [{"prompt": "1+2=", "label": 3}], "parquet")
    assert text.startswith(f'{path} row 0: field "label" must be a string, got int (3); quote it'), text


@needs_pyarrow
@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_a_missing_column_names_the_columns(tmp_path, kind):
    text, path = _error(tmp_path, [{"question": "1+2=", "label": "3"}], kind)
    assert text.startswith(f'{path}: no column "prompt" (columns: question, label)'), text
    assert "rename_column" in text


@needs_pyarrow
def test_an_empty_table_has_no_rows(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "label": pa.array([], pa.string())}), path)
    with pytest.raises(DataError, match=rf"{path}: no rows; each row needs \"prompt\" and \"label\" strings"):
        load_prompts(path)


@needs_pyarrow
def test_too_long_rows_are_named_and_skipped_as_in_jsonl(tmp_path):
    rows = [{"prompt": "1+2=", "label": "3"}, {"prompt": "12345+1=", "label": "12346"}]
    path = write_parquet(tmp_path / "p.parquet", rows)
    fits = lambda e: None if len(e.prompt) < 6 else "too long"
    with pytest.raises(DataError, match=rf"{path} row 1: the prompt is too long \(too long\); 1 row\(s\)"):
        load_prompts(path, fits=fits)
    assert load_prompts(path, fits=fits, overlong="skip") == ([Example("1+2=", "3", "jsonl")], 1)


@needs_pyarrow
def test_folders_that_are_not_a_saved_dataset_are_refused(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(DataError, match="not one saved by datasets' save_to_disk"):
        load_prompts(plain)
    splits = tmp_path / "dict"
    splits.mkdir()
    write_dataset(splits / "train", ROWS[:1])
    (splits / "test").mkdir()
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["test", "train"]}))
    with pytest.raises(DataError, match=rf"a DatasetDict \(splits test, train\); name one split's folder, e.g. "
                                        rf"{splits}/test"):
        load_prompts(splits)
    broken = write_dataset(tmp_path / "broken", ROWS)
    (broken / "state.json").write_text('{"_data_files": [{"filename": "../elsewhere.arrow"}]}')
    with pytest.raises(DataError, match="is not a file name inside the folder"):
        load_prompts(broken)
    (broken / "state.json").write_text("{")
    with pytest.raises(DataError, match="not a datasets state.json"):
        load_prompts(broken)


@needs_pyarrow
def test_a_file_that_is_not_a_table_is_named(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_text('{"prompt": "1+2=", "label": "3"}\n')
    with pytest.raises(DataError, match=rf"{path}: not a table pyarrow can read"):
        load_prompts(path)
    assert load_prompts(write_jsonl(tmp_path / "rows.txt", ROWS[:1]))[0] == [Example("1+2=", "3", "jsonl")]


@needs_pyarrow
def test_a_datasets_folder_passes_the_path_check_and_trains_as_prompts(tmp_path):
    folder = write_dataset(tmp_path / "saved", ROWS)
    cfg = load_config(None, [f"data.jsonl={folder}", "rollout.function=multi_turn", "env.name=calculator"])
    cfg.check_paths()
    assert make_prompts(cfg, CharTokenizer(), 512).examples == load_jsonl(write_jsonl(tmp_path / "p.jsonl", ROWS))[0]
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"is a directory that datasets' save_to_disk did not write"):
        load_config(None, [f"data.jsonl={tmp_path / 'plain'}"]).check_paths()


def test_without_pyarrow_a_table_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(DataError, match=rf"{path}: reading Parquet and Arrow tables needs pyarrow, which is not "
                                        r"installed; pip install 'megatron-rl\[data\]'"):
        load_prompts(path)
