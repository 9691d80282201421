"""Load Hugging Face checkpoints into a (sharded) megatron-core model and export them back.

Both directions stream tensor by tensor through the architecture's mapping (mappings/), aware
of TP (and expert-TP), EP and PP sharding:

    load_hf_weights(model, arch, groups, SafetensorsReader(hf_dir))   # hf_files: the folder's files, checked
    for name, tensor in export_hf_weights(model, arch, groups): ...   # every rank, in step
    save_hf_checkpoint(out_dir, arch, export_hf_weights(...), write=groups.rank == 0)
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.fs import fsync_dir, fsync_tree
from megatron_rl.model.arch import ModelArch
from megatron_rl.model.builder import unwrap_model
from megatron_rl.model.hf_files import SafetensorsReader, load_arch  # noqa: F401 - the readers live there
from megatron_rl.model.mappings import Kind, Param, Scope, from_shards, mapping_for, to_local_shard
from megatron_rl.parallel import ParallelGroups

# Buffers that are model state a checkpoint carries: the sigmoid router's score-correction bias
# (megatron-core's `expert_bias`, HF's `e_score_correction_bias`).
_STATE_BUFFERS = ("expert_bias",)


def mapped_tensors(model) -> dict[str, torch.Tensor]:
    """Name -> tensor of everything the HF mapping covers: the parameters and the state buffers."""
    m = unwrap_model(model)
    out = dict(m.named_parameters())
    out.update((n, b) for n, b in m.named_buffers() if n.rsplit(".", 1)[-1] in _STATE_BUFFERS)
    return out


@dataclass(frozen=True)
class _Slot:
    param: Param
    layer: int | None  # global layer
    expert: int | None  # global expert


def _stage_layers(arch: ModelArch, groups: ParallelGroups, stage: int) -> range:
    per = arch.num_layers // groups.config.pp
    return range(stage * per, (stage + 1) * per)


def _layers_for(param: Param, arch: ModelArch, layers: Iterable[int]) -> list[int]:
    if param.scope is Scope.LAYER:
        return list(layers)
    if param.scope is Scope.DENSE:
        return [i for i in layers if not arch.is_moe_layer(i)]
    return [i for i in layers if arch.is_moe_layer(i)]  # MOE, EXPERT


def _tp(param: Param, groups: ParallelGroups):
    group = groups.etp_group if param.scope is Scope.EXPERT else groups.tp_group
    return dist.get_rank(group), dist.get_world_size(group), group


def _shape_kwargs(arch: ModelArch) -> dict:
    return {"num_heads": arch.num_attention_heads, "num_groups": arch.num_kv_heads, "head_dim": arch.head_dim}


def local_plan(model, arch: ModelArch, groups: ParallelGroups) -> dict[str, _Slot]:
    """mcore parameter name on this rank -> which HF tensors it comes from.

    Raises if the model has a parameter the mapping does not cover (a new architecture
    feature that would otherwise be silently left at its random init).
    """
    names = set(mapped_tensors(model))
    layers = _stage_layers(arch, groups, groups.pp_rank)
    offset = layers.start
    e_local = arch.num_experts // groups.config.ep if arch.is_moe else 0
    plan: dict[str, _Slot] = {}

    def add(param: Param, global_layer, global_expert, **fmt):
        for template in (param.mcore, param.te_mcore):
            if template and (name := template.format(**fmt)) in names:
                plan[name] = _Slot(param, global_layer, global_expert)
                return

    for param in mapping_for(arch):
        if param.scope is Scope.GLOBAL:
            add(param, None, None)
        elif param.scope is Scope.EXPERT:
            for layer in _layers_for(param, arch, layers):
                for j in range(e_local):
                    add(param, layer, groups.ep_rank * e_local + j, layer=layer - offset, expert=j)
        else:
            for layer in _layers_for(param, arch, layers):
                add(param, layer, None, layer=layer - offset)
    unmapped = sorted(names - plan.keys())
    if unmapped:
        raise KeyError(f"{arch.arch} mapping does not cover mcore parameters {unmapped[:5]} "
                       f"({len(unmapped)} in all); add them to megatron_rl/model/mappings")
    return plan


def _hf_names(slot: _Slot) -> list[str]:
    return [h.format(layer=slot.layer, expert=slot.expert) for h in slot.param.hf]


def _local_tensor(name: str, slot: _Slot, target_shape, arch: ModelArch, groups: ParallelGroups,
                  read: Callable[[str], torch.Tensor], part: int | None = None) -> torch.Tensor:
    """This rank's shard of mcore parameter `name` from the HF tensors (part k of a GATED one:
    its gate (0) or up (1) rows only, reading one HF tensor)."""
    rank, size, _ = _tp(slot.param, groups)
    names = _hf_names(slot)
    kind = slot.param.kind
    if part is not None:
        local = read(names[part]).chunk(size, dim=0)[rank]
    else:
        local = to_local_shard(kind, [read(h) for h in names], rank, size, **_shape_kwargs(arch))
    if tuple(local.shape) != tuple(target_shape):
        raise ValueError(f"shape mismatch loading {names} into {name}: HF gives {tuple(local.shape)} for TP "
                         f"rank {rank}/{size}, model has {tuple(target_shape)}; does config.json match the model arch?")
    return local


@torch.no_grad()
def load_hf_weights(model, arch: ModelArch, groups: ParallelGroups, read: Callable[[str], torch.Tensor]) -> None:
    """Copy HF tensors (fetched by name with `read`) into this rank's shards of `model`."""
    params = mapped_tensors(model)
    for name, slot in local_plan(model, arch, groups).items():
        target = params[name]
        target.copy_(_local_tensor(name, slot, target.shape, arch, groups, read))


