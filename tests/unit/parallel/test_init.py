"""A single process picks its rendezvous port from the kernel: two single-process runs on one
machine (or one beside anything holding torch's default port 29500) never collide."""
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CHILD = ("import torch.distributed as dist\n"
         "from megatron_rl.parallel import init_distributed\n"
         "print(init_distributed()); dist.destroy_process_group()\n")


def test_single_process_init_does_not_need_port_29500():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("127.0.0.1", 29500))
            busy.listen()
        except OSError:
            pass  # someone else holds it already: the point stands
        run = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "(0, 1)"
