"""tools/convert_hf_to_mcore.py: HF -> mcore (EP=2) -> HF (one rank) is bit-for-bit, a checkpoint
streamed at one rank loads at TP=2 and at EP=2, the trainer's own checkpoints export, and --reverse
never destroys a folder it was not asked to replace."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.mcore_setup import hf_tensors, random_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")


def _main_in_rank(rank, world, argv):
    """The tool's main(argv) in a pooled gloo rank: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from tools.convert_hf_to_mcore import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _tool(*args, nproc=1) -> subprocess.CompletedProcess:
    """The tool on `nproc` ranks: several as the script under torchrun (the launch users run); one
    as its main() in a pooled rank of tests/spawn.py (the same code after the script's first line,
    which hides GPUs this machine has none of; an interpreter's start-up saved per call)."""
    if nproc == 1:
        from tests.spawn import run_ranks

        [(code, out, err)] = run_ranks(_main_in_rank, world_size=1, timeout=300, argv=args)
        return subprocess.CompletedProcess(args, code, out, err)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run(launcher + ["tools/convert_hf_to_mcore.py", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300, check=False)


def _run(*args, nproc=1):
    run = _tool(*args, nproc=nproc)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run.stdout


def _refused(run: subprocess.CompletedProcess, *words) -> None:
    """Exit code 2 and one line on stderr that names each of `words`."""
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-3000:]
    [line] = run.stderr.strip().splitlines()
    assert all(w in line for w in words), line


def _same(a: str, b: str) -> bool:
    x, y = hf_tensors(a), hf_tensors(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _contents(path) -> dict[str, bytes]:
    """relative path -> bytes of every file under `path`."""
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), path)] = f.read()
    return out


def test_roundtrip_through_an_ep2_checkpoint(tmp_path):
    from megatron_rl.model.presets import preset_arch

    src = random_hf_dir(preset_arch("qwen3_moe", mlp_only_layers=(0,)), root=str(tmp_path))
    _run("--hf-dir", src, "--mcore-dir", str(tmp_path / "mcore"), "--expert-model-parallel-size", "2", nproc=2)
    _run("--reverse", "--mcore-dir", str(tmp_path / "mcore" / "iter_0000000"), "--hf-dir", str(tmp_path / "back"))
    assert _same(src, str(tmp_path / "back"))


def _load_at(rank, world, path, arch_dict, sizes):
    from megatron_rl.model import BuildOptions, ModelArch, build_gpt_model
    from megatron_rl.model.hf_io import export_hf_weights
    from megatron_rl.trainer.checkpoint import load_checkpoint
    from tests.mcore_setup import setup_parallel

    groups = setup_parallel(**sizes)
    arch = ModelArch(**arch_dict)
    model = build_gpt_model(arch, groups, BuildOptions(seed=9))
    load_checkpoint(path, model)
    return dict(export_hf_weights(model, arch, groups))


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """family -> (arch, HF source, its checkpoint converted at one rank), made on first use: the
    layouts that load one family's checkpoint share its conversion."""
    from megatron_rl.model.presets import preset_arch

    made = {}

    def get(family):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            arch = preset_arch(family)
            src = random_hf_dir(arch, root=str(root))
            _run("--hf-dir", src, "--mcore-dir", str(root / "mcore"))
            made[family] = arch, src, str(root / "mcore" / "iter_0000000")
        return made[family]

    return get


@pytest.mark.parametrize("family,sizes", [("mixtral", {"tensor_model_parallel_size": 2}),
                                          ("mixtral", {"expert_model_parallel_size": 2}),
                                          pytest.param("deepseek_v3", {"tensor_model_parallel_size": 2},
                                                       marks=pytest.mark.mcore_api)],  # our MaterializingSave under 0.19's save()
                         ids=["tp2", "ep2", "deepseek_v3_tp2"])
