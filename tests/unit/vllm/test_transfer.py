"""The pure parts of the in-memory weight sync (rollout/vllm/transfer.py): buckets, the messages
vLLM's weight-transfer endpoints read, the choice of backend, and the refusals at start-up. No
server and no process here (the real-server tests are tests/vllm/test_memory_sync.py)."""
import math
import threading

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.configure import load_config
from megatron_rl.rollout.engine import WEIGHT_SYNCS, weight_sync
from megatron_rl.rollout.serving.errors import ServingError, UnsupportedError
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from megatron_rl.rollout.vllm.transfer import (
    BACKENDS,
    MemorySync,
    Meta,
    backend_for,
    copy_bytes,
    packed_buckets,
    push_all,
    update_info,
    weight_transfer_args,
)
from tests.vllm.conftest import tiny_arch

NOWHERE = "http://127.0.0.1:9"  # never contacted: every test here fails before any request


def named(sizes, dtype=torch.float32):
    """(name, tensor) with distinct values; sizes in elements."""
    return [(f"t{i}", torch.arange(n, dtype=torch.float64).to(dtype) + 1000 * i) for i, n in enumerate(sizes)]


def unpack(metas, data):
    """What the server does with a bucket: split the bytes at each tensor's size and view them."""
    out, at = [], 0
    for m in metas:
        out.append((m.name, data[at:at + m.nbytes].view(m.dtype).view(m.shape)))
        at += m.nbytes
    assert at == data.numel()
    return out


def test_buckets_are_bounded_in_order_and_round_trip():
    tensors = named([10, 20, 5, 30, 1, 100, 2, 2])   # 4 bytes each element; 100 elements > a bucket
    buckets = [(metas, data.clone()) for metas, data in packed_buckets(tensors, bucket_bytes=160)]
    assert [[m.name for m in metas] for metas, _ in buckets] == [["t0", "t1", "t2"], ["t3", "t4"], ["t5"],
                                                                   ["t6", "t7"]]
    for metas, data in buckets:
        assert data.dtype == torch.uint8 and data.numel() == sum(m.nbytes for m in metas)
        assert data.numel() <= 160 or len(metas) == 1
    got = [pair for metas, data in buckets for pair in unpack(metas, data)]
    assert [n for n, _ in got] == [n for n, _ in tensors]
    for (_, want), (_, have) in zip(tensors, got):
        assert torch.equal(want, have)


def test_a_bucket_is_one_chunk_of_vllms_packed_receiver():
    """vLLM's nccl receiver (packed_nccl_broadcast_consumer) closes a chunk once its byte total
    exceeds the buffer size (bucket_bytes): a bucket at most that size, or a lone larger tensor, is
    received as exactly one chunk, so one broadcast per /update_weights (as our gloo engine takes it)."""
    def chunks(metas, limit):
        out, total, n = [], 0, 0
        for m in metas:
            total, n = total + m.nbytes, n + 1
            if total > limit:
                out.append(n)
                total, n = 0, 0
        return out + ([n] if n else [])

    for metas, _ in packed_buckets(named([7, 40, 3, 3, 64, 1, 17, 9], torch.bfloat16), bucket_bytes=64):
        assert chunks(metas, 64) == [len(metas)]


def test_the_buffer_is_reused_and_an_oversized_tensor_sent_from_its_own_memory():
    big = torch.ones(50)
    stream = packed_buckets([("a", torch.zeros(4)), ("big", big), ("b", torch.ones(4)), ("c", torch.ones(4))], 32)
    _, data1 = next(stream)
    _, data_big = next(stream)
    assert data_big.data_ptr() == big.data_ptr()   # no copy for a tensor larger than the buffer
    _, data2 = next(stream)
    assert data1.data_ptr() == data2.data_ptr()   # one buffer: the trainer's extra memory is one bucket