def hf_materializer(model, arch: ModelArch, groups: ParallelGroups, read: Callable[[str], torch.Tensor],
                    dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """For a model built on the meta device: meta parameter (or a view of one, as megatron's
    checkpoint factories make) -> its data from the HF tensors, in `dtype`, on the CPU.

    Reads only what the tensor needs: the gate or up half of a fused fc1 reads one HF tensor.
    Used with trainer.lazy_save to convert a checkpoint holding about one tensor at a time.
    """
    params = mapped_tensors(model)
    by_id = {id(p): n for n, p in params.items()}
    plan = local_plan(model, arch, groups)
    with torch.no_grad():
        # what megatron made on a real device despite the meta context (the router's expert_bias,
        # created with an explicit device) is small: fill it now; the writer saves it as it is
        for name, t in params.items():
            if not t.is_meta:
                t.copy_(_local_tensor(name, plan[name], t.shape, arch, groups, read))

    @torch.no_grad()
    def materialize(meta: torch.Tensor) -> torch.Tensor:
        base = meta if meta._base is None else meta._base
        name = by_id[id(base)]
        slot = plan[name]
        to = torch.float32 if slot.param.fp32 else dtype
        # the writer's tensor may carry megatron's prepended sharding axes: compare element counts
        whole = meta.numel() == base.numel() and meta.storage_offset() == 0
        if not whole and slot.param.kind is Kind.GATED and meta.numel() * 2 == base.numel():
            part = meta.storage_offset() // meta.numel()  # 0: the gate rows, 1: the up rows
            half = (base.shape[0] // 2, *base.shape[1:])
            return _local_tensor(name, slot, half, arch, groups, read, part).to(to).reshape(meta.shape)
        full = _local_tensor(name, slot, base.shape, arch, groups, read).to(to)
        if whole:
            return full.reshape(meta.shape)
        return full.as_strided(meta.shape, meta.stride(), meta.storage_offset()).clone()

    return materialize


def _grad_of(p: torch.Tensor) -> torch.Tensor:
    g = getattr(p, "main_grad", None)
    g = p.grad if g is None else g
    return torch.zeros_like(p) if g is None else g


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    if dist.get_world_size(group) == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _from_stage(tensors: list[torch.Tensor] | None, owner: int, groups: ParallelGroups,
                device: torch.device) -> list[torch.Tensor]:
    """Broadcast a list of tensors from pipeline stage `owner` to every stage; the other stages
    receive into buffers on `device`, the model's (NCCL needs them on the GPU)."""
    if groups.config.pp == 1:
        return tensors
    src = dist.get_global_rank(groups.pp_group, owner)
    meta = [[(t.shape, t.dtype) for t in tensors] if tensors is not None else None]
    dist.broadcast_object_list(meta, src=src, group=groups.pp_group)
    if tensors is None:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in meta[0]]
    for t in tensors:
        dist.broadcast(t, src=src, group=groups.pp_group)
    return tensors


def _to_rank(tensors: list[torch.Tensor] | None, owner: int, groups: ParallelGroups, device: torch.device,
             dst: int) -> list[torch.Tensor] | None:
    """Send a list of tensors from pipeline stage `owner` to global rank `dst` alone (point to point,
    within dst's pipeline group); the other stages' ranks keep None. Ranks outside dst's pipeline
    group exchange nothing: they hold their own stage's tensors or None."""
    if groups.config.pp == 1:
        return tensors
    group_ranks = dist.get_process_group_ranks(groups.pp_group)
    src = group_ranks[owner]
    if dst not in group_ranks or src == dst:
        return tensors
    me = dist.get_rank()
    if me == src:
        dist.send_object_list([[(t.shape, t.dtype) for t in tensors]], dst=dst, device=device)
        for t in tensors:
            dist.send(t.contiguous(), dst=dst)
        return tensors
    if me == dst:
        meta = [None]
        dist.recv_object_list(meta, src=src, device=device)
        out = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in meta[0]]
        for t in out:
            dist.recv(t, src=src)
        return out
    return None


