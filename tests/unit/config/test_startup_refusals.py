"""Settings that were accepted and then ignored, or failed only mid-run, are refused by load_config."""
import os

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.configure import load_config


@pytest.mark.parametrize("overrides,msg", [
    (["rollout.group_size=1"], r"rollout.group_size=1: must be an integer >= 2 \(every advantage estimator"),
    (["data.heldout_size=600000"], r"data.heldout_size=600000: addition: heldout_size=600000 is more than half"),
    (["data.tasks=[sorting]", "data.heldout_size=600000"], r"data.heldout_size=600000: sorting:"),
    (["sft.steps=5", "train.eval_size=0"],
     r"sft.target_accuracy=0.35 can never stop SFT: .* empty because train.eval_size=0; set sft.target_accuracy=null"),
    (["sft.steps=5", "data.heldout_size=0"], r"empty because data.heldout_size=0"),
    (["sft.steps=5", "data.jsonl=prompts.jsonl"], r"empty because data.jsonl is set"),
    (["optim.min_lr=1e-5"], r"optim.min_lr=1e-05: there is no learning-rate schedule"),
    (["rollout.backend=vllm", "rollout.vllm={request_timeout_s: 0}"],
     r"rollout.vllm.request_timeout_s=0.0: must be a number > 0 \(seconds; 0 is not 'no timeout'"),
    (["rollout.backend=vllm", "rollout.vllm={health_timeout_s: 0}"], r"rollout.vllm.health_timeout_s=0.0: must be"),
    (["rollout.backend=vllm", "rollout.vllm={sync_timeout_s: 0}"], r"rollout.vllm.sync_timeout_s=0.0: must be"),
    (["rollout.backend=vllm", "rollout.vllm={sync_timeout_s: .inf}"], r"rollout.vllm.sync_timeout_s=inf: must be a finite"),
    (["rollout.backend=vllm", "rollout.vllm={gpu_memory_utilization: 90}"],
     r"rollout.vllm.gpu_memory_utilization=90.0: must be a number > 0 and <= 1"),
    (["rollout.backend=vllm", "rollout.vllm={max_num_seqs: 0}"], r"rollout.vllm.max_num_seqs=0: must be an integer >= 1"),
    (["rollout.backend=vllm", "rollout.vllm={dialect: sglang}"],
     r"rollout.vllm.dialect='sglang': not a registered server kind; choose one of vllm \(megatron_rl.rollout.serving"),
    (["rollout.backend=vllm", "rollout.vllm={dialect: [vllm]}"], r"rollout.vllm.dialect=\['vllm'\]"),
])
def test_refused_at_startup(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides", [
    ["rollout.group_size=2"],
    ["sft.steps=5", "train.eval_size=0", "sft.target_accuracy=null"],
    ["sft.steps=0", "train.eval_size=0"],          # SFT off: its settings do not matter
    ["sft.steps=5", "sft.eval_size=600"],   # cut to train.eval_size (documented: SFTSection.eval_size)
    ["optim.min_lr=0"],
    ["rollout.backend=vllm", "rollout.vllm={gpu_memory_utilization: 0.5, max_num_seqs: 8, max_logprobs: null}"],
    ["rollout.backend=vllm", "rollout.vllm={dialect: vllm}"],
])
def test_neighbouring_settings_pass(overrides):
    load_config(None, overrides)


def test_heldout_size_default_is_the_tasks_former_size():
    """Tasks held out 1000 problems while data.heldout_size was not passed to them; the default
    and the demo keep that, so their runs draw the same training prompts as before."""
    from megatron_rl.data.tasks import Task

    assert load_config(None).data.heldout_size == Task.heldout_size == 1000
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert load_config(os.path.join(root, "examples", "demo_cpu.yaml")).data.heldout_size == 1000


@pytest.mark.parametrize("override,msg", [
    ("{num_kv_heads: 0}", r"model.overrides.num_kv_heads=0: must be an integer >= 1"),
    ("{num_layers: 0}", r"model.overrides.num_layers=0: must be an integer >= 1"),
    ("{num_layers: 2.5}", r"model.overrides.num_layers=2.5: must be an integer"),
    ("{num_experts: -1}", r"model.overrides.num_experts=-1: must be an integer >= 0"),
    ("{rms_norm_eps: 0}", r"model.overrides.rms_norm_eps=0: must be a number > 0"),
    ("{rope_theta: big}", r"model.overrides.rope_theta='big': must be a number > 0"),
    ("{tie_word_embeddings: 1}", r"model.overrides.tie_word_embeddings=1: must be true or false"),
    ("{mlp_only_layers: [0, -1]}", r"model.overrides.mlp_only_layers\[1\]=-1: must be an integer >= 0"),
])
def test_model_overrides_are_checked_by_field_type(override, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, [f"model.overrides={override}"])


