"""Settings of the vLLM rollout backend (`rollout.vllm` in the run config).

Field names follow vLLM's own options where one exists (`tensor_parallel_size`, `dtype`,
`max_model_len`, `max_num_seqs`, `quantization`, `logprobs_mode`, `seed`, `enforce_eager`,
`gpu_memory_utilization`, `enable_return_routed_experts`), so `vllm serve --help` documents them.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field, fields
from typing import ClassVar

from megatron_rl import checks
from megatron_rl.rollout.engine import weight_sync
from megatron_rl.rollout.serving.config import ServingConfig

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
LOGPROBS_MODES = ("auto", "raw_logprobs", "processed_logprobs")
DEVICES = ("auto", "cpu", "cuda")
# vLLM's flags that carry a secret (`vllm serve --help`; the S3 ones are its model loader's) and a
# name that says it is one (--hf-token, --db-password): never on the server's command line
SECRET_FLAGS = ("api-key", "hf-token", "s3-access-key-id", "s3-secret-access-key")
_SECRET = re.compile(r"(^|-)(token|key|secret|password|passwd)$", re.IGNORECASE)
# rollout.vllm.bucket_bytes' ceiling: a tensor larger than a bucket is sent alone, so a bucket past a
# few GiB only saves HTTP round trips, while the trainer and every server worker hold one
MAX_BUCKET_BYTES = 16 << 30
ENV_API_KEY = "MEGATRON_RL_VLLM_API_KEY"  # a url server's key when api_key is unset; a launched server's middleware reads it


def _flag(arg: str) -> str:
    """`--hf_tok.x=S` -> `hf-tok`: the flag's name as vLLM's parser reads it (FlexibleArgumentParser
    takes _ for -; a value follows `=`, a field of a dict-valued flag follows `.`); "" for a value."""
    if not arg.startswith("--"):
        return ""
    return re.split(r"[=.]", arg[2:], maxsplit=1)[0].replace("_", "-").lower()


def secret_flag(arg: str) -> str | None:
    """The secret flag vLLM would read `arg` as, or None. Its parser (argparse, allow_abbrev) takes
    any unambiguous prefix of a flag for the flag, so --hf-tok, --hf_tok=S and --api-ke are
    --hf-token and --api-key; a flag whose own name says secret is one too."""
    name = _flag(arg)
    if not name:  # a value, or `--` (the end of the flags)
        return None
    known = next((flag for flag in SECRET_FLAGS if flag.startswith(name)), None)
    return known or (name if _SECRET.search(name) else None)


def _scalar(value) -> bool:
    return isinstance(value, (str, int, float, bool))


@dataclass
class VllmConfig:
    """How to run and talk to the vLLM server.

    Where the server comes from:
      url: connect to this running server (e.g. "http://127.0.0.1:8000") instead of launching
          one. It must have been started with --enable-scale-out (the requests use vLLM's
          token-in/token-out /inference/v1/generate) and VLLM_SERVER_DEV_MODE=1 (weight sync and
          pause use the development endpoints); --skip-tokenizer-init is not required. With
          --enable-prompt-tokens-details its answers carry their cached prompt tokens, and a
          multi-turn run logs rollout/prefix_cache/* (docs/diagnostics.md); without it, not. A
          connected server is never restarted by us: a crash there is an error.
      urls: a pool of running servers to connect to (e.g. one per rollout node), each as `url`
          above and all with the same key; requests spread over them (pool.py). Not with `url`.
      num_servers: how many servers to launch (a pool, pool.py), each its own process with
          `tensor_parallel_size` devices of its own: on CUDA, server k gets the k-th slice of
          tensor_parallel_size devices of CUDA_VISIBLE_DEVICES (`env`'s, else the trainer's,
          else 0..). With `urls`: 1 (the default) or len(urls).
      api_key: the key of the `url` server, sent as `Authorization: Bearer <key>` with every
          request; None = $MEGATRON_RL_VLLM_API_KEY (preferred: a key in the config file is
          copied wherever the config is), else no key. vLLM's own --api-key guards only /v1/...,
          not /collective_rpc: to guard every endpoint, start that server like the ones we
          launch, with the key in its environment and our middleware:
              PYTHONPATH=megatron_rl/rollout/vllm/server_plugin MEGATRON_RL_VLLM_API_KEY=<key> \
                  vllm serve ... --middleware megatron_rl_vllm_auth.RequireBearerKey
          A server we launch ignores this: it always gets a fresh random key of its own, passed
          in its environment (never on its command line) and refused to anyone without it.
      python: interpreter of the vLLM environment; None = $MEGATRON_RL_VLLM_PYTHON, else this
          Python when it can import vllm (pip install .[vllm]), else the repository's .venv-vllm
          (tools/install_vllm_cpu.sh creates it).
      dialect: the server kind the engine speaks to, a name in megatron_rl.rollout.serving.DIALECTS
          (rollout/registered.py): its command line, generate requests and pause / resume /
          abort calls, the rollout.weight_sync ways it takes and their receivers. "vllm" (default):
          vLLM's OpenAI-compatible server (rollout/vllm/dialect.py). A new kind is one module with
          its Dialect and one registry line (rollout/serving/); the parity probe stays vLLM's.
      device: "auto" | "cpu" | "cuda": the server's platform, which decides what is refused
          (MoE in-place reload and routed-expert capture are broken on CPU). auto = cpu when the
          vLLM environment is the vllm-cpu build; for a url server auto means unknown, treated
          as cpu (say "cuda" for a GPU server).

    vLLM engine options (passed as `--<name>`):
      tensor_parallel_size, dtype ("auto" = from rollout.dtype), max_model_len (None = the
      model's max_position_embeddings), max_num_seqs (None = rollout.max_batch_size),
      quantization (e.g. "fp8", GPU only), seed, enforce_eager, gpu_memory_utilization (GPU).
      logprobs_mode: "raw_logprobs" | "processed_logprobs" | "auto" (chosen from the rollout's
          sampling settings, see protocol.server_logprobs_mode). vLLM applies it server-wide;
          a request whose SamplingParams need the other one is refused, never answered wrongly.
      max_logprobs: vLLM --max-logprobs: top log-probs per position a request may ask for; the
          kept top-p/top-k set (SamplingParams.return_kept_ids) is read from them, so it must be
          > the largest kept set (None = min(vocab_size, 64)); a rollout.top_k set that cannot fit is
          refused at start-up, a top-p set that does not is refused at the batch.
      enable_return_routed_experts: return the routed experts of every token (router replay
          R3). GPU servers only: refused at start-up on CPU, where vLLM's capture fails.
      kv_cache_space_gb: VLLM_CPU_KVCACHE_SPACE (CPU servers).
      extra_args: more command-line arguments, appended verbatim (no flag vLLM would read as a
          secret one, `secret_flag`: --hf-token, and its spellings --hf_token, --hf-tok=...: secrets
          go in `env`, which `ps` does not show; not --api-key: the launched server's key is ours).
          env: extra environment.

    Weight sync (rollout.weight_sync picks how: memory, reload or restart; these tune it):
      A server at `url` synced in memory must run with VLLM_SERVER_DEV_MODE=1 and, without CUDA,
          the flags weight_transfer_args() gives (--weight-transfer-config '{"backend": "gloo"}'
          --worker-extension-cls megatron_rl_vllm_gloo.RegistersGlooEngine, the server_plugin
          directory on its PYTHONPATH). A launched server synced in memory starts on random
          weights (--load-format dummy) and the first sync fills it; one that dies restarts on
          random weights and serves again once the next sync has reached it; a lone one is not
          restarted (the engine holds no copy of the weights to start it on: the run stops and
          resumes). The launched server of "restart" runs without the development endpoints.
      bucket_bytes: the most bytes of one in-memory transfer (one /update_weights and one
          broadcast): the trainer's extra memory for a sync is this buffer (default 1 GiB, at
          most 16 GiB). At start-up the trainer's buffer and one per worker of the servers we
          launch must fit in half of this machine's memory.
      transfer_host: the address the server's workers reach the trainer's rendezvous at (a
          server on another host needs this host's address); it must resolve at start-up. The
          gloo rendezvous store listens on it alone, for token holders only, until the workers
          have joined.
      sync_timeout_s: the most seconds one in-memory sync may take, the trainer's export
          included (default 300). A server that has not done its part by then, or that stops
          answering /health while the sync waits on it (checked every health_interval_s), is
          dropped from the sync and restarted; the sync goes on to the others and fails, naming
          each server and why, only when none is left. Raise it for a model whose sync is
          slower (the sync's time is logged as timing/vllm_memory_sync).
      probe_every: run the parity probe after every k-th sync (0 = never).
      probe_tokens: length of the fixed probe sequence.
      probe_tolerance: max |log-prob diff| of the probe vs the reference (None = 1e-3 for
          float32 servers, 0.1 for bfloat16/float16).
      keep_weight_dirs: exported weight directories kept on disk (the newest ones).

    Client behaviour:
      max_concurrency: requests in flight at once per server (one request per sample, each a coroutine,
          no thread; generation.py).
      affinity: in a pool, send a request to the server that holds the longest known prefix of
          its tokens (a prompt's samples, a trajectory's later turns: its prefix cache has them)
          unless that server is well past the least loaded one (pool.py, serving/affinity.py); false:
          least work in flight only. Placement never changes a sample.
      request_timeout_s: one whole request, connect to last byte (a server that trickles its
          answer is hung too); a timeout counts as a hung server and triggers a restart.
      startup_timeout_s: server start until /health answers. health_timeout_s: one health check.
      health_interval_s: how often a running generate() checks that the server is alive.
      max_retries: bad responses / transient errors retried per sample before raising.
      retry_backoff_s: first backoff (doubles per retry of a sample).
      max_restarts: server restarts allowed within one generate() call, or one stretch of requests
          in flight without a break (all servers of a pool together), and per server within one
          load_weights_from() call.
      warmup: send one short request after start (vLLM compiles an op on the first log-prob
          request: ~30 s on CPU) so the first generate() is not charged for it.
    """

    # what a checkpoint's copy of the config redacts (config_to_dict): the key, and the values of env
    SECRET_FIELDS: ClassVar[tuple[str, ...]] = ("api_key",)
    SECRET_MAPPINGS: ClassVar[tuple[str, ...]] = ("env",)

    url: str | None = None
    urls: list = field(default_factory=list)
    num_servers: int = 1
    api_key: str | None = field(default=None, repr=False)
    python: str | None = None
    dialect: str = "vllm"
    device: str = "auto"
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    quantization: str | None = None
    logprobs_mode: str = "auto"
    max_logprobs: int | None = None
    seed: int = 0
    enforce_eager: bool = True
    gpu_memory_utilization: float | None = None
    enable_return_routed_experts: bool = False
    kv_cache_space_gb: int = 1
    extra_args: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    bucket_bytes: int = 1 << 30
    transfer_host: str = "127.0.0.1"
    sync_timeout_s: float = 300.0
    probe_every: int = 1
    probe_tokens: int = 16
    probe_tolerance: float | None = None
    keep_weight_dirs: int = 2
    max_concurrency: int = 64
    affinity: bool = True
    request_timeout_s: float = 600.0
    startup_timeout_s: float = 600.0
    health_timeout_s: float = 10.0
    health_interval_s: float = 5.0
    max_retries: int = 3
    retry_backoff_s: float = 0.5
    max_restarts: int = 2
    warmup: bool = True

    def __post_init__(self):
        self._check_types()
        if self.device not in DEVICES:
            raise ValueError(f"rollout.vllm.device={self.device!r}; choose one of {DEVICES}")
        if self.dtype not in VLLM_DTYPES and self.dtype not in _DTYPES:
            raise ValueError(f"rollout.vllm.dtype={self.dtype!r}; choose one of {VLLM_DTYPES}")
        self.dtype = _DTYPES.get(self.dtype, self.dtype)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"rollout.vllm.logprobs_mode={self.logprobs_mode!r}; choose one of {LOGPROBS_MODES}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"rollout.vllm.url={self.url!r} must start with http:// or https://")
        self._check_pool()
        for name in ("tensor_parallel_size", "max_concurrency", "keep_weight_dirs", "probe_tokens", "bucket_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.vllm.{name} must be >= 1, got {getattr(self, name)}")
        checks.integer("rollout.vllm.bucket_bytes", self.bucket_bytes, lo=1, hi=MAX_BUCKET_BYTES,
                       hint="16 GiB: a tensor larger than a bucket is sent alone; the default is 1 GiB")
        if self.probe_tokens < 2:
            raise ValueError("rollout.vllm.probe_tokens must be >= 2")
        for name in ("max_retries", "max_restarts", "probe_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"rollout.vllm.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("request_timeout_s", "startup_timeout_s", "health_timeout_s", "health_interval_s",
                     "sync_timeout_s"):
            checks.number(f"rollout.vllm.{name}", getattr(self, name), lo=0, lo_open=True,
                          hint="seconds; 0 is not 'no timeout', it fails every request or check")
        checks.number("rollout.vllm.retry_backoff_s", self.retry_backoff_s, lo=0)
        if self.probe_tolerance is not None:  # nan or inf would pass every probe
            checks.number("rollout.vllm.probe_tolerance", self.probe_tolerance, lo=0, lo_open=True,
                          hint="null = the dtype's default; probe_every=0 turns the probe off")
        for name in ("max_model_len", "max_num_seqs", "max_logprobs"):
            if getattr(self, name) is not None:
                checks.integer(f"rollout.vllm.{name}", getattr(self, name), lo=1, hint="or null for the default")
        if self.gpu_memory_utilization is not None:
            checks.number("rollout.vllm.gpu_memory_utilization", self.gpu_memory_utilization, lo=0, hi=1,
                          lo_open=True, hint="a fraction of the GPU's memory, e.g. 0.5")
        checks.integer("rollout.vllm.kv_cache_space_gb", self.kv_cache_space_gb, lo=1)
        checks.integer("rollout.vllm.seed", self.seed, lo=0, hi=2**32 - 1, hint="vLLM seeds numpy: 32 bits")
        self.extra_args = [str(a) for a in self.extra_args]
        for arg in self.extra_args:  # argv is visible to `ps`, written to server.log and kept in every checkpoint
            secret, given = secret_flag(arg), arg.split("=")[0]   # never the value: it is the secret
            if secret == "api-key":
                raise ValueError(f"rollout.vllm.extra_args: no --api-key ({given}; it would be visible to `ps`, and "
                                 f"a server we launch gets a random key of its own); for a url server set "
                                 f"rollout.vllm.api_key or $MEGATRON_RL_VLLM_API_KEY")
            if secret is not None:
                read_as = f" (vLLM reads it as --{secret})" if given != f"--{secret}" else ""
                raise ValueError(f"rollout.vllm.extra_args: {given} looks like a secret{read_as}; pass it in "
                                 f"rollout.vllm.env instead (e.g. HF_TOKEN for --hf-token): the environment is not "
                                 f"visible to `ps` and is redacted from the config a checkpoint keeps")
        self.env = {str(k): str(v) for k, v in self.env.items()}

    def _check_pool(self) -> None:
        checks.integer("rollout.vllm.num_servers", self.num_servers, lo=1)
        self.urls = [str(u) for u in self.urls]
        if self.urls and self.url is not None:
            raise ValueError("rollout.vllm.url and rollout.vllm.urls are both set; put every server in urls "
                             "(url is the one-server spelling of urls: [url])")
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"rollout.vllm.urls: {u!r} must start with http:// or https://")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"rollout.vllm.urls lists a server twice: {self.urls}")
        if self.server_urls and self.num_servers not in (1, len(self.server_urls)):
            raise ValueError(f"rollout.vllm.num_servers={self.num_servers} with {len(self.server_urls)} server URLs "
                             f"(rollout.vllm.url/urls): servers at URLs are not launched; drop num_servers or make "
                             f"it len(urls)")

    def check_on_this_machine(self, rollout) -> None:
        """What the in-memory sync needs of the machine the trainer starts on (the entry point's
        start-up checks: RunConfig.check_paths calls it under rollout.backend=vllm with the rollout
        section): transfer_host resolves, and the buffers of bucket_bytes (the trainer's, and one
        per worker of each server we launch, on this machine) fit in half of its memory. Raises
        ValueError naming the field; a disk sync (rollout.weight_sync=reload|restart) needs neither."""
        if weight_sync(rollout) != "memory":
            return
        try:
            socket.getaddrinfo(self.transfer_host, None)
        except (socket.gaierror, UnicodeError) as e:
            why = e.strerror if isinstance(e, socket.gaierror) and e.strerror else str(e)
            raise ValueError(f"rollout.vllm.transfer_host={self.transfer_host!r} does not resolve on this machine "
                             f"({why}); set it to this host's name or address as the servers reach it (127.0.0.1 "
                             f"for servers on this machine)") from None
        workers = 0 if self.server_urls else self.num_servers * self.tensor_parallel_size
        need, have = (1 + workers) * self.bucket_bytes, machine_memory_bytes()
        if have and need > have // 2:
            raise ValueError(f"rollout.vllm.bucket_bytes={self.bucket_bytes} ({_gib(self.bucket_bytes)}): the trainer "
                             f"and {workers} launched server worker(s) would each hold a buffer of it, "
                             f"{_gib(need)} of this machine's {_gib(have)}, more than half; lower it (the default "
                             f"1 GiB is enough: a sync's round trips grow only as model bytes / bucket_bytes)")

    @property
    def server_urls(self) -> list[str]:
        """The servers to connect to ([] = launch num_servers of them)."""
        return list(self.urls) or ([self.url] if self.url else [])

    @property
    def pool_size(self) -> int:
        return len(self.server_urls) or self.num_servers

    def _check_types(self) -> None:
        """Each field holds its annotated type (an int field no text, `env` and `extra_args` only
        scalars), so a bad value is named here, not met as a TypeError deep in the launcher."""
        for spec in fields(self):
            value, where = getattr(self, spec.name), f"rollout.vllm.{spec.name}"
            kinds = str(spec.type).replace(" ", "").split("|")
            if value is None and "None" in kinds:
                continue
            if "float" in kinds and isinstance(value, str):  # YAML reads 1e-3 (no dot) as text, as the loader knows
                try:
                    value = float(value)
                    setattr(self, spec.name, value)
                except ValueError:
                    pass  # checks.number names it
            if "bool" in kinds:
                checks.boolean(where, value)
            elif "int" in kinds:
                checks.integer(where, value)
            elif "float" in kinds:
                checks.number(where, value)
            elif "str" in kinds and not isinstance(value, str):
                raise ValueError(f"{where}={value!r}: must be a string")
            elif "list" in kinds and not (isinstance(value, list) and all(map(_scalar, value))):
                raise ValueError(f"{where}={value!r}: must be a list of command-line arguments, e.g. "
                                 f"[--max-num-batched-tokens, 4096]")
            elif "dict" in kinds and not (isinstance(value, dict) and all(map(_scalar, value.values()))):
                raise ValueError(f"{where}={value!r}: must be a mapping of names to values, e.g. "
                                 f"{{HF_TOKEN: ...}}")

    def serving(self) -> ServingConfig:
        """What the serving layer reads of this section (serving/config.py): the servers, their
        health, restarts, requests, weight folders and parity probe; the probe's tolerance resolved
        for `dtype`, the key of a url server from api_key or $MEGATRON_RL_VLLM_API_KEY."""
        return ServingConfig(
            section="rollout.vllm", urls=tuple(self.server_urls), api_key=self.api_key or os.environ.get(ENV_API_KEY) or None,
            num_servers=self.num_servers, dtype=self.dtype, routed_experts=self.enable_return_routed_experts,
            warmup=self.warmup, startup_timeout_s=self.startup_timeout_s, health_timeout_s=self.health_timeout_s,
            health_interval_s=self.health_interval_s, request_timeout_s=self.request_timeout_s,
            sync_timeout_s=self.sync_timeout_s, max_concurrency=self.max_concurrency, max_retries=self.max_retries,
            retry_backoff_s=self.retry_backoff_s, max_restarts=self.max_restarts,
            keep_weight_dirs=self.keep_weight_dirs, probe_every=self.probe_every, probe_tokens=self.probe_tokens,
            probe_tolerance=self.tolerance(self.dtype))

    def resolved_dtype(self, rollout_dtype: str | None) -> str:
        """The vLLM --dtype: this field, or rollout.dtype's vLLM name when it is "auto"."""
        if self.dtype != "auto" or rollout_dtype is None:
            return self.dtype
        return _DTYPES.get(rollout_dtype, rollout_dtype)

    def tolerance(self, vllm_dtype: str) -> float:
        if self.probe_tolerance is not None:
            return self.probe_tolerance
        return 1e-3 if vllm_dtype == "float32" else 0.1


def machine_memory_bytes() -> int:
    """This machine's memory as the trainer's process may use it: the physical memory, or the
    cgroup's limit where one is set lower; 0 when unknown."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and (not total or int(text) < total):
            total = int(text)
    return total


def _gib(n: int) -> str:
    return f"{n / (1 << 30):g} GiB"
