"""examples/slurm_rl.sbatch without a cluster: its shell logic runs with stand-in `scontrol`, `srun`,
`torchrun`, `curl` and vLLM, and the pretrain_rl.py command it builds must parse, fit the world
size it launches (--print-config runs the layout check) and keep the vLLM servers' GPUs out of
training; with rollout nodes, the servers it starts must be the pool the trainer is given."""
import json
import os
import stat
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "slurm_rl.sbatch")

SHIMS = {
    "scontrol": "#!/bin/bash\nprintf 'gpu-node-1\\ngpu-node-2\\n'\n",
    # srun: record its options, run the job step once, as node 0
    "srun": "#!/bin/bash\nwhile [[ $1 == --* ]]; do echo \"$1\" >> \"$LOG/srun\"; shift; done\n"
            "SLURM_NODEID=0 exec \"$@\"\n",
    # torchrun: record its options, run the entry point as one of nnodes x nproc_per_node ranks
    "torchrun": "#!/bin/bash\nwhile [[ $1 == --* ]]; do echo \"$1\" >> \"$LOG/torchrun\"; "
                "case $1 in --nnodes=*) N=${1#*=};; --nproc_per_node=*) P=${1#*=};; esac; shift; done\n"
                "printf '%s\\n' \"$@\" > \"$LOG/args\"; WORLD_SIZE=$((N * P)) exec \"$PY\" \"$@\" --print-config\n",
    # curl: every server answers /health at once
    "curl": "#!/bin/bash\necho \"${@: -1}\" >> \"$LOG/curl\"\n",
    # vLLM: record the devices, key and arguments each server was started with
    "vllm": "#!/bin/bash\necho \"$CUDA_VISIBLE_DEVICES|$VLLM_API_KEY|$VLLM_SERVER_DEV_MODE|$*\" >> \"$LOG/vllm\"\n",
}


def _run(tmp_path, gpus_for_vllm: str | None, *overrides, visible: str | None = None, **extra_env):
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in SHIMS.items():
        (shims / name).write_text(text)
        (shims / name).chmod(stat.S_IRWXU)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}", LOG=str(tmp_path), PY=sys.executable,
               SLURM_GPUS_PER_NODE="h100:8", SLURM_NNODES="2", SLURM_CPUS_PER_TASK="64",
               SLURM_JOB_NODELIST="gpu-node-[1-2]", VLLM_PYTHON=str(shims / "vllm"), **extra_env)
    for name in {"GPUS_FOR_VLLM", "ROLLOUT_NODES", "MEGATRON_RL_VLLM_API_KEY"} - set(extra_env):
        env.pop(name, None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if gpus_for_vllm is not None:
        env["GPUS_FOR_VLLM"] = gpus_for_vllm
    run = subprocess.run(["bash", SCRIPT, "examples/demo_cpu.yaml", "rollout.prompts_per_step=12",
                          "train.micro_batch_size=2", "sft.steps=0", *overrides], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    options = {name: (tmp_path / name).read_text().splitlines() if (tmp_path / name).exists() else []
               for name in ("srun", "torchrun", "args", "curl", "vllm")}
    return json.loads(run.stdout[run.stdout.index("{"):]), options


def test_the_vllm_server_gets_gpus_no_trainer_rank_uses(tmp_path):
    cfg, options = _run(tmp_path, None)
    assert "--cpus-per-task=64" in options["srun"]   # srun does not inherit it (SLURM >= 22.05)
    assert "--nproc_per_node=6" in options["torchrun"] and "--nnodes=2" in options["torchrun"]
    assert cfg["rollout"]["backend"] == "vllm"
    assert cfg["rollout"]["vllm"]["tensor_parallel_size"] == 2
    assert list(cfg["rollout"]["vllm"]["env"]) == ["CUDA_VISIBLE_DEVICES"]   # its value is redacted in print
    par = cfg["parallel"]
    assert (par["tensor_model_parallel_size"], par["expert_model_parallel_size"],
            par["expert_tensor_parallel_size"]) == (2, 4, 1)


def test_the_devices_given_to_the_server(tmp_path):
    """The override the script builds, read back from the command torchrun ran (the printed config
    redacts the server's environment)."""
    cfg, options = _run(tmp_path, "4")
    assert "--nproc_per_node=4" in options["torchrun"]
    assert 'rollout.vllm.env={CUDA_VISIBLE_DEVICES: "4,5,6,7"}' in options["args"]
    assert cfg["rollout"]["vllm"]["tensor_parallel_size"] == 4


def test_without_a_server_every_gpu_trains(tmp_path):
    cfg, options = _run(tmp_path, "0", "rollout.backend=embedded")
    assert "--nproc_per_node=8" in options["torchrun"]
    assert cfg["rollout"]["backend"] == "embedded"


def test_the_server_takes_the_last_of_the_gpus_slurm_gave_the_job(tmp_path):
    """On a shared node SLURM may give the job GPUs 8-15: the server must stay inside them."""
    _, options = _run(tmp_path, None, visible="8,9,10,11,12,13,14,15")
    assert 'rollout.vllm.env={CUDA_VISIBLE_DEVICES: "14,15"}' in options["args"]


def test_rollout_nodes_serve_a_pool_the_trainer_reaches_by_url(tmp_path):
    """ROLLOUT_NODES=1 on 2 nodes: node 2 runs two servers of 4 GPUs each, node 1 trains on all 8."""
    cfg, options = _run(tmp_path, None, ROLLOUT_NODES="1", VLLM_TP="4", VLLM_MODEL="/shared/policy-hf",
                        MEGATRON_RL_VLLM_API_KEY="job-key")
    assert "--nproc_per_node=8" in options["torchrun"] and "--nnodes=1" in options["torchrun"]
    assert {"--nodes=1", "--relative=1", "--relative=0"} <= set(options["srun"])
    urls = ["http://gpu-node-2:8000", "http://gpu-node-2:8001"]
    assert cfg["rollout"]["backend"] == "vllm" and cfg["rollout"]["vllm"]["urls"] == urls
    assert cfg["rollout"]["vllm"]["transfer_host"] == "gpu-node-1"  # trainer rank 0, the transfer's sender
    assert options["curl"] == [f"{u}/health" for u in urls]  # the trainer started once both answered
    servers = sorted(line.split("|") for line in options["vllm"])
    assert [(s[0], s[1], s[2]) for s in servers] == [("0,1,2,3", "job-key", "1"), ("4,5,6,7", "job-key", "1")]
    for port, (*_, args) in zip((8000, 8001), servers):
        assert f"--port {port} --tensor-parallel-size 4" in args and "--model /shared/policy-hf" in args
        assert '--load-format dummy --weight-transfer-config {"backend": "nccl"}' in args
        assert "--skip-tokenizer-init --enable-scale-out" in args  # the token-in/token-out endpoint the client uses
        assert "--enable-prompt-tokens-details" in args  # cached prompt tokens: rollout/prefix_cache/*
        assert "job-key" not in args  # the key only in the environment


def test_rollout_nodes_need_a_node_left_to_train(tmp_path):
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in SHIMS.items():
        (shims / name).write_text(text)
        (shims / name).chmod(stat.S_IRWXU)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}", LOG=str(tmp_path), SLURM_GPUS_PER_NODE="8",
               SLURM_NNODES="2", SLURM_CPUS_PER_TASK="64", SLURM_JOB_NODELIST="gpu-node-[1-2]", ROLLOUT_NODES="2")
    run = subprocess.run(["bash", SCRIPT, "examples/demo_cpu.yaml"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 2 and "ROLLOUT_NODES=2 leaves no node of the 2 to train on" in run.stderr
