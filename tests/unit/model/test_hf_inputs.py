"""A Hugging Face folder is untrusted input (model/hf_files.py): config.json's values, the safetensors
headers and the index are checked before anything is built from them, each failure naming the file
and the value, never a math domain error, ZeroDivisionError, MemoryError or KeyError later."""
import json
import os
import shutil
import struct

import pytest
import torch

from megatron_rl.model.arch import ARCHS
from megatron_rl.model.hf_files import HfInputError, SafetensorsReader, check_weights, load_arch
from megatron_rl.model.presets import preset_arch


def _save(arch, path):
    from megatron_rl.model.parity import random_hf_model

    random_hf_model(arch, seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return _save(preset_arch("qwen3", "tiny"), tmp_path_factory.mktemp("hf") / "qwen3")


@pytest.fixture
def hf(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "hf")


def check(path):
    """What pretrain_rl.py (trainer/policy.py: arch_from_config) and the converter run at start-up."""
    arch = load_arch(str(path))
    check_weights(SafetensorsReader(str(path)), arch)
    return arch


def set_config(path, **values):
    config = json.loads((path / "config.json").read_text())
    for key, value in values.items():
        if value is DELETE:
            del config[key]
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


DELETE = object()


@pytest.mark.parametrize("name", ARCHS)
def test_every_family_passes_its_own_checks(tmp_path, name):
    arch = preset_arch(name, "tiny")
    assert check(_save(arch, tmp_path / name)) == arch


@pytest.mark.parametrize("values,msg", [
    ({"num_hidden_layers": -3}, r"num_hidden_layers=-3: must be an integer >= 1"),
    ({"num_attention_heads": 0}, r"num_attention_heads=0: must be an integer >= 1"),
    ({"num_hidden_layers": "2"}, r"num_hidden_layers='2': must be an integer >= 1"),
    ({"num_hidden_layers": [2]}, r"num_hidden_layers=\[2\]: must be an integer >= 1"),
    ({"num_hidden_layers": 2.0}, r"num_hidden_layers=2.0: must be an integer >= 1"),
    ({"num_hidden_layers": True}, r"num_hidden_layers=True: must be an integer >= 1"),
    ({"hidden_size": DELETE}, r"hidden_size is missing"),
    ({"vocab_size": None}, r"vocab_size is null"),
    ({"num_key_value_heads": 0}, r"num_key_value_heads=0: must be an integer >= 1"),
    ({"head_dim": None, "num_attention_heads": 128}, r"head_dim is missing, and hidden_size=64 / num_attention_heads=128"),
    ({"rms_norm_eps": -1}, r"rms_norm_eps=-1: must be a finite number > 0"),
    ({"rms_norm_eps": "tiny"}, r"rms_norm_eps='tiny': must be a finite number > 0"),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings='false': must be true or false"),
    ({"model_type": ["qwen3"]}, r"model_type=\['qwen3'\] is not supported"),
    ({"rope_parameters": "x"}, r"rope_parameters / rope_scaling='x': must be a mapping"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -5}}, r"rope_theta=-5: must be a finite number > 0"),
])
def test_impossible_config_values_are_named(hf, values, msg):
    set_config(hf, **values)
    with pytest.raises(HfInputError, match=rf"^{hf / 'config.json'}: {msg}"):
        check(hf)


@pytest.mark.parametrize("values,msg", [
    ({"num_hidden_layers": 10**6}, (r"config.json \(num_hidden_layers=1000000\) needs tensor model.layers.2.\S+, "
                                   r"which no safetensors file of the folder holds")),
    ({"vocab_size": 10**12}, (r"model.embed_tokens.weight is \[64, 64\], and config.json says vocab_size x "
                             r"hidden_size = \[1000000000000, 64\]")),
    ({"intermediate_size": 10**9}, r"the tensors the model reads hold 82,304 numbers, and config.json's sizes"),
    ({"head_dim": 8}, r"the tensors the model reads hold 82,304 numbers, and .* make 69,984"),
])
def test_a_config_that_is_not_the_weights_model_is_named_before_a_build(hf, values, msg):
    """10**6 layers built for minutes, 10**12 vocabulary rows were a MemoryError: both now stop at the
    checkpoint's headers."""
    set_config(hf, **values)
    with pytest.raises(HfInputError, match=rf"^{hf}: {msg}.*does config.json belong to these weights\?"):
        check(hf)


