"""The in-memory sync's rendezvous store (server_plugin/megatron_rl_vllm_store.py, used by
transfer.GlooChannel): it listens on the transfer host only, a process without the per-rendezvous
token can neither read nor write a key (so cannot take a worker's rank), and the worker that has
the token joins and receives the broadcast. In-process: the "worker" and the "intruder" are
threads of this test with their own connections."""
import socket
import threading

import psutil
import pytest
import torch
import torch.distributed as dist

from megatron_rl.rollout.vllm.server_plugin.megatron_rl_vllm_store import SecretStoreClient, SecretStoreServer
from megatron_rl.rollout.vllm.transfer import GlooChannel

GUARD_S = 60.0  # hang guards only


def _listening(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_a_process_without_the_token_reads_and_writes_nothing():
    server = SecretStoreServer("127.0.0.1", timeout_s=GUARD_S)
    try:
        assert _listening(server.port) == ["127.0.0.1"]  # not 0.0.0.0 / ::
        server.store.set("0/0", b"rank 0's address")
        intruder = SecretStoreClient("127.0.0.1", server.port, "0" * 64, timeout_s=GUARD_S)
        with pytest.raises(RuntimeError, match="closed the connection"):
            intruder.get("0/0")
        with socket.create_connection(("127.0.0.1", server.port)) as raw:  # no token at all: a request line
            raw.sendall(b'{"op": "num_keys"}\n')
            try:
                answer = raw.recv(100)
            except ConnectionResetError:  # closed with the request unread: the kernel resets
                answer = b""
            assert answer == b""  # closed unanswered
        assert server.refused == 2 and server.store.num_keys() == 1
        member = SecretStoreClient("127.0.0.1", server.port, server.token, timeout_s=GUARD_S)
        assert member.get("0/0") == b"rank 0's address"
        member.set("0/1", b"w")
        assert server.store.get("0/1") == b"w" and member.add("n", 2) == 2 and member.check(["0/1"])
    finally:
        server.close()


def test_only_the_worker_with_the_token_joins_and_the_store_closes_after():
    """The intruder connects first (as it would at every server start) and tries to take rank 1;
    it is refused, the worker with the token takes it and gets the weights, and once the group is
    built nothing listens any more."""
    got, seen = {}, {}

    def worker(port: int, token: str) -> None:
        seen["listening"] = _listening(port)
        intruder = SecretStoreClient("127.0.0.1", port, "f" * 64, timeout_s=GUARD_S)
        with pytest.raises(RuntimeError):
            dist.ProcessGroupGloo(intruder, 1, 2, torch.distributed.default_pg_timeout)
        ready = threading.Event()

        def join():
            group = dist.ProcessGroupGloo(SecretStoreClient("127.0.0.1", port, token, GUARD_S), 1, 2,
                                          torch.distributed.default_pg_timeout)
            ready.set()
            data = torch.zeros(6, dtype=torch.uint8)
            group.broadcast(data, 0).wait()
            got["data"] = data

        got["thread"] = threading.Thread(target=join)
        got["thread"].start()
        assert ready.wait(GUARD_S)

    channel = GlooChannel("127.0.0.1", 2, GUARD_S, worker)
    channel.broadcast(torch.arange(6, dtype=torch.uint8))
    got["thread"].join(GUARD_S)
    assert seen["listening"] == ["127.0.0.1"]
    assert torch.equal(got["data"], torch.arange(6, dtype=torch.uint8))
    assert channel.store.refused == 1
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", channel.store.port), timeout=GUARD_S)
    channel.close()


def test_a_server_of_two_workers_joins_through_one_store():
    """tensor_parallel_size=2: both workers join at once, each on its own connection."""
    got, threads, joined = {}, [], [threading.Event(), threading.Event()]

    def workers(port: int, token: str) -> None:
        """Returns once both have joined, as /init_weight_transfer_engine does (then the store closes)."""
        def join(rank: int) -> None:
            group = dist.ProcessGroupGloo(SecretStoreClient("127.0.0.1", port, token, GUARD_S), rank, 3,
                                          torch.distributed.default_pg_timeout)
            joined[rank - 1].set()
            data = torch.zeros(4, dtype=torch.uint8)
            group.broadcast(data, 0).wait()
            got[rank] = data

        threads.extend(threading.Thread(target=join, args=(rank,)) for rank in (1, 2))
        for t in threads:
            t.start()
        assert all(e.wait(GUARD_S) for e in joined)

    channel = GlooChannel("127.0.0.1", 3, GUARD_S, workers)
    channel.broadcast(torch.arange(4, dtype=torch.uint8))
    for t in threads:
        t.join(GUARD_S)
    assert all(torch.equal(got[rank], torch.arange(4, dtype=torch.uint8)) for rank in (1, 2))
    channel.close()
