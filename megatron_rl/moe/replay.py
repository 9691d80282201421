"""MoE router replay (R2 / R3) on top of megatron-core's `RouterReplay` (docs/router_replay.md).

megatron-core 0.16.1 gives every `TopKRouter` a `RouterReplay` instance when
`moe_enable_routing_replay=True` (`BuildOptions(routing_replay=True)`). Its top-k goes through
`RouterReplay.get_replay_topk`, which by action

- RECORD: computes the top-k and keeps the indices (`get_recorded_indices`);
- REPLAY_FORWARD: uses `target_topk_idx` (the last `set_target_indices`) and gathers the current
  router scores at those experts, so the gate weights keep their gradient;
- REPLAY_BACKWARD: pops the *oldest* entry of `replay_backward_list`, a FIFO that every
  `set_target_indices` appends to (activation recomputation re-runs the router in backward).

`RouterReplayController` drives those per-layer instances (the ones held by *this* model's
routers, not megatron's process-global list) through megatron's schedules, one micro-batch at a
time. The trainer wraps its Megatron-LM style `forward_step`:

    replay = RouterReplayController(model)                 # refuses configs where replay can't apply
    step = replay.wrap_forward_step(forward_step)
    with replay.record() as recorded:                      # R2: the π_old pass
        forward_backward(model, step, data, M, ..., forward_only=True)
    # recorded: list of M MicroBatchRouting, in micro-batch order
    with replay.replay(micro_batches_for(recorded, slices, mbs), probe=True) as session:  # one update
        forward_backward(model, step, data_of(slices), len(slices), ...)
    sums = session.agreement_sums("route_agree_old_new")

R3 builds the replayed routing from the engine's with megatron_rl.moe.plumbing instead.

How micro-batches line up: the wrapped step takes the next queued `MicroBatchRouting` before each
micro-batch's forward, sets it on every layer (REPLAY_FORWARD) and, when this forward will be
recomputed in backward, leaves it in the layer's FIFO and hooks the step's output tensor so that
the action turns to REPLAY_BACKWARD as soon as this micro-batch's backward starts; the next
forward turns it back. Every stage runs its forwards in micro-batch order and (no pipelining, or
1F1B) its backwards in the same order, so the FIFO pops the right micro-batch. Entries that no
backward will pop (no recomputation, forward-only passes) are removed right after the forward.
Interleaved (virtual) pipelines are refused.

Limitations of megatron-core 0.16.1 (not patched here): the aux / sequence / global load-balancing
losses compute their own top-k from the router logits (`compute_routing_scores_for_aux_loss`), so
they see the live selection, not the replayed one; `moe_router_fusion` bypasses the replay hook.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class MicroBatchRouting:
    """Top-k experts of one micro-batch on this rank, for each of this stage's MoE layers.

    indices: one `[local_tokens, topk]` int64 tensor per local MoE layer (stage order), tokens in
        megatron's local order (sequence-first `[s, b]` flattened, after CP / SP sharding).
    mask: `[local_tokens]` bool, the tokens that count in agreement metrics (None = all of them).
    turns: `[local_tokens]` int64 policy turn of each token (-1: none), or None; when given, the
        probe also counts agreement by turn (moe/metrics.py: turn_counts).
    """

    indices: list[Tensor]
    mask: Tensor | None = None
    turns: Tensor | None = None

    def with_mask(self, mask: Tensor | None) -> MicroBatchRouting:
        return MicroBatchRouting(self.indices, mask, self.turns)

    def with_turns(self, turns: Tensor | None) -> MicroBatchRouting:
        return MicroBatchRouting(self.indices, self.mask, turns)


# ----------------------------------------------------------------------------- configuration


def _balancing_types(config) -> list[str]:
    t = config.moe_router_load_balancing_type
    return list(t) if isinstance(t, list | tuple) else [t]


def check_replay_config(config) -> None:
    """Raise ValueError when router replay would silently not apply (or is not enabled).

    config: megatron `TransformerConfig` of the model.
    """
    if not config.num_moe_experts:
        raise ValueError("router replay needs a MoE model (TransformerConfig.num_moe_experts is unset)")
    if not config.moe_enable_routing_replay:
        raise ValueError("router replay is off in the model: build it with BuildOptions(routing_replay=True) "
                         "(TransformerConfig.moe_enable_routing_replay=True)")
    if config.moe_router_fusion:
        raise ValueError("moe_router_fusion=True computes the top-k in a fused kernel that bypasses "
                         "RouterReplay, so replay would silently not apply; set moe_router_fusion=False")
    if config.moe_expert_capacity_factor is not None:
        raise ValueError(f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} drops tokens after "
                         "the top-k, so replayed tokens could still be dropped; set "
                         "moe_expert_capacity_factor=None (no token dropping) under router replay")
    if "sinkhorn" in _balancing_types(config):
        raise ValueError("moe_router_load_balancing_type='sinkhorn' routes without the top-k that "
                         "RouterReplay hooks; use 'aux_loss', 'seq_aux_loss', 'global_aux_loss' or 'none'")
    if config.moe_router_force_load_balancing:
        raise ValueError("moe_router_force_load_balancing=True replaces the router logits with random ones "
                         "(benchmarking only); turn it off under router replay")
    if config.virtual_pipeline_model_parallel_size:
        raise ValueError("router replay supports non-interleaved schedules only; unset "
                         "virtual_pipeline_model_parallel_size")
    if config.mtp_num_layers:
        raise ValueError("router replay does not cover multi-token-prediction layers; unset mtp_num_layers")


def backward_replay_modes(config) -> tuple[bool, bool]:
    """(full, selective): whether activation recomputation re-runs the router in backward.

    full: `recompute_granularity='full'` (whole layers, only while the model is in training mode);
    selective: `recompute_granularity='selective'` with "moe" in `recompute_modules`.
    """
    full = config.recompute_granularity == "full"
    selective = config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or [])
    return full, selective


def moe_layer_pattern(config) -> list[int]:
    """1 for a MoE layer, 0 for a dense one, for every layer of the whole model (megatron's rule)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    if isinstance(freq, list | tuple):
        return [int(bool(v)) for v in freq]
    raise ValueError(f"unsupported moe_layer_freq {freq!r}: give an int or a list")


def moe_routers(model) -> list[torch.nn.Module]:
    """The `TopKRouter` modules of `model` (wrapped or not), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


# ----------------------------------------------------------------------------- controller


class ReplaySession:
    """What one `replay()` context observed: per-local-layer agreement counts of the probe, and
    with `by_turn` (the replayed routing carries turns) the same by policy turn, over all layers."""

    def __init__(self, num_layers: int, layer_ids: Sequence[int], num_moe_layers: int, by_turn: bool = False):
        self._agree: list[Tensor | int] = [0] * num_layers  # device tensors: no host sync per forward
        self._total: list[Tensor | int] = [0] * num_layers
        self._turn_agree: Tensor | int = 0
        self._turn_total: Tensor | int = 0
        self.layer_ids = tuple(layer_ids)
        self.num_moe_layers = num_moe_layers
        self.by_turn = by_turn
        self.micro_batches = 0

    def add(self, layer: int, agree: Tensor, total: Tensor) -> None:
        self._agree[layer] = self._agree[layer] + agree
        self._total[layer] = self._total[layer] + total

    def add_turns(self, agree: Tensor, total: Tensor) -> None:
        self._turn_agree = self._turn_agree + agree
        self._turn_total = self._turn_total + total

    def agreement_sums(self, name: str) -> dict[str, Tensor]:
        """Ratios `moe/<name>...` (see megatron_rl.moe.metrics) of replayed vs live top-k, on the
        device the probe counted on (no host sync)."""
        from megatron_rl.moe.metrics import layer_agreement_sums

        counted = [v for v in (*self._agree, *self._total) if torch.is_tensor(v)]
        device = counted[0].device if counted else torch.device("cpu")

        def stacked(values):
            return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values]) \
                if values else torch.zeros(0, dtype=torch.float64, device=device)

        out = layer_agreement_sums(stacked(self._agree), stacked(self._total), self.layer_ids,
                                   self.num_moe_layers, name)
        if self.by_turn:  # keys on every rank, counts or not (a stage may have no MoE layer)
            from megatron_rl.metrics.mismatch import TURN_BUCKETS
            from megatron_rl.moe.metrics import turn_agreement_sums

            zero = torch.zeros(TURN_BUCKETS, dtype=torch.float64, device=device)  # where the counts are
            agree, total = (v if torch.is_tensor(v) else zero for v in (self._turn_agree, self._turn_total))
            out.update(turn_agreement_sums(agree, total, name))
        return out


class RouterReplayController:
    """Record / replay the top-k of every MoE router of `model` (this rank's pipeline stage).

    model: the (possibly DDP / Float16Module wrapped) GPTModel chunk of this rank.
    Attributes: layer_ids (index among all MoE layers of the model of each local router, in the
    order of `MicroBatchRouting.indices`), num_moe_layers (in the whole model), topk, num_experts.
    """

    def __init__(self, model):
        if isinstance(model, list | tuple):
            if len(model) != 1:
                raise ValueError("router replay supports one model chunk per rank (no virtual pipeline)")
            model = model[0]
        routers = moe_routers(model)
        if not routers:
            raise ValueError("router replay needs a MoE model: no TopKRouter found in the model")
        config = routers[0].config
        check_replay_config(config)
        self.config = config
        self._routers = routers
        self._replays = [r.router_replay for r in routers]
        if any(rr is None for rr in self._replays):
            raise ValueError("a router of the model has no RouterReplay instance; build the model with "
                             "BuildOptions(routing_replay=True)")
        pattern = moe_layer_pattern(config)
        self.num_moe_layers = sum(pattern)
        # router.layer_number is the 1-based global layer number (pipeline offset included)
        self.layer_ids = tuple(sum(pattern[: r.layer_number - 1]) for r in routers)
        self.topk = config.moe_router_topk
        self.num_experts = config.num_moe_experts
        # recorded indices are kept compact (a step's worth of them lives until the last update)
        self._record_dtype = torch.int16 if self.num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self._mode: str | None = None
        self._queue: list[MicroBatchRouting] = []
        self._recorded: list[MicroBatchRouting] = []
        self._session: ReplaySession | None = None
        self._current: MicroBatchRouting | None = None
        self._hooks: list = []
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._actions = RouterReplayAction

    # ---- state

    @property
    def num_local_layers(self) -> int:
        return len(self._replays)

    def _set_action(self, action) -> None:
        for rr in self._replays:
            rr.set_router_replay_action(action)

    def clear(self) -> None:
        """Drop indices and actions on every layer (between steps, after a failed pass)."""
        for rr in self._replays:
            rr.clear_indices()
            rr.clear_router_replay_action()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._mode, self._queue, self._current, self._session = None, [], None, None

    @staticmethod
    def forget_global_instances() -> None:
        """Empty megatron's process-global list of RouterReplay instances.

        Call before building a new model in the same process (it only grows otherwise). Existing
        controllers keep working: they hold their model's instances, not the global list.
        """
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()

    # ---- contexts

    @contextlib.contextmanager
    def record(self) -> Iterator[list[MicroBatchRouting]]:
        """Record each micro-batch's top-k during the passes run inside (RECORD action).

        Yields the list that receives one `MicroBatchRouting` per forward of the wrapped step,
        in order (the live routing, on this rank and stage only; int16 indices on the model's
        device, mask None).
        """
        self._enter("record")
        recorded: list[MicroBatchRouting] = []
        self._recorded = recorded
        self._set_action(self._actions.RECORD)
        try:
            yield recorded
        finally:
            self.clear()

    @contextlib.contextmanager
    def replay(self, routing: Sequence[MicroBatchRouting], probe: bool = False) -> Iterator[ReplaySession]:
        """Replay `routing[i]` in the i-th forward of the wrapped step run inside.

        probe: also compute, per layer, how often the router's own top-k (current weights, replayed
        history) equals the replayed one, on `MicroBatchRouting.mask` tokens (costs one extra gate
        matmul and top-k per layer, under no_grad). Read it from the yielded `ReplaySession`.
        Raises on exit when fewer forwards ran than micro-batches were given.
        """
        routing = [self._checked(mb, i) for i, mb in enumerate(routing)]  # int64 only at each forward
        self._enter("replay")
        self._queue = list(routing)
        session = ReplaySession(self.num_local_layers, self.layer_ids, self.num_moe_layers,
                                by_turn=any(mb.turns is not None for mb in routing))
        self._session = session
        self._hooks = [r.register_forward_pre_hook(self._check_tokens_hook(i)) for i, r in enumerate(self._routers)]
        if probe:
            self._hooks += [r.register_forward_hook(self._probe_hook(i)) for i, r in enumerate(self._routers)]
        ok = False
        try:
            yield session
            ok = True
        finally:
            left = len(self._queue)
            self.clear()
        if ok and left:
            raise ValueError(f"router replay got {len(routing)} micro-batches but only {len(routing) - left} "
                             "forwards ran; give one MicroBatchRouting per micro-batch of the pass")

    def _enter(self, mode: str) -> None:
        if self._mode is not None:
            raise RuntimeError(f"router replay: cannot start {mode} inside {self._mode}")
        self.clear()
        self._mode = mode

    def _checked(self, mb: MicroBatchRouting, i: int) -> MicroBatchRouting:
        if len(mb.indices) != self.num_local_layers:
            raise ValueError(f"micro-batch {i}: {len(mb.indices)} replay tensors for {self.num_local_layers} "
                             f"local MoE layers (MoE layer ids {self.layer_ids})")
        for layer, idx in enumerate(mb.indices):
            if idx.dim() != 2 or idx.shape[1] != self.topk or idx.is_floating_point():
                raise ValueError(f"micro-batch {i}, local layer {layer}: replay indices must be integer "
                                 f"[tokens, topk={self.topk}], got {idx.dtype} {tuple(idx.shape)}")
        return mb

    # ---- the wrapped forward step

    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        """A forward_step for megatron's schedules that records / replays around `forward_step`.

        Outside `record()` / `replay()` it calls `forward_step` unchanged.
        """

        def wrapped(data_iterator, model, *args):
            if self._mode == "record":
                return self._record_step(forward_step, data_iterator, model, *args)
            if self._mode == "replay":
                return self._replay_step(forward_step, data_iterator, model, *args)
            return forward_step(data_iterator, model, *args)

        return wrapped

    def _record_step(self, forward_step, data_iterator, model, *args):
        for rr in self._replays:
            rr.clear_indices()
        out = forward_step(data_iterator, model, *args)
        got = [rr.get_recorded_indices() for rr in self._replays]
        missing = [self.layer_ids[i] for i, g in enumerate(got) if g is None]
        if missing:
            raise RuntimeError(f"router replay: MoE layers {missing} recorded nothing in this forward")
        self._recorded.append(MicroBatchRouting([g.detach().to(self._record_dtype) for g in got]))
        return out

    def _replay_step(self, forward_step, data_iterator, model, *args):
        actions = self._actions
        if not self._queue:
            raise ValueError("router replay: more forwards than replayed micro-batches")
        mb = self._queue.pop(0)
        self._current = mb
        for rr, router, idx in zip(self._replays, self._routers, mb.indices, strict=True):
            # on the router's device (R3's engine routing is built on the host); also appends to the
            # layer's backward FIFO
            rr.set_target_indices(idx.to(router.weight.device, torch.long, non_blocking=True))
        self._set_action(actions.REPLAY_FORWARD)
        out = forward_step(data_iterator, model, *args)
        output = out[0] if isinstance(out, tuple) else out
        full, selective = backward_replay_modes(self.config)  # read per step: configs can be toggled
        recompute = torch.is_tensor(output) and output.requires_grad and (selective or (full and model.training))
        if recompute:
            def to_backward(grad, replays=self._replays):
                for rr in replays:
                    rr.set_router_replay_action(actions.REPLAY_BACKWARD)
                return grad

            output.register_hook(to_backward)
        else:  # no backward will pop this micro-batch's entry
            for rr in self._replays:
                rr.replay_backward_list.pop()
        if self._session is not None:
            self._session.micro_batches += 1
        return out

    # ---- router hooks (active inside replay())

    def _check_tokens_hook(self, layer: int):
        def hook(module, args):
            rr = self._replays[layer]
            if rr.router_replay_action is not self._actions.REPLAY_FORWARD:
                return
            tokens = args[0].shape[0] * args[0].shape[1]
            if rr.target_topk_idx.shape[0] != tokens:
                raise ValueError(f"router replay: MoE layer {self.layer_ids[layer]} sees {tokens} local tokens "
                                 f"but the replayed indices have {rr.target_topk_idx.shape[0]} rows; build them "
                                 "with megatron_rl.moe.plumbing for this rank's layout")

        return hook

    def _probe_hook(self, layer: int):
        def hook(module, args, output):
            rr = self._replays[layer]
            if rr.router_replay_action is not self._actions.REPLAY_FORWARD:
                return  # recomputation in backward: already counted
            live = live_routing_map(module, args[0])
            same = (live == output[1]).all(dim=-1)
            mask = self._current.mask if self._current is not None else None
            if self._current is not None and self._current.turns is not None:
                from megatron_rl.moe.metrics import turn_counts

                self._session.add_turns(*turn_counts(same, mask, self._current.turns))
            if mask is not None:
                mask = mask.to(same.device, non_blocking=True)
                same = same & mask
                total = mask.sum()
            else:
                total = same.numel()
            self._session.add(layer, same.sum(), total)

        return hook


def micro_batches_for(recorded: Sequence[MicroBatchRouting], slices: Sequence[slice],
                      micro_batch_size: int) -> list[MicroBatchRouting]:
    """The entries of `recorded` (one per micro-batch of `micro_batch_size` rows, from row 0, as
    the π_old pass runs them) for the micro-batch row `slices` of an update pass.

    The update micro-batches must be the same rows as recorded ones (the token layout [s, b]
    depends on which rows share a micro-batch).
    """
    out = []
    for sl in slices:
        start, stop = sl.start or 0, sl.stop
        if start % micro_batch_size or stop - start != micro_batch_size:
            raise ValueError(f"rows {start}:{stop} are not one recorded micro-batch of {micro_batch_size} rows; "
                             "record and replay with the same micro_batch_size and row order")
        if start // micro_batch_size >= len(recorded):
            raise ValueError(f"rows {start}:{stop} lie past the {len(recorded)} recorded micro-batches")
        out.append(recorded[start // micro_batch_size])
    return out


@torch.no_grad()
def live_routing_map(router, hidden: Tensor) -> Tensor:
    """`[tokens, num_experts]` bool: the experts `router` (a TopKRouter) picks on its own for `hidden`.

    Calls megatron's `topk_routing_with_score_function` without the replay hook (no jitter, no
    token dropping: replay refuses capacity factors).
    """
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    cfg = router.config
    logits = router.gating(hidden).view(-1, cfg.num_moe_experts)
    _, routing_map = topk_routing_with_score_function(
        logits, router.topk, use_pre_softmax=cfg.moe_router_pre_softmax, num_groups=cfg.moe_router_num_groups,
        group_topk=cfg.moe_router_group_topk, scaling_factor=cfg.moe_router_topk_scaling_factor,
        score_function=router.score_function, expert_bias=router.expert_bias, fused=False, router_replay=None)
    return routing_map