def test_model_overrides_written_as_yaml_text_become_numbers():
    """YAML reads 1e6 (no dot, no exponent sign) as a string; the float fields take it as the number."""
    overrides = "{rope_theta: 1e6, rms_norm_eps: 1e-5, num_experts: 0, rope_llama3_factor: 0, mlp_only_layers: [0]}"
    cfg = load_config(None, ["model.arch=qwen3", f"model.overrides={overrides}"])   # dense: no experts
    assert cfg.model.overrides == {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_experts": 0,
                                   "rope_llama3_factor": 0, "mlp_only_layers": [0]}


@pytest.mark.parametrize("overrides,msg", [
    (["loss.corrections=[{name: tis_token, C: 2}"],
     (r"loss.corrections='\[\{name: tis_token, C: 2\}': not a valid YAML value \(expected ',' or '\]'.*line 1, "
      r"column 25\); write it as YAML and quote the whole override")),
    (["--lr", "[1"], r"--lr='\[1': not a valid YAML value"),
    (["rollout=vllm"], r"rollout='vllm': rollout is a section, not a value; set one of its fields \(rollout.<field>="),
    (["train=5"], r"train=5: train is a section, not a value"),
    (["model.size=huge"], r"model.size='huge': unknown model size 'huge'; available: \[.*'tiny'"),
    (["model.arch=llama", "model.size=qwen3-8b"], r"model.size=qwen3-8b is a qwen3 model, but model.arch=llama"),
    (["model.overrides={num_attention_heads: 3}"], r"num_attention_heads \(3\) must be a multiple of"),
    (["model.overrides={moe_topk: 8}"], r"moe_topk=8 must be in \[1, num_experts=4\]"),
])
def test_malformed_values_and_shapes_are_config_errors(overrides, msg):
    """Each of these used to end in a traceback (a YAML parser error, an AttributeError deep in
    the loop) or only when the model was built, with exit code 1 instead of 2."""
    with pytest.raises(ConfigError, match=msg):
        load_config(None, overrides)


def test_invalid_yaml_file_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  arch: qwen3\n size: tiny\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML: expected <block end>.* at line 3, column 2"):
        load_config(str(path))


@pytest.mark.parametrize("world,flags,msg", [
    (1, ["--expert-model-parallel-size", "2"], r"world size 1 .* = 1 x 2 x 1; launch a multiple of 2 ranks"),
    (2, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
     r"= 2 x 2 x 1; set --expert-tensor-parallel-size 1"),
])
def test_expert_layout_is_checked_before_the_process_groups(world, flags, msg):
    with pytest.raises(ValueError, match=msg):
        load_config(None, flags).check_layout(world)
    load_config(None, flags + ["--expert-tensor-parallel-size", "1"]).check_layout(2)


def test_paths_the_config_names_are_checked_at_startup(tmp_path):
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    cases = [(["data.jsonl=" + str(tmp_path / "nope.jsonl")], r"data.jsonl=.*nope.jsonl: does not exist"),
             (["data.jsonl=" + str(tmp_path)], r"data.jsonl=.*: is a directory"),
             (["model.hf_dir=" + str(tmp_path / "nope")], r"model.hf_dir=.*: no such directory"),
             (["train.init_checkpoint=" + str(tmp_path / "nope")], r"train.init_checkpoint=.*: no such directory"),
             (["train.run_dir=" + str(a_file)], r"train.run_dir=.*f.txt is a file; choose a directory")]
    for overrides, msg in cases:
        cfg = load_config(None, overrides + ["sft.target_accuracy=null"])
        with pytest.raises(ValueError, match=msg):
            cfg.check_paths()
    load_config(None, [f"train.run_dir={tmp_path / 'new'}"]).check_paths()


