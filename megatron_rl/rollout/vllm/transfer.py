"""In-memory weight sync into a vLLM server: the trainer's side of vLLM's weight-transfer API.

    sync = MemorySync(server, backend_for(torch.cuda.is_available()), bucket_bytes=1 << 30, host=HOST)
    sync.open(timeout)                          # once per server process: the rendezvous
    pushed = push_all([sync, ...], named, version, timeout)   # per sync, to every server: no file, no restart

Control plane: HTTP to the server's RL endpoints (VLLM_SERVER_DEV_MODE=1; every request carries
the server's bearer key like all others, serving/launcher.py Access). Per sync:

    POST /pause?mode=wait          in-flight requests finish on the old weights, caches are dropped
    POST /start_weight_update      the workers begin a layerwise reload
    per bucket: POST /update_weights {names, dtype_names, shapes}   || broadcast of its bytes
    POST /finish_weight_update {weight_version}    the reload ends (MoE kernels repacked); the
                                   tokens generated from now on are labelled `version`
    POST /resume

Updating without the pause kills the engine core (EngineDeadError): the model's weights are
torn down layer by layer while the scheduler runs. The trainer's schedules never sync while
they generate, so `wait` drains nothing; it only makes that so. A sync inside a partial rollout
(`held`: the engine has frozen its requests with /pause?mode=keep, generation.py) skips the
pause and the resume: the engine's resume() lets the frozen requests go on.

Data plane: a process group of the trainer (rank 0, the sender) and the server's workers
(ranks 1..W, W = /get_world_size), over the backend keyed on CUDA:
  - `nccl` (CUDA in the trainer): vLLM's own engine. The trainer drives vLLM's PyNcclCommunicator,
    so it needs vLLM importable in its own environment (pip install .[vllm]).
  - `gloo` (no CUDA): vLLM's engines all need CUDA, so the server runs ours
    (server_plugin/megatron_rl_vllm_gloo.py), speaking the same messages; the trainer hosts the
    rendezvous store and a gloo group with plain torch. The store listens on `host`
    (rollout.vllm.transfer_host) only, on a port the kernel picks, answers only connections that
    open with a fresh secret sent in the keyed /init_weight_transfer_engine body, and closes once
    the workers have joined (server_plugin/megatron_rl_vllm_store.py): nothing else can read the
    ranks' addresses or take a worker's rank. (vLLM's nccl engine rendezvouses its own way.)

Buckets: the HF-named tensors arrive as a stream (the export gathers each from the ranks that own
it) and are copied into one reused buffer of `bucket_bytes`; a full buffer is one /update_weights
and one broadcast. The buffer is free again once its broadcast returns (the bytes are sent), so
the next bucket is gathered and packed while the server loads this one, and sent once it has (the
worker takes one update at a time). A tensor larger than the buffer goes alone, from its own
memory. Our gloo engine receives each update as one broadcast;
vLLM's packed nccl receiver cuts a chunk once its byte total exceeds the buffer size, which the
trainer sets to `bucket_bytes`, and a bucket never exceeds it (or holds one tensor): one bucket
is one broadcast on both.

Cost per sync: the model's bytes once through the sender per server worker (a gloo broadcast is a
send per peer; NCCL's is a ring), ceil(model bytes / bucket_bytes) + (tensors larger than a bucket)
round trips of HTTP, and the sender's extra host memory is the buffer (`bucket_bytes`, on the
GPU for nccl) plus the tensor the export holds; nothing grows with the model beyond that.
Several servers (a pool, pool.py): one group per server, each bucket packed once and broadcast on
every group at once (push_all, a thread per server). The sender's traffic is the model's bytes
times the workers of all servers, the same as one gloo group over all of them (gloo's broadcast
is a send per peer); with NCCL one group with a rank offset per server would send each bucket
once down a ring, N times less for N servers. Separate groups are kept for what a pool is for:
a server that dies and restarts joins a group of its own again (/init_weight_transfer_engine with
a fresh rendezvous), while one shared group would have to be torn down and rebuilt by every
server, each pausing, and a member dying mid-broadcast would break the transfer to all.
"""
from __future__ import annotations

import datetime
import json
import math
import socket
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import numpy
import torch

from megatron_rl.rollout.serving.errors import ServingError, UnsupportedError
from megatron_rl.rollout.serving.handle import ServerHandle
from megatron_rl.rollout.serving.http import request_json
from megatron_rl.rollout.serving.receivers import Pushed, Watch

Named = Iterable[tuple[str, torch.Tensor]]
GLOO_EXTENSION = "megatron_rl_vllm_gloo.RegistersGlooEngine"  # server_plugin/megatron_rl_vllm_gloo.py
PROFILE_DIR_ENV = "MEGATRON_RL_VLLM_SYNC_PROFILE_DIR"  # the same in the server plugin: where it profiles each sync