def test_copy_bytes_copies_host_and_strided_sources():
    src = torch.arange(24, dtype=torch.bfloat16).view(4, 6).t()   # not contiguous: packed via its bytes
    flat = src.contiguous().view(-1).view(torch.uint8)
    dst = torch.zeros(flat.numel() + 8, dtype=torch.uint8)
    copy_bytes(dst[4:4 + flat.numel()], flat)
    assert torch.equal(dst[4:4 + flat.numel()].view(torch.bfloat16).view(6, 4), src)
    assert not dst[:4].any() and not dst[-4:].any()


class _Channel:
    device = "cpu"

    def __init__(self, log):
        self.log, self.sent = log, []

    def broadcast(self, data):
        self.log.append(("broadcast", len(self.sent)))
        self.sent.append(data.clone())


def test_push_packs_the_next_bucket_while_the_server_loads_one():
    """The stream is read on while bucket k's /update_weights runs (the server loads it), and bucket
    k+1's update and broadcast wait for it. Each load blocks until the trainer has packed the next
    bucket, so a push that waited for the load before packing on would never finish (caught by
    the wait's bound: a failure, never a pass)."""
    log, pulled, loads = [], [threading.Event() for _ in range(5)], []
    tensors = named([8, 8, 8, 8, 8])   # 32 bytes each, a bucket each

    def stream():
        for i, pair in enumerate(tensors):
            log.append(("pull", i))
            pulled[i].set()
            yield pair

    def post(path, body, timeout):
        if path == "/update_weights":
            k = len(loads)
            loads.append(body["update_info"]["names"])
            log.append(("load", k))
            if k + 2 < len(tensors):   # bucket k+1 is packed once tensor k+2 is read (the packer reads one ahead)
                assert pulled[k + 2].wait(30), f"bucket {k + 1} was not packed while bucket {k} loaded"
            log.append(("loaded", k))

    sync = MemorySync(None, BACKENDS["gloo"], bucket_bytes=32, host="127.0.0.1")
    sync.channel, sync._post = _Channel(log), post
    assert not push_all([sync], stream(), 0, timeout=60).failed
    assert loads == [[name] for name, _ in tensors]
    for (_, want), got in zip(tensors, sync.channel.sent):
        assert torch.equal(got.view(torch.float32), want)
    for k in range(1, len(tensors)):   # one update at a time: k's broadcast follows k-1's load
        assert log.index(("loaded", k - 1)) < log.index(("broadcast", k))


def test_update_info_is_vllms_message():
    metas = [Meta("model.embed_tokens.weight", torch.bfloat16, (64, 32)), Meta("x", torch.float32, ())]
    assert update_info(metas) == {"names": ["model.embed_tokens.weight", "x"], "dtype_names": ["bfloat16", "float32"],
                                  "shapes": [[64, 32], []]}
    assert metas[0].nbytes == 64 * 32 * 2 and metas[1].nbytes == 4 == math.prod(()) * 4