@pytest.mark.parametrize("content,msg", [
    ('{"model_type": "qwen3", "hidden_si', r"is not valid JSON \(.*\); is the file complete\?"),
    ("[" * 100_000 + "]" * 100_000, r"JSON nested too deeply to read"),
    ("[1, 2]", r"expected a JSON object, got list"),
    (b"\xff\xfe{}", r"is not valid JSON"),
])
def test_an_unreadable_config_json_is_named(hf, content, msg):
    target = hf / "config.json"
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(HfInputError, match=rf"^{target}:? {msg}"):
        load_arch(str(hf))


def test_a_config_json_that_is_a_fifo_does_not_block(hf):
    os.remove(hf / "config.json")
    os.mkfifo(hf / "config.json")
    with pytest.raises(HfInputError, match=r"config.json is not a regular file"):
        load_arch(str(hf))


# ---- safetensors headers
def _header(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path, header, data, length=None):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def _edit(name, change):
    def edit(header):
        header[name] = change(dict(header[name]))
    return edit


EMB = "model.embed_tokens.weight"


@pytest.mark.parametrize("edit,msg", [
    (_edit(EMB, lambda e: {**e, "dtype": "X9"}), r"tensor 'model.embed_tokens.weight': dtype 'X9' is not one of"),
    (_edit(EMB, lambda e: {**e, "shape": [-1, 64]}), r"shape \[-1, 64\] is not a list of sizes >= 0"),
    (_edit(EMB, lambda e: {**e, "shape": "64"}), r"shape '64' is not a list of sizes >= 0"),
    (_edit(EMB, lambda e: {**e, "data_offsets": [0, 2**62]}), r"data_offsets \[0, \d+\] do not lie in the file's"),
    (_edit(EMB, lambda e: {**e, "data_offsets": [-8, 0]}), r"data_offsets \[-8, 0\] do not lie"),
    (_edit(EMB, lambda e: {**e, "data_offsets": "0"}), r"data_offsets '0' do not lie"),
    (_edit(EMB, lambda e: {**e, "shape": [64, 65]}), (r"shape \[64, 65\] of F32 is 16,640 bytes, its data_offsets hold "
                                                     r"16,384")),
    (_edit(EMB, lambda e: 7), r"its header entry is not an object"),
])
def test_damaged_safetensors_headers_are_named(hf, edit, msg):
    header, data = _header(hf / "model.safetensors")
    edit(header)
    _write(hf / "model.safetensors", header, data)
    with pytest.raises(HfInputError, match=rf"^{hf / 'model.safetensors'}: (tensor '{EMB}': )?{msg}"):
        SafetensorsReader(str(hf))


@pytest.mark.parametrize("length,msg", [(2**60, r"its header length says [\d,]+ bytes, more than the file holds"),
                                        (None, r"too short for a safetensors file")])
def test_a_header_length_past_the_file_is_named(hf, length, msg):
    target = hf / "model.safetensors"
    if length is None:
        target.write_bytes(b"\x01\x02\x03")
    else:
        header, data = _header(target)
        _write(target, header, data, length=length)
    with pytest.raises(HfInputError, match=rf"^{target} \([\d,]+ bytes\): {msg}; the file is damaged"):
        SafetensorsReader(str(hf))


def test_a_header_that_is_not_json_is_named(hf):
    target = hf / "model.safetensors"
    target.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(HfInputError, match=rf"^{target}: the header is not valid JSON"):
        SafetensorsReader(str(hf))