@dataclass(frozen=True)
class Meta:
    """One tensor of a bucket as the server is told of it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def update_info(metas: list[Meta]) -> dict:
    """The /update_weights payload of one bucket (vLLM's NCCLWeightTransferUpdateInfo fields)."""
    return {"names": [m.name for m in metas], "dtype_names": [str(m.dtype).removeprefix("torch.") for m in metas],
            "shapes": [list(m.shape) for m in metas]}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for two uint8 [n] tensors. Host to host it is one memcpy on this thread
    (numpy's copyto): torch's copy_ splits a large copy over its intra-op (OpenMP) threads, which
    buys nothing for a memory-bound copy and, on a host whose cores are busy (a same-host vLLM
    server, other jobs), waits on descheduled threads: 300 MiB took 1.0-2.9 s with torch's 2
    threads on the shared 2-core benchmark host, 0.2 s as one memcpy. On a device, torch's copy."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        numpy.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def packed_buckets(named: Named, bucket_bytes: int, device: torch.device | str = "cpu"
                   ) -> Iterator[tuple[list[Meta], torch.Tensor]]:
    """(metas, uint8 bytes [sum of their nbytes]) per bucket of at most `bucket_bytes` (one larger
    tensor is a bucket of its own, sent from its own memory). The bytes of a packed bucket are a
    view of one buffer that the next bucket overwrites: send them before asking for the next."""
    buffer: torch.Tensor | None = None
    metas: list[Meta] = []
    used = 0
    for name, tensor in named:
        meta = Meta(name, tensor.dtype, tuple(tensor.shape))
        if metas and used + meta.nbytes > bucket_bytes:
            yield metas, buffer[:used]
            metas, used = [], 0
        if meta.nbytes > bucket_bytes:
            yield [meta], _bytes(tensor).to(device)
            continue
        if buffer is None:
            buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
        copy_bytes(buffer[used:used + meta.nbytes], _bytes(tensor))
        metas.append(meta)
        used += meta.nbytes
    if metas:
        yield metas, buffer[:used]


# ---- the data plane: one registered backend per device kind -----------------------------------
class Channel(Protocol):
    """The trainer's end of the broadcast group (rank 0)."""

    device: str

    def broadcast(self, data: torch.Tensor) -> None:
        """Send `data` (uint8 [n], on `device`) to every worker; returns once it is sent."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class Backend:
    """name: the server's `--weight-transfer-config` backend. server_args: what a server we launch
    needs to receive over it. init_info(host, port, world_size, bucket_bytes, timeout_s, token): the
    /init_weight_transfer_engine payload (token: the rendezvous store's secret, None for vLLM's
    own). connect(host, world_size, timeout_s, start_peers): open the trainer's end while
    `start_peers(port, token)` makes the workers join."""

    name: str
    server_args: tuple[str, ...]
    init_info: Callable[[str, int, int, int, float, str | None], dict]
    connect: Callable[[str, int, float, Callable[[int, str | None], None]], Channel]


class GlooChannel:
    """A gloo group with the server's workers. The rendezvous store listens on `host` only and takes
    no request without its token (server_plugin/megatron_rl_vllm_store.py), which the workers get in
    the keyed /init_weight_transfer_engine body; it stops listening once every worker has joined."""

    device = "cpu"

    def __init__(self, host: str, world_size: int, timeout_s: float, start_peers: Callable[[int, str | None], None]):
        import torch.distributed as dist

        from megatron_rl.rollout.vllm.server_plugin.megatron_rl_vllm_store import SecretStoreServer

        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = SecretStoreServer(host, timeout_s)
        try:
            with ThreadPoolExecutor(1) as pool:
                joined = pool.submit(start_peers, self.store.port, self.store.token)  # the workers block in the rendezvous
                try:
                    self.group = dist.ProcessGroupGloo(self.store.store, 0, world_size, timeout)
                finally:
                    joined.result()
        finally:
            self.store.close()  # the group's connections are made: nothing may join any more

    def broadcast(self, data: torch.Tensor) -> None:
        self.group.broadcast(data, 0).wait()

    def close(self) -> None:
        self.group = None


def _gloo_init_info(host: str, port: int, world_size: int, bucket_bytes: int, timeout_s: float,
                    token: str | None) -> dict:
    del bucket_bytes  # our engine receives each update as one broadcast, whatever its size
    return {"master_address": host, "master_port": port, "rank_offset": 1, "world_size": world_size,
            "timeout_s": timeout_s, "store_token": token}


class NcclChannel:
    """vLLM's PyNcclCommunicator (vLLM in the trainer's environment, a CUDA device)."""

    device = "cuda"

    def __init__(self, host: str, world_size: int, timeout_s: float, start_peers: Callable[[int, str | None], None]):
        try:
            from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
        except ImportError as e:
            raise UnsupportedError(nccl_needs_vllm()) from e
        port = _free_port(host)  # vLLM's StatelessProcessGroup binds the port it is given
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(start_peers, port, None)  # vLLM's rendezvous takes no token
            try:
                self.comm = stateless_init_process_group(host, port, 0, world_size, torch.cuda.current_device())
            finally:
                joined.result()

    def broadcast(self, data: torch.Tensor) -> None:
        stream = torch.cuda.current_stream()
        self.comm.broadcast(data, src=0, stream=stream)
        stream.synchronize()  # the buffer is refilled for the next bucket

    def close(self) -> None:
        self.comm = None


def _nccl_init_info(host: str, port: int, world_size: int, bucket_bytes: int, timeout_s: float,
                    token: str | None) -> dict:
    del timeout_s, token  # vLLM's NCCL init info has neither
    return {"master_address": host, "master_port": port, "rank_offset": 1, "world_size": world_size,
            "packed": True, "packed_buffer_size_bytes": bucket_bytes, "packed_num_buffers": 2}


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def nccl_needs_vllm() -> str:
    return ("rollout.weight_sync=memory with CUDA uses vLLM's nccl weight-transfer engine, which the trainer "
            "drives with vLLM's own communicator: install vLLM in the trainer's environment (pip install .[vllm]), "
            "or set rollout.weight_sync=reload")


BACKENDS = {
    "gloo": Backend("gloo", ("--worker-extension-cls", GLOO_EXTENSION), _gloo_init_info, GlooChannel),
    "nccl": Backend("nccl", (), _nccl_init_info, NcclChannel),
}


def backend_for(cuda: bool) -> Backend:
    """vLLM's own nccl engine when the trainer has CUDA, else our gloo one."""
    return BACKENDS["nccl" if cuda else "gloo"]