def test_streamed_checkpoint_loads_at_another_layout(streamed, family, sizes):
    """DeepSeek-V3 adds MLA's duplicated down projections and the router's bias, a buffer that the
    meta-device model materialises like a parameter."""
    from tests.spawn import run_ranks

    arch, src, ckpt = streamed(family)
    loaded = run_ranks(_load_at, world_size=2, timeout=180, path=ckpt, arch_dict=arch.to_dict(), sizes=sizes)[0]
    ref = hf_tensors(src)
    assert loaded.keys() == ref.keys()
    assert all(torch.equal(loaded[k], ref[k]) for k in ref)
    assert all(ref[k].abs().sum() > 0 for k in ref if k.endswith("e_score_correction_bias"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(HF source, its converted checkpoint) of a tiny dense model, shared: tests copy what they change."""
    from megatron_rl.model.presets import preset_arch

    root = tmp_path_factory.mktemp("converted")
    src = random_hf_dir(preset_arch("qwen3", "tiny"), root=str(root))
    _run("--hf-dir", src, "--mcore-dir", str(root / "mcore"))
    return src, str(root / "mcore" / "iter_0000000")


def _occupied_folders(tmp_path):
    """An export target holding someone's files, and a sibling named like the old code's scratch folder."""
    out, old = tmp_path / "model", tmp_path / "model.old"
    for d, name in ((out, "notes.txt"), (old, "keep.txt"), (out / "sub", "tokenizer.json")):
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(f"{name} in {d.name}")
    return out, old


def test_reverse_refuses_a_folder_that_is_not_empty(converted, tmp_path):
    """Before: --reverse replaced --hf-dir (the HF model, `.`, `~`) and deleted `<hf-dir>.old`."""
    _, ckpt = converted
    out, _ = _occupied_folders(tmp_path)
    before = _contents(tmp_path)
    _refused(_tool("--reverse", "--mcore-dir", ckpt, "--hf-dir", str(out)), "--hf-dir", "--overwrite")
    assert _contents(tmp_path) == before
    assert sorted(os.listdir(tmp_path)) == ["model", "model.old"]  # no temporary folder left either


def test_reverse_overwrite_replaces_only_the_folder(converted, tmp_path):
    src, ckpt = converted
    out, old = _occupied_folders(tmp_path)
    kept = _contents(old)
    _run("--reverse", "--mcore-dir", ckpt, "--hf-dir", str(out), "--overwrite")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert _same(src, str(out))
    assert _contents(old) == kept
    assert sorted(os.listdir(tmp_path)) == ["model", "model.old"]  # the replaced folder is gone, nothing else


def test_reverse_into_an_empty_folder_needs_no_overwrite(converted, tmp_path):
    src, ckpt = converted
    (tmp_path / "empty").mkdir()
    _run("--reverse", "--mcore-dir", ckpt, "--hf-dir", str(tmp_path / "empty"))
    assert _same(src, str(tmp_path / "empty"))


def _without_arch(ckpt: str, dest) -> str:
    """A copy of checkpoint `ckpt` whose host state does not record the architecture (as older
    checkpoints), its manifest rebuilt so that it still verifies."""
    from megatron_rl.trainer.manifest import MANIFEST, build_manifest

    shutil.copytree(ckpt, dest)
    extra = os.path.join(dest, "extra", "rank_00000.json")
    with open(extra) as f:
        state = json.load(f)
    del state["arch"]
    with open(extra, "w") as f:
        json.dump(state, f)
    with open(os.path.join(dest, MANIFEST)) as f:
        meta = {k: v for k, v in json.load(f).items() if k not in ("format", "files")}
    os.remove(os.path.join(dest, MANIFEST))
    build_manifest(str(dest), meta)
    return str(dest)


def _with_tokenizer(src: str, dest) -> str:
    """A copy of HF model `src` with a working tokenizer, a generation config and a file that is
    no part of a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    shutil.copytree(src, dest)
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "1": 1, "+": 2, "=": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="=").save_pretrained(dest)
    GenerationConfig(eos_token_id=3, max_new_tokens=4).save_pretrained(dest)
    (dest / "README.md").write_text("notes")
    return str(dest)


def test_reverse_arch_from_gives_the_architecture_and_the_tokenizer(converted, tmp_path):
    """Before: without a recorded arch, config.json came from --hf-dir, the output folder."""
    from transformers import AutoTokenizer

    src, ckpt = converted
    ckpt = _without_arch(ckpt, tmp_path / "ckpt")
    model = _with_tokenizer(src, tmp_path / "hf")
    out = str(tmp_path / "out")
    _run("--reverse", "--mcore-dir", ckpt, "--hf-dir", out, "--arch-from", model)
    copied = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors", *copied])
    assert all(_contents(out)[n] == _contents(model)[n] for n in copied)
    assert _same(src, out)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3ForCausalLM"]
    assert AutoTokenizer.from_pretrained(out)("1 + 1 =")["input_ids"] == [1, 2, 1, 3]


def test_conversion_records_the_models_tokenizer(converted, tmp_path):
    """The converted weights remember the tokenizer they read (a warm start under another one is
    refused, tests/e2e/test_drills.py); a folder without a usable tokenizer records none."""
    from megatron_rl.data.hf_tokenizer import folder_fingerprint
    from megatron_rl.trainer.checkpoint import read_extra

    src, ckpt = converted
    assert read_extra(ckpt, 0)["tokenizer"] is None
    model = _with_tokenizer(src, tmp_path / "hf")
    _run("--hf-dir", model, "--mcore-dir", str(tmp_path / "mcore"))
    recorded = read_extra(str(tmp_path / "mcore" / "iter_0000000"), 0)["tokenizer"]
    assert recorded == folder_fingerprint(model)[0] and recorded.startswith("hf:")


def test_reverse_without_an_architecture_names_arch_from(converted, tmp_path):
    _, ckpt = converted
    ckpt = _without_arch(ckpt, tmp_path / "ckpt")
    _refused(_tool("--reverse", "--mcore-dir", ckpt, "--hf-dir", str(tmp_path / "out")), "--arch-from")
    assert not (tmp_path / "out").exists()


def test_trainer_checkpoint_exports_the_trained_weights(tmp_path):
    """An RL checkpoint of pretrain_rl.py (wrapped model, optimizer state, arch in its host state)
    exports to HF. The weights are known without the exporter: lr=1e-30 (config validation refuses
    0) moves no fp32 weight (an Adam step is at most about lr per element, far below the spacing
    of fp32 numbers near the init's values), so they are the HF source's, bit for bit."""
    from megatron_rl.model.presets import preset_arch
    from tests.e2e.test_drills import BASE

    src = random_hf_dir(preset_arch("qwen3_moe", "tiny"), root=str(tmp_path))
    run_dir = tmp_path / "run"
    train = subprocess.run([sys.executable, "pretrain_rl.py", *BASE, f"model.hf_dir={src}", "optim.lr=1e-30",
                            "train.steps=1", f"train.run_dir={run_dir}", "model.overrides={num_layers: 1}"],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600, check=False)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    [line] = [x for x in train.stderr.splitlines() if x.startswith("model.overrides [")]
    assert "'num_layers'" in line and line.endswith("ignored: model.hf_dir's config.json sets the architecture")
    _run("--reverse", "--mcore-dir", str(run_dir / "checkpoints" / "iter_0000001"), "--hf-dir", str(tmp_path / "out"))
    assert _same(src, str(tmp_path / "out"))


def test_save_hf_checkpoint_replaces_a_folder_only_when_asked(tmp_path):
    """The library function under the tool: a non-empty folder is refused before the tensors are
    read, and by the final rename when it fills while they are; overwrite=True replaces it alone."""
    from megatron_rl.model.hf_io import save_hf_checkpoint
    from megatron_rl.model.presets import preset_arch

    arch = preset_arch("qwen3", "tiny")
    out, old = _occupied_folders(tmp_path)
    before = _contents(tmp_path)
    unread = iter([("w", torch.ones(2))])
    with pytest.raises(FileExistsError, match="model"):
        save_hf_checkpoint(str(out), arch, unread)
    assert next(unread)[0] == "w" and _contents(tmp_path) == before

    def filled_meanwhile():
        yield "w", torch.ones(2)
        (tmp_path / "late").mkdir()
        (tmp_path / "late" / "notes.txt").write_text("someone's")

    with pytest.raises(FileExistsError, match="late"):
        save_hf_checkpoint(str(tmp_path / "late"), arch, filled_meanwhile())
    assert _contents(tmp_path / "late") == {"notes.txt": b"someone's"}

    save_hf_checkpoint(str(out), arch, iter([("w", torch.ones(2))]), overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert torch.equal(hf_tensors(str(out))["w"], torch.ones(2))
    assert _contents(old) == {"keep.txt": b"keep.txt in model.old"}
    assert sorted(os.listdir(tmp_path)) == ["late", "model", "model.old"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_folder_has_the_umask_permissions(tmp_path, umask):
    """The published folder is made by renaming a private temp folder: it must end up with the
    permissions a plain mkdir would give (the group may read a model exported for it), not 0700."""
    from megatron_rl.model.hf_io import save_hf_checkpoint
    from megatron_rl.model.presets import preset_arch

    old = os.umask(umask)
    try:
        save_hf_checkpoint(str(tmp_path / "out"), preset_arch("qwen3", "tiny"), iter([("w", torch.ones(2))]))
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask


@pytest.mark.parametrize("overwrite", [False, True])
def test_exported_folder_is_on_disk_before_it_takes_the_name(tmp_path, monkeypatch, overwrite):
    """Every file and folder of an export is synced before the rename that publishes it (and, with
    overwrite, deletes the old one), and the parent after it: after a power loss a never-synced
    file can come back empty."""
    from megatron_rl.model.hf_io import save_hf_checkpoint
    from megatron_rl.model.presets import preset_arch

    out = tmp_path / "model"
    if overwrite:
        out.mkdir()
        (out / "old.txt").write_text("old")
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), real_replace(a, b))[1])
    save_hf_checkpoint(str(out), preset_arch("qwen3", "tiny"), iter([("w", torch.ones(2))]), overwrite=overwrite)
    published = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(out)][-1]  # the one that took
    tmp = events[published][1]
    synced = {e[1].replace(tmp, str(out)) for e in events[:published] if e[0] == "fsync"}
    assert {str(out)} | {str(out / n) for n in os.listdir(out)} <= synced
    assert ("fsync", str(tmp_path)) in events[published:]


def test_a_failed_sync_after_the_publish_is_reported_as_itself(tmp_path, monkeypatch):
    """The parent folder's fsync comes after the rename that publishes the export: its error must
    not be taken for an occupied target (which named the wrong problem and, with overwrite, left
    the old export stranded)."""
    import errno

    from megatron_rl.model import hf_io
    from megatron_rl.model.presets import preset_arch

    def cannot(path):
        raise OSError(errno.EINVAL, "cannot sync a folder here")

    monkeypatch.setattr(hf_io, "fsync_dir", cannot)
    out = tmp_path / "model"
    with pytest.raises(OSError, match="cannot sync a folder here"):
        hf_io.save_hf_checkpoint(str(out), preset_arch("qwen3", "tiny"), iter([("w", torch.ones(2))]))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
