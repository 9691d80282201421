"""The embedded engine's running batch: sequences that join at decode-step boundaries and leave as
they finish (continuous batching), and the inbox a serving engine takes requests from.

    d = Decoding(engine, sampling)            # one sampling class: SamplingParams equal but for
    d.join(requests)                          #   max_tokens and seed (class_of)
    while d.running():
        for s in d.step(k): deliver(d.sample(s))      # k: the step count, for the pause gate
        d.join(more)                                  # prefilled, merged into the batch

A join prefills the new requests' distinct prompts (left padded, attention mask, explicit position
ids; each distinct (stream prompt index, prompt) once), expands the KV cache to one row per
sequence and, when a batch runs, pads the narrower of the two caches on the left (masked
positions) and stacks them: the running rows' keys and values are kept, never recomputed. Each
sequence draws from its own stream (stream_seed(its seed, i, j)) at its own position and stops at
its own max_tokens, so its tokens depend on (weights, prompt, its sampling, stream), not on when it
joined (its numbers move by the batch-shape noise of the kernels: fp32 ~1e-6, module docstring of
embedded.py). A batch whose requests all join at once is decoded exactly as before continuous
batching (the same kernels on the same shapes, bit for bit). A serving batch (trim=True) also drops
the leading positions every running row has masked once rows leave, so a batch that never drains
does not grow wider than its rows need.

Partial rollouts: at a step boundary parked for new weights, every running row's prompt and tokens
so far are prefilled again with the new weights (a fresh KV cache), as embedded.py describes; the
tokens after it carry the new version.

Cost: per step, one forward of the running rows (at most max_batch_size) over their cache; a join,
one prefill of its distinct prompts and a copy of the running cache (O(rows x width x layers));
per sequence, O(max_tokens) host memory for its tokens, log-probs, versions, kept sets, routes.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from megatron_rl.rollout.sampling import sample_step, stream_uniforms
from megatron_rl.rollout.types import Request, Sample, SamplingParams


def class_of(sampling: SamplingParams) -> SamplingParams:
    """The settings sequences of one batch share: all but max_tokens and seed (each row has its own)."""
    return dataclasses.replace(sampling, max_tokens=1, seed=0)


def _grow(t: torch.Tensor, rows: int, cols: int, fill) -> torch.Tensor:
    """t [N, C, ...] padded with `fill` to [N + rows, max(C, cols), ...]."""
    out = torch.full((t.shape[0] + rows, max(t.shape[1], cols), *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
    out[:t.shape[0], :t.shape[1]] = t
    return out


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    pad = width - t.shape[dim]
    if pad == 0:
        return t
    spec = [0, 0] * (t.dim() - 1 - dim) + [pad, 0]
    return F.pad(t, spec)


def merge_caches(a, b, width: int) -> None:
    """Stack cache b's rows under cache a's (in place in a), both left-padded to `width` positions."""
    for la, lb in zip(a.layers, b.layers, strict=True):
        if not (hasattr(la, "keys") and hasattr(lb, "keys")) or getattr(la, "is_sliding", False):
            raise TypeError(f"cannot join rows into a {type(la).__name__} cache")
        la.keys = torch.cat([_pad_left(la.keys, width, 2), _pad_left(lb.keys, width, 2)])
        la.values = torch.cat([_pad_left(la.values, width, 2), _pad_left(lb.values, width, 2)])


class Decoding:
    """One running batch of `engine` (an EmbeddedEngine) for sampling class `sampling` (module
    docstring). Sequence s is the s-th request joined; `alive` holds the running ones' indices."""

    def __init__(self, engine, sampling: SamplingParams, trim: bool = False):
        self.engine, self.sampling, self.trim = engine, class_of(sampling), trim
        dev = engine.device
        self.dev = dev
        self.requests: list[Request] = []
        self.uniforms = torch.empty(0, 0, dtype=torch.float64, device=dev)
        self.tokens = torch.empty(0, 0, dtype=torch.long, device=dev)
        self.logprobs = torch.empty(0, 0, dtype=torch.float32, device=dev)
        self.versions = torch.empty(0, 0, dtype=torch.int32, device=dev)
        self.length = torch.empty(0, dtype=torch.long, device=dev)
        self.stopped = torch.empty(0, dtype=torch.bool, device=dev)
        self.max_tokens = torch.empty(0, dtype=torch.long, device=dev)
        self.routes: torch.Tensor | None = None  # [N, T, L, k]: the route of each sampled position
        self.prompt_routes: list[torch.Tensor | None] = []  # [P, L, k] per sequence
        self.kept: list[list[torch.Tensor]] = []  # per sequence, per step: the kept ids
        self.stops = torch.tensor(sorted(set(sampling.stop_token_ids)), dtype=torch.long, device=dev)
        self.alive = torch.empty(0, dtype=torch.long, device=dev)
        self.cache = self.mask = self.next_pos = self.logits = None
        self.version = engine.policy_version  # of the weights that computed `logits`

    def running(self) -> bool:
        return len(self.alive) > 0

    def room(self) -> int:
        return self.engine.max_batch_size - len(self.alive)

    # ---- joining ------------------------------------------------------------------------------
    @torch.no_grad()
    def join(self, requests: Sequence[Request]) -> None:
        """Prefill `requests` (all of this batch's class) and add them to the running rows."""
        if not requests:
            return
        from transformers import DynamicCache

        e, dev = self.engine, self.dev
        first, num = len(self.requests), len(requests)
        steps = max(r.sampling.max_tokens for r in requests)
        uniforms = torch.zeros(num, steps, dtype=torch.float64)  # host: the streams are CPU generators; copied below
        for s, r in enumerate(requests):
            uniforms[s, :r.sampling.max_tokens] = stream_uniforms(r.sampling.seed, [r.stream], r.sampling.max_tokens)[0]
        self.uniforms = _grow(self.uniforms, num, steps, 0.0)
        self.uniforms[first:, :steps] = uniforms.to(dev)
        self.tokens = _grow(self.tokens, num, steps, -1)
        self.logprobs = _grow(self.logprobs, num, steps, 0.0)
        self.versions = _grow(self.versions, num, steps, self.version)
        self.versions[first:] = self.version
        zeros = torch.zeros(num, dtype=torch.long, device=dev)
        self.length = torch.cat([self.length, zeros])
        self.stopped = torch.cat([self.stopped, zeros.bool()])
        self.max_tokens = torch.cat([self.max_tokens, torch.tensor([r.sampling.max_tokens for r in requests], device=dev)])
        self.requests += list(requests)
        self.kept += [[] for _ in requests]

        # each distinct prompt prefilled once, in order of its stream's prompt index
        uniq = sorted({(r.stream[0], r.prompt_ids) for r in requests})
        cache = DynamicCache(config=e.model.config)
        logits, mask, prompt_routes = e._prefill([list(p) for _, p in uniq], cache)
        width = mask.shape[1]
        row_of = {u: k for k, u in enumerate(uniq)}
        prefill_row = [row_of[(r.stream[0], r.prompt_ids)] for r in requests]
        rows = torch.tensor(prefill_row, device=dev)
        cache.batch_select_indices(rows)
        mask, logits = mask[rows], logits[rows]
        if prompt_routes is not None:
            for r, row in zip(requests, prefill_row):
                self.prompt_routes.append(prompt_routes[row, width - len(r.prompt_ids):].cpu())
            routes = torch.zeros(num, steps, *prompt_routes.shape[2:], dtype=torch.int16, device=dev)
            self.routes = routes if self.routes is None else torch.cat([_grow(self.routes, 0, steps, 0),
                                                                        _grow(routes, 0, self.routes.shape[1], 0)])
        else:
            self.prompt_routes += [None] * num
        new = torch.arange(first, first + num, device=dev)
        if not self.running():
            self.cache, self.mask, self.logits, self.alive = cache, mask, logits, new
            self.next_pos = mask.sum(-1)
            return
        wide = max(self.mask.shape[1], width)
        merge_caches(self.cache, cache, wide)
        self.mask = torch.cat([_pad_left(self.mask, wide, 1), _pad_left(mask, wide, 1)])
        self.next_pos = torch.cat([self.next_pos, mask.sum(-1)])
        self.logits = torch.cat([self.logits, logits])
        self.alive = torch.cat([self.alive, new])

    # ---- one step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, k: int) -> list[int]:
        """Sample one token for every running row, then forward the rows that go on (through the
        pause gate at boundary k). -> the sequences that finished (a stop token or their max_tokens)."""
        e, alive = self.engine, self.alive
        t = self.length[alive]
        tok, lp, keep = sample_step(self.logits, self.uniforms[alive, t], self.sampling)
        self.tokens[alive, t], self.logprobs[alive, t] = tok, lp
        self.versions[alive, t] = self.version
        self.length[alive] = t + 1
        if self.sampling.return_kept_ids:
            keep = keep.cpu()
            for row, s in enumerate(alive.tolist()):
                self.kept[s].append(keep[row].nonzero().squeeze(-1))
        hit = torch.isin(tok, self.stops)
        self.stopped[alive] = hit
        go = ~hit & (t + 1 < self.max_tokens[alive])
        finished = alive[~go].tolist()
        if not bool(go.any()):
            self.alive = alive[:0]
            self.cache = self.mask = self.next_pos = self.logits = None
            return finished
        if not bool(go.all()):
            idx = go.nonzero().squeeze(-1)
            self.cache.batch_select_indices(idx)
            alive, tok, t = alive[idx], tok[idx], t[idx]
            self.mask, self.next_pos = self.mask[idx], self.next_pos[idx]
            if self.trim:
                self._trim()
        self.alive = alive
        if e.gate.boundary(k) and e.policy_version != self.version:  # new weights while parked
            from transformers import DynamicCache

            self.version = e.policy_version
            self.cache = DynamicCache(config=e.model.config)
            rows_ids = [list(self.requests[s].prompt_ids) + self.tokens[s, :int(self.length[s])].tolist()
                        for s in alive.tolist()]
            self.logits, self.mask, new_routes = e._prefill(rows_ids, self.cache)
            self.next_pos = self.mask.sum(-1)
            if self.routes is not None:  # the one position no earlier forward processed: the last token's
                self.routes[alive, t] = new_routes[:, -1]
            return finished
        self.mask = torch.cat([self.mask, torch.ones(len(alive), 1, dtype=self.mask.dtype, device=self.dev)], dim=-1)
        self.logits = e._forward(tok[:, None], self.mask, self.next_pos[:, None], self.cache)
        self.next_pos = self.next_pos + 1
        if self.routes is not None:
            self.routes[alive, t] = e._take_routes(len(alive))[:, 0]
        return finished

    def _trim(self) -> None:
        """Drop the leading cache positions every running row has masked (the padding of rows that
        left): a batch that keeps taking requests never grows wider than its rows need."""
        lead = int((self.mask.sum(0) == 0).int().cumprod(0).sum())
        if lead:
            self.mask = self.mask[:, lead:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]

    # ---- results ------------------------------------------------------------------------------
    def sample(self, s: int) -> Sample:
        """Finished sequence s as a Sample (host tensors: samples are broadcast to every rank)."""
        r, req = int(self.length[s]), self.requests[s]
        versions = self.versions[s, :r].cpu()
        routed = None
        if self.routes is not None:
            routed = torch.cat([self.prompt_routes[s], self.routes[s, :r - 1].cpu()])
        kept = None
        if self.sampling.return_kept_ids:
            ids = self.kept[s]
            width = max(len(x) for x in ids)
            kept = torch.full((len(ids), width), -1, dtype=torch.long)
            for k, x in enumerate(ids):
                kept[k, :len(x)] = x
        mixed = versions.clone() if bool((versions != versions[0]).any()) else None
        return Sample(prompt_ids=torch.tensor(req.prompt_ids, dtype=torch.long),
                      response_ids=self.tokens[s, :r].cpu().clone(), rollout_logprobs=self.logprobs[s, :r].cpu().clone(),
                      finish_reason="stop" if bool(self.stopped[s]) else "length", policy_version=int(versions[0]),
                      prompt_index=req.stream[0], sample_index=req.stream[1], routed_experts=routed, kept_ids=kept,
                      token_versions=mixed)


class Inbox:
    """Requests handed to a serving engine (EmbeddedEngine.serve) from another thread: each with the
    function that delivers its Sample, or the exception its batch ended with."""

    def __init__(self):
        self._cond = threading.Condition()
        self._items: list[tuple[Request, Callable]] = []
        self._closed = False

    def put(self, items: Sequence[tuple[Request, Callable]]) -> None:
        with self._cond:
            self._items += list(items)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take(self, block: bool) -> list[tuple[Request, Callable]] | None:
        """Everything put so far ([] when none and not block); None once closed and empty."""
        with self._cond:
            if block:
                self._cond.wait_for(lambda: self._items or self._closed)
            items, self._items = self._items, []
            return None if not items and self._closed else items