def weight_transfer_args(backend: Backend) -> list[str]:
    """The server flags for receiving over `backend`."""
    return ["--weight-transfer-config", json.dumps({"backend": backend.name}), *backend.server_args]


# ---- the control plane -------------------------------------------------------------------------
class MemorySync:
    """Streams weights into one server over `backend` (module docstring). `open` once per server
    process (again after the server restarts); per sync, push_all drives its begin / send / end
    on the engine's rank."""

    def __init__(self, server: ServerHandle, backend: Backend, bucket_bytes: int, host: str):
        self.server, self.backend, self.bucket_bytes, self.host = server, backend, bucket_bytes, host
        self.channel: Channel | None = None
        self._rpc = ThreadPoolExecutor(1, thread_name_prefix="vllm-weight-update")

    def _post(self, path: str, body: dict | None, timeout: float):
        return request_json(self.server.url + path, body if body is not None else {}, timeout=timeout,
                            api_key=self.server.api_key)

    def open(self, timeout: float, group_timeout: float | None = None) -> None:
        """Join the server's workers into the broadcast group. timeout: each request and the
        rendezvous; group_timeout (default: timeout): the group's, which bounds each broadcast
        (rollout.vllm.sync_timeout_s: a broadcast to a hung worker that a push abandoned ends
        by then, and never holds the trainer's exit longer)."""
        self.close()
        # a fresh request thread: one abandoned by a failed push may still wait on the old process
        self._rpc.shutdown(wait=False)
        self._rpc = ThreadPoolExecutor(1, thread_name_prefix="vllm-weight-update")
        size = request_json(self.server.url + "/get_world_size", timeout=timeout, api_key=self.server.api_key)
        if not isinstance(size, dict) or not isinstance(size.get("world_size"), int):
            raise ServingError(f"{self.server.url}/get_world_size answered {size!r:.200}; in-memory weight sync needs a "
                               f"vLLM server with VLLM_SERVER_DEV_MODE=1")
        world = 1 + size["world_size"]

        def start_peers(port: int, token: str | None) -> None:
            info = self.backend.init_info(self.host, port, world, self.bucket_bytes, group, token)
            self._post("/init_weight_transfer_engine", {"init_info": info}, timeout)

        group = timeout if group_timeout is None else group_timeout
        self.channel = self.backend.connect(self.host, world, group, start_peers)

    def begin(self, timeout: float, held: bool = False) -> None:
        if self.channel is None:
            raise ServingError("in-memory weight sync is not open: call open() once the server is up")
        if not held:
            self._post("/pause?mode=wait", None, timeout)
        self._post("/start_weight_update", None, timeout)

    def send(self, metas: list[Meta], data: torch.Tensor, timeout: float) -> Future:
        """One bucket: its /update_weights and its broadcast. Returns once the bytes are sent (both
        channels' broadcasts return then: the buffer may be refilled), with the /update_weights
        answer as a future: it resolves once the server has loaded the bucket."""
        loaded = self._rpc.submit(self._post, "/update_weights", {"update_info": update_info(metas)}, timeout)
        self.channel.broadcast(data)
        return loaded

    def end(self, version: int, timeout: float, held: bool = False) -> None:
        self._post("/finish_weight_update", {"weight_version": str(version)}, timeout)
        if not held:
            self._post("/resume", None, timeout)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def push_all(syncs: list[MemorySync], named: Named, version: int, timeout: float,
             held: Collection[MemorySync] = (), watch: Watch | None = None) -> Pushed:
    """Send the stream to every server of `syncs` (each over its own group) as weights `version`
    (the engine hands it to the serving layer as its Push, serving/receivers.py, whose Watch and
    Pushed these are).
    held: those of them already paused (a partial rollout's /pause?mode=keep), which stay so. The
    stream is read and packed once; each bucket goes to all servers at once (one thread per
    server). The next bucket is gathered and packed into the same buffer while the servers load
    this one (its bytes are sent once the broadcasts return), and is sent once they have: a worker
    takes one update at a time.

    A server whose request or broadcast fails, that stops answering /health while the push waits
    on it, or that has not done its part when `watch.deadline_s` (from the start) has passed, is
    dropped: it gets nothing more, is left paused and half updated, and is named in
    `Pushed.failed` (the caller restarts it before it serves again). Its stuck request or
    broadcast is abandoned in its thread (it ends with the server, or at its own timeout), so the
    push never waits for it. The deadline bounds the whole push: once it has passed, the servers
    still live are dropped too (a hang that /health does not show fails the sync; the health
    check is what lets the others finish). The push's wall time is so at most the deadline plus
    the health checks then in progress (health_timeout_s each) and the tensor the export is then
    gathering. Every HTTP request's timeout is `timeout` or what is left of the deadline. When
    every server is dropped the rest of the stream is left unread. An error of the stream itself
    propagates (every server is then half updated)."""
    watch = watch or Watch()
    t0 = time.perf_counter()
    end_by = t0 + watch.deadline_s
    live, failed = list(syncs), {}
    device = syncs[0].channel.device if syncs[0].channel is not None else "cpu"
    pool = ThreadPoolExecutor(len(syncs), thread_name_prefix="vllm-push")

    def drop(s: MemorySync, why: str) -> None:
        if s in live:
            live.remove(s)
            failed[s] = why

    def settle(pending: dict[Future, MemorySync]) -> dict[MemorySync, object]:
        """Wait for one step of every live server; drop those that fail, die or run past the deadline."""
        results, checked = {}, time.perf_counter()
        while pending:
            left = end_by - time.perf_counter()
            if left <= 0:
                late = any(why.startswith("did not finish") for why in failed.values())
                for s in set(pending.values()):
                    drop(s, f"was left unfinished: {watch.setting}={watch.deadline_s:g} s ran out while the sync "
                            f"waited on the server dropped first" if late else
                            f"did not finish its part of the sync within {watch.setting}={watch.deadline_s:g} s")
                break
            done, _ = wait(pending, timeout=min(watch.interval_s, left), return_when=FIRST_COMPLETED)
            for f in done:
                s = pending.pop(f)
                if f.exception() is not None:
                    drop(s, f"{type(f.exception()).__name__}: {f.exception()}")
                elif s in live:
                    results[s] = f.result()
            if pending and watch.alive is not None and time.perf_counter() - checked >= watch.interval_s:
                checked = time.perf_counter()
                for s in {s for s in pending.values() if not watch.alive(s)}:
                    drop(s, f"stopped answering /health during the sync, hung or dead ({watch.health_setting})")
            pending = {f: s for f, s in pending.items() if s in live}
        return results

    def step(call) -> dict[MemorySync, object]:
        """call(sync, http_timeout) on every live server at once, settled."""
        budget = max(0.001, min(timeout, end_by - time.perf_counter()))
        return settle({pool.submit(call, s, budget): s for s in live})

    try:
        step(lambda s, t: s.begin(t, s in held))
        loading: dict[MemorySync, Future] = {}  # the last bucket's loads, one per live server
        for metas, data in packed_buckets(named, syncs[0].bucket_bytes, device):  # packs while they load
            settle({f: s for s, f in loading.items() if s in live})
            if not live:
                break
            loading = step(lambda s, t, metas=metas, data=data: s.send(metas, data, t))
        settle({f: s for s, f in loading.items() if s in live})
        if live:
            step(lambda s, t: s.end(version, t, s in held))
    finally:
        # an abandoned step stays in its thread (it may still read the buffer, which only a dropped
        # server then receives); the others have returned
        pool.shutdown(wait=False)
    return Pushed(time.perf_counter() - t0, failed)
