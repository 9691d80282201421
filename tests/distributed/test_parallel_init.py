"""A single process meets no one: it needs no rendezvous port (two single-process runs on one
machine, or one beside anything holding torch's default port 29500, never collide) and listens on
no wildcard address (a TCP store listens on every interface, unauthenticated, for the whole run;
gloo's own socket is bound to the one address of this host's name)."""
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = ("import psutil, torch.distributed as dist\n"
         "from megatron_rl.parallel import init_distributed\n"
         "print(init_distributed())\n"
         "print([c.laddr.ip for c in psutil.Process().net_connections('inet') if c.status == 'LISTEN'\n"
         "       and c.laddr.ip in ('0.0.0.0', '::')])\n"
         "dist.destroy_process_group()\n")


def test_single_process_init_needs_no_port_and_listens_on_no_wildcard_address():
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
    assert run.stdout.split("\n")[:2] == ["(0, 1)", "[]"]