def test_init_info_carries_what_each_server_engine_reads():
    # vLLM's NCCLWeightTransferInitInfo fields, and our gloo engine's (server_plugin/megatron_rl_vllm_gloo.py)
    nccl = BACKENDS["nccl"].init_info("10.0.0.1", 5000, 3, 1 << 20, 60.0, None)
    assert nccl == {"master_address": "10.0.0.1", "master_port": 5000, "rank_offset": 1, "world_size": 3,
                    "packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}
    gloo = BACKENDS["gloo"].init_info("127.0.0.1", 5000, 2, 1 << 20, 60.0, "s3cret")
    assert gloo == {"master_address": "127.0.0.1", "master_port": 5000, "rank_offset": 1, "world_size": 2,
                    "timeout_s": 60.0, "store_token": "s3cret"}


def test_the_backend_follows_cuda():
    assert backend_for(cuda=True).name == "nccl" and backend_for(cuda=False).name == "gloo"
    assert weight_transfer_args(backend_for(False)) == [
        "--weight-transfer-config", '{"backend": "gloo"}',
        "--worker-extension-cls", "megatron_rl_vllm_gloo.RegistersGlooEngine"]
    assert weight_transfer_args(backend_for(True)) == ["--weight-transfer-config", '{"backend": "nccl"}']


def _transport(overrides: list[str]) -> str:
    """The trainer's transport for a config (trainer/setup.py reads it so)."""
    return WEIGHT_SYNCS.get(weight_sync(load_config(None, ["rollout.backend=vllm", *overrides]).rollout)).transport


def test_memory_is_the_default_and_picks_the_memory_transport():
    assert VllmEngine(tiny_arch(), VllmConfig(url=NOWHERE, device="cpu"), "unused").weight_sync == "memory"
    assert VllmConfig().bucket_bytes == 1 << 30
    assert weight_sync(load_config(None, ["rollout.backend=vllm"]).rollout) == "memory"
    assert _transport([]) == "memory" and _transport(["rollout.weight_sync=auto"]) == "memory"
    assert _transport(["rollout.weight_sync=reload"]) == "disk"
    assert _transport(["rollout.weight_sync=restart"]) == "disk"


@pytest.mark.parametrize("overrides,msg", [
    (["rollout.weight_sync=nccl"], r"rollout.weight_sync='nccl': rollout.backend=vllm takes memory, reload, restart"),
    (["rollout.vllm={bucket_bytes: 0}"], r"rollout.vllm.bucket_bytes must be >= 1"),
])
def test_contradictions_are_refused_at_startup(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, ["rollout.backend=vllm", *overrides])


def test_memory_with_cuda_needs_vllm_in_the_trainer(monkeypatch):
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(UnsupportedError, match=r"pip install .\[vllm\].*weight_sync=reload"):
        VllmEngine(tiny_arch(), VllmConfig(url=NOWHERE, device="cpu"), "unused")


def test_each_sync_takes_only_its_own_kind_of_weights(tmp_path):
    memory = VllmEngine(tiny_arch(), VllmConfig(url=NOWHERE, device="cpu"), str(tmp_path))
    disk = VllmEngine(tiny_arch(), VllmConfig(url=NOWHERE, device="cpu"), str(tmp_path), weight_sync="reload")
    try:
        with pytest.raises(ServingError, match="weight_sync=memory takes tensors in memory"):
            memory.load_weights_from(str(tmp_path), 0)
        with pytest.raises(ServingError, match="weight_sync=reload takes HF folders"):
            disk.update_weights([], 0)
    finally:
        memory.close()
        disk.close()


class _LaunchedServer:
    """What the engine reads of a server it launched, before any request."""

    url, model_name, can_restart, api_key, log_where = NOWHERE, "policy", True, None, "server.log"

    def stop(self, graceful=True):
        pass


def test_a_dead_server_is_not_restarted_on_random_weights(tmp_path):
    """A restart would start on the config-only folder (random weights): the engine keeps no copy
    of what it streamed, so the run stops instead (and resumes)."""
    engine = VllmEngine(tiny_arch(), VllmConfig(device="cpu"), str(tmp_path), server=_LaunchedServer(), device="cpu")
    try:
        with pytest.raises(ServingError, match="weight_sync=memory it is not restarted: the engine holds no copy"):
            engine.replicas[0].state = "ready"
            engine.fleet.lose(engine.replicas[0], 0, "died")
    finally:
        engine.close()


def test_when_every_server_of_a_pool_is_out_the_error_says_so_and_gives_the_real_ways_out(tmp_path):
    """A pool of 2 whose other server is already out: "use num_servers > 1" would be no advice."""
    engine = VllmEngine(tiny_arch(), VllmConfig(device="cpu", num_servers=2), str(tmp_path),
                        server=[_LaunchedServer(), _LaunchedServer()], device="cpu")
    try:
        engine.replicas[0].state = "ready"
        engine.replicas[1].state, engine.replicas[1].why = "failed", "restart failed: out of memory"
        with pytest.raises(ServingError) as e:
            engine.fleet.lose(engine.replicas[0], 0, "server died")
        message = str(e.value)
        assert "every vLLM server of the pool of 2 is out" in message and "restart failed: out of memory" in message
        assert "train.resume=true" in message and "rollout.weight_sync=reload" in message
        assert "num_servers" not in message
    finally:
        engine.close()