def test_integer_weights_are_refused(hf):
    header, data = _header(hf / "model.safetensors")
    header[EMB]["dtype"] = "I32"   # same size, not a weight
    _write(hf / "model.safetensors", header, data)
    with pytest.raises(HfInputError, match=rf"tensor {EMB} is I32; model weights are floating point"):
        check(hf)


# ---- the index names files of its folder only
def _index(path, files):
    reader = SafetensorsReader(str(path))
    names = reader.keys()
    weight_map = {n: files[i % len(files)] for i, n in enumerate(names)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("name", ["/etc/passwd", "../model.safetensors", "sub/../../x.safetensors", "", "."])
def test_an_index_naming_a_file_outside_its_folder_is_refused(hf, tmp_path, name):
    shutil.copy(hf / "model.safetensors", tmp_path / "model.safetensors")  # what ../ would reach
    _index(hf, ["model.safetensors", name])
    with pytest.raises(HfInputError, match=rf"weight_map names {name!r}, which is not in {hf}; an index may only"):
        SafetensorsReader(str(hf))


@pytest.mark.parametrize("weight_map", [[1, 2], {"a": 3}, None])
def test_a_malformed_index_is_named(hf, weight_map):
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(HfInputError, match=r"index.json: weight_map must map tensor names to file names"):
        SafetensorsReader(str(hf))


def test_shards_linked_into_a_cache_still_load(hf, tmp_path):
    """A Hugging Face cache snapshot links each file into its blobs folder: links are fine, only the
    names the index gives must stay in the folder."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.move(hf / "model.safetensors", blobs / "abc123")
    os.symlink(blobs / "abc123", hf / "model-00001-of-00001.safetensors")
    _index_from_blob = {n: "model-00001-of-00001.safetensors" for n in _header(blobs / "abc123")[0]
                        if n != "__metadata__"}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": _index_from_blob}))
    reader = SafetensorsReader(str(hf))
    check_weights(reader, load_arch(str(hf)))
    assert reader(EMB).shape == (64, 64) and reader(EMB).dtype == torch.float32


# ---- an architecture from anywhere (a checkpoint's record, overrides) is checked the same way
@pytest.mark.parametrize("field,value,msg", [
    ("num_layers", -3, r"model.num_layers=-3: must be an integer >= 1"),
    ("num_attention_heads", 0, r"model.num_attention_heads=0: must be an integer >= 1"),
    ("hidden_size", "64", r"model.hidden_size='64': must be an integer >= 1"),
    ("num_experts", -1, r"model.num_experts=-1: must be an integer >= 0"),
    ("rope_theta", float("nan"), r"model.rope_theta=nan: must be a finite number > 0"),
    ("rope_llama3_factor", -1.0, r"model.rope_llama3_factor=-1.0: must be a finite number >= 0"),
    ("tie_word_embeddings", 1, r"model.tie_word_embeddings=1: must be true or false"),
    ("mlp_only_layers", [-1], r"model.mlp_only_layers=\[-1\]: must be a list of layer indices"),
])
def test_an_arch_from_anywhere_is_checked(field, value, msg):
    from megatron_rl.model.arch import ModelArch

    with pytest.raises(ValueError, match=msg):
        ModelArch(**{field: value})


def test_the_converter_refuses_an_impossible_recorded_arch():
    from tools.convert_hf_to_mcore import Refused, reverse_arch

    with pytest.raises(Refused, match=r"the architecture the checkpoint records is not a valid one \(model.num_layers"):
        reverse_arch({"arch": {**preset_arch("qwen3", "tiny").to_dict(), "num_layers": -3}}, None)
    with pytest.raises(Refused, match=r"the architecture the checkpoint records is not a valid one .*unexpected"):
        reverse_arch({"arch": {"bogus": 1}}, None)