@torch.no_grad()
def export_hf_weights(model, arch: ModelArch, groups: ParallelGroups, dtype: torch.dtype | None = None,
                      grads: bool = False, to: str | int = "all") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the HF tensors of the model.

    to: who gets which tensors across pipeline stages (TP and EP shards are always gathered
        within the stage, one tensor at a time):
        "all"   every tensor on every rank (PP broadcasts): checkpoint conversion, tests;
        r (int) global rank r gets every tensor (point to point from the owning stage's rank in
            r's pipeline group); the others get their own stage's.
    Collective: all ranks must iterate it to the end together. Tensors come out in the model's
    dtype unless `dtype` is given. grads=True exports the parameters' gradients (`main_grad` under
    megatron DDP, else `.grad`) in the same layout, which is how tests compare sharded gradients.
    Cost: one full tensor (its TP x EP gather) at a time on each rank of its stage; "all" also
    puts it on every other stage.
    """
    params = mapped_tensors(model)
    device = next(iter(params.values())).device
    if grads:
        params = {n: _grad_of(p) for n, p in params.items()}
    by_key = {(s.param, s.layer, s.expert): n for n, s in local_plan(model, arch, groups).items()}
    pp = groups.config.pp
    per_stage = arch.num_layers // pp
    e_local = arch.num_experts // groups.config.ep if arch.is_moe else 0
    kw = _shape_kwargs(arch)

    def cast(t, param):
        want = torch.float32 if param.fp32 else dtype
        return t.detach().to(want) if want is not None else t.detach().clone()

    def deliver(full, owner):
        if to == "all":
            return _from_stage(full, owner, groups, device)
        return _to_rank(full, owner, groups, device, to)

    for param in mapping_for(arch):
        if not param.export:
            continue
        _, _, tp_group = _tp(param, groups)
        if param.scope is Scope.GLOBAL:
            owner = 0 if param.stage == "first" else pp - 1
            name = by_key.get((param, None, None))
            full = deliver(from_shards(param.kind, _gather(params[name], tp_group), **kw) if name else None, owner)
            for hf_name, t in zip(param.hf, full or ()):
                yield hf_name, cast(t, param)
            continue
        for layer in _layers_for(param, arch, range(arch.num_layers)):
            owner = layer // per_stage
            if param.scope is not Scope.EXPERT:
                name = by_key.get((param, layer, None))
                full = deliver(from_shards(param.kind, _gather(params[name], tp_group), **kw) if name else None, owner)
                for template, t in zip(param.hf, full or ()):
                    yield template.format(layer=layer), cast(t, param)
                continue
            for j in range(e_local):
                name = by_key.get((param, layer, groups.ep_rank * e_local + j))
                full = None
                if name:
                    mine = from_shards(param.kind, _gather(params[name], tp_group), **kw)
                    # experts j, e_local + j, 2*e_local + j, ... from every EP rank
                    full = [t for k in range(len(mine)) for t in _gather(mine[k], groups.ep_group)]
                full = deliver(full, owner)
                if full is None:
                    continue
                n_ep = len(full) // len(param.hf)
                for k, template in enumerate(param.hf):
                    for r in range(n_ep):
                        yield template.format(layer=layer, expert=r * e_local + j), cast(full[k * n_ep + r], param)


def save_hf_config(out_dir: str, arch: ModelArch, dtype: torch.dtype | None) -> None:
    """config.json of `arch` in `out_dir`, naming `dtype` as the weights' dtype: a checkpoint's
    own, or alone, a model a server can start on before it has weights (vLLM --load-format dummy)."""
    hf_config = arch.to_hf_config()
    hf_config.torch_dtype = dtype
    if hasattr(hf_config, "dtype"):
        hf_config.dtype = dtype
    hf_config.architectures = [arch.family.hf_architecture]
    hf_config.save_pretrained(out_dir)


def save_hf_checkpoint(out_dir: str, arch: ModelArch, tensors: Iterable[tuple[str, torch.Tensor]], *,
                       write: bool = True, max_shard_bytes: int = 2 << 30,
                       extra_files: dict[str, str] | None = None, overwrite: bool = False) -> None:
    """Write an HF-format checkpoint directory atomically (temp dir + rename), streaming shards.

    Non-writing ranks still drain `tensors` (export is collective). `extra_files` {source: name}
    are copied in (tokenizer files). `out_dir` may be missing or an empty folder; anything else
    there is someone's data (the HF model exported from, a home directory), replaced only with
    overwrite=True, else FileExistsError: raised before `tensors` is read (a collective caller
    checks on every rank first, as tools/convert_hf_to_mcore.py does, or the other ranks would
    wait in the export) and again by the final rename itself, which refuses a non-empty target.
    Replacing moves the old folder into a fresh temporary folder beside it (a unique name, never a
    fixed one like `<out_dir>.old` that may be someone's too) and deletes it only once the new
    one is in place.
    """
    if not write:
        for _ in tensors:
            pass
        return
    from safetensors.torch import save_file

    out_dir = os.path.abspath(out_dir)  # `.` and `dir/` have a real name and parent
    name, parent = os.path.basename(out_dir), os.path.dirname(out_dir)

    def occupied() -> bool:
        if not os.path.lexists(out_dir):
            return False
        return os.path.islink(out_dir) or not os.path.isdir(out_dir) or bool(os.listdir(out_dir))

    def refusal() -> FileExistsError:
        return FileExistsError(f"{out_dir} exists and is not empty; write to a new folder, or pass "
                               f"overwrite=True to replace it")

    if occupied() and not overwrite:
        raise refusal()
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + name + "-", dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp gives 0700, which would hide the published folder from the group
        shards: list[dict[str, torch.Tensor]] = [{}]
        sizes = [0]
        files: list[str] = []
        weight_map: dict[str, int] = {}
        dtype = None

        def flush():
            i = len(files)
            files.append(f"part-{i:05d}.safetensors")
            save_file(shards[-1], os.path.join(tmp, files[-1]), metadata={"format": "pt"})

        for hf_name, t in tensors:
            dtype = dtype or t.dtype
            nbytes = t.numel() * t.element_size()
            if shards[-1] and sizes[-1] + nbytes > max_shard_bytes:
                flush()
                shards[-1], sizes[-1] = {}, 0
            shards[-1][hf_name] = t.contiguous()
            sizes[-1] += nbytes
            weight_map[hf_name] = len(files)
        flush()
        if len(files) == 1:
            os.replace(os.path.join(tmp, files[0]), os.path.join(tmp, "model.safetensors"))
        else:
            total = len(files)
            final = [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
            for a, b in zip(files, final):
                os.replace(os.path.join(tmp, a), os.path.join(tmp, b))
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": {k: final[v] for k, v in weight_map.items()}}, f, indent=1)
        save_hf_config(tmp, arch, dtype)
        for src, dst in (extra_files or {}).items():
            shutil.copy(src, os.path.join(tmp, dst))
        # every file as a plain open would make it: safetensors writes its files 0600 (and a copy
        # keeps its source's mode), which hid the weights from the group beside a 0644 config.json
        for entry in os.scandir(tmp):
            os.chmod(entry.path, 0o666 & ~_umask())
        fsync_tree(tmp)  # on disk before it takes the name (and before --overwrite deletes the old one)
        try:
            os.replace(tmp, out_dir)  # onto nothing or an empty folder; a non-empty one fails, atomically
        except OSError:
            if not occupied():
                raise
            if not overwrite:
                raise refusal() from None
        else:
            fsync_dir(parent)   # published: only the rename's durability is left
            return
        aside = tempfile.mkdtemp(prefix=".replaced-" + name + "-", dir=parent)
        old = os.path.join(aside, name)
        os.replace(out_dir, old)
        try:
            os.replace(tmp, out_dir)
        except BaseException:
            os.replace(old, out_dir)  # put it back: the caller keeps what it had
            os.rmdir(aside)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(parent)   # the new folder's name on disk before the old one is deleted
    shutil.rmtree(aside, ignore_errors=True)


def _umask() -> int:
    """The process's umask (reading it means setting it; it is put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