@pytest.mark.parametrize("overrides,msg", [
    (["loss.recipe=minirl_r3", "rollout.backend=vllm", "rollout.vllm={device: cpu}"],
     r"r3 needs the rollout engine's routing, which a vLLM server on the CPU .* or R2 \(loss.recipe=minirl_r2\)"),
    (["moe.router_replay=r3", "rollout.backend=vllm", "rollout.vllm={device: cpu}"], r"or R2 \(moe.router_replay=r2\)"),
    (["loss.recipe=minirl_r3", "model.arch=qwen3"], r"needs a MoE model; .* or loss.recipe=minirl$"),
    (["moe.router_replay=r2", "model.arch=qwen3"], r"needs a MoE model; .* or moe.router_replay=none$"),
    (["loss.corrections=tis_token"], r"loss.corrections='tis_token': a list of mappings with a 'name'"),
])
def test_refusals_name_the_fix_that_works(overrides, msg):
    """A hint must not lead in a circle: r3 set by loss.recipe=minirl_r3 is turned off by another
    recipe, not by moe.router_replay (which the recipe then contradicts)."""
    with pytest.raises(ConfigError, match=msg):
        load_config(None, overrides)


def test_r3_with_a_vllm_server_that_may_be_a_gpu_one_is_left_to_the_engine():
    """A GPU vLLM server returns the routed experts (rollout.vllm.enable_return_routed_experts);
    whether an `auto` server is a CPU one is known when it is found, and refused there."""
    load_config(None, ["loss.recipe=minirl_r3", "rollout.backend=vllm"])
    load_config(None, ["loss.recipe=minirl_r3", "rollout.backend=vllm", "rollout.vllm={device: cuda}"])


def test_a_resume_does_not_need_the_init_checkpoint(tmp_path):
    """A requeued run resumes from its own checkpoints and never reads train.init_checkpoint (it
    may have been on scratch that is gone): only a fresh start requires it."""
    run = tmp_path / "run"
    overrides = [f"train.run_dir={run}", f"train.init_checkpoint={tmp_path / 'gone'}"]
    with pytest.raises(ValueError, match="train.init_checkpoint=.*gone: no such directory"):
        load_config(None, overrides).check_paths()
    (run / "checkpoints" / "iter_0000002").mkdir(parents=True)
    load_config(None, overrides).check_paths()
    with pytest.raises(ValueError, match="no such directory"):
        load_config(None, overrides + ["train.resume=false"]).check_paths()


def test_an_in_memory_buckets_size_is_bounded_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"rollout.vllm.bucket_bytes=1099511627776: must be an integer >= 1 and "
                                          r"<= 17179869184 \(16 GiB"):
        load_config(None, ["rollout.backend=vllm", "rollout.vllm={bucket_bytes: 1099511627776}"])


def test_the_machine_must_hold_the_buckets_and_resolve_the_transfer_host(monkeypatch, tmp_path):
    """At start-up (check_paths: what this machine sees): a bucket the trainer and every launched
    server's worker each hold must fit this machine's memory; the rendezvous host must resolve.
    The machine's memory and the resolver are faked (a real lookup of an unknown name may wait on
    DNS); a disk sync uses neither."""
    import socket

    from megatron_rl.rollout.vllm import config as vllm_config

    run = [f"train.run_dir={tmp_path}", "rollout.backend=vllm"]
    monkeypatch.setattr(vllm_config, "machine_memory_bytes", lambda: 8 << 30)
    with pytest.raises(ValueError, match=r"rollout.vllm.bucket_bytes=4294967296 \(4 GiB\): the trainer and 2 "
                                         r"launched server worker\(s\) would each hold a buffer of it, 12 GiB of this "
                                         r"machine's 8 GiB, more than half; lower it"):
        load_config(None, [*run, "rollout.vllm={bucket_bytes: 4294967296, num_servers: 2}"]).check_paths()
    load_config(None, [*run, "rollout.vllm={bucket_bytes: 2147483648}"]).check_paths()  # 4 of 8 GiB
    load_config(None, [*run, "rollout.vllm={bucket_bytes: 2147483648, url: 'http://10.0.0.9:8000'}"]).check_paths()

    def unresolvable(host, *args, **kwargs):
        if host == "no-such-host.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", unresolvable)
    with pytest.raises(ValueError, match=r"rollout.vllm.transfer_host='no-such-host.invalid' does not resolve on this "
                                         r"machine \(Name or service not known\)"):
        load_config(None, [*run, "rollout.vllm={transfer_host: no-such-host.invalid}"]).check_paths()
    load_config(None, [*run, "rollout.vllm={transfer_host: no-such-host.invalid}",
                       "rollout.weight_sync=reload"]).check_paths()
    load_config(None, [*run, "rollout.vllm={transfer_host: no-such-host.invalid}",
                       "rollout.backend=embedded"]).check_paths()
