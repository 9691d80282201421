"""Save a megatron dist checkpoint whose tensors are produced one at a time, at write time.

`dist_checkpointing.save` with megatron's own torch_dist strategy resolves every tensor of the
state dict before writing the first byte (its async writer stages them all), so the process
holds the whole model. `MaterializingSave` is the same torch_dist format written through
PyTorch's plain `FileSystemWriter`, whose serial loader asks the planner for one tensor, writes
it, and drops it. The model is built on the meta device (shapes and sharding only); the planner
turns each meta tensor the writer asks for into real data with a `materialize` callback.

    with torch.device("meta"):
        model = build_gpt_model(arch, groups, opts)
    save_checkpoint(root, 0, model, sharded_strategy=MaterializingSave(materialize))

Peak memory is then about the largest tensor `materialize` builds (plus the imports): see
benchmarks/convert_memory.py. The files are the ones megatron's strategy writes (same
planner, same keys, same metadata), so `dist_checkpointing.load` reads them at any layout.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def _planner_class():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    class MaterializingPlanner(MCoreSavePlanner):
        """megatron's save planner, whose tensors are materialised when the writer reaches them."""

        def __init__(self, materialize: Callable[[torch.Tensor], torch.Tensor],
                     sources: dict[tuple[str, tuple[int, ...]], torch.Tensor], **kw):
            super().__init__(**kw)
            self._materialize = materialize
            self._sources = sources
            self._written: torch.Tensor | None = None

        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            if not (isinstance(data, torch.Tensor) and data.is_meta):
                return data
            # The serial writer asks for the next tensor only after writing the previous one. It
            # also keeps every tensor it wrote in a dict (read only for its safetensors output
            # format, not ours), which would hold the whole model by the end: free the storage of
            # the one just written instead.
            if self._written is not None:
                self._written.untyped_storage().resize_(0)
            # the conversion to PyTorch's sharded tensors detached the data: materialise the
            # model's own tensor (a parameter or a view of one), found by key and offset
            source = self._sources[(write_item.index.fqn, tuple(write_item.index.offset))]
            out = self._materialize(source).reshape(data.shape)
            if out.untyped_storage().nbytes() != out.nbytes or out.storage_offset():
                out = out.clone()  # exactly its own storage, so freeing it frees nothing else
            self._written = out
            return out

    return MaterializingPlanner


def make_materializing_save(materialize: Callable[[torch.Tensor], torch.Tensor]):
    """A megatron save strategy (torch_dist format) that writes tensors one at a time.

    materialize: meta tensor from the model's sharded state dict (a parameter, or a view of one
        that megatron's factories made, e.g. the gate half of a fused fc1) -> its real CPU data,
        of the same shape and dtype.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    planner_class = _planner_class()

    class MaterializingSave(TorchDistSaveShardedStrategy):
        def __init__(self):
            super().__init__("torch_dist", 1, thread_count=1)

        def save(self, sharded_state_dict, checkpoint_dir):
            sources = {(t.key, tuple(t.global_offset)): t.data for t in nested_values(sharded_state_dict)
                       if isinstance(t, ShardedTensor)}
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            pyt_state = mcore_to_pyt_state_dict(state, False)
            # thread_count=1 and CPU tensors: the writer's serial loader resolves one item at a time
            writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, thread_count=1,
                                      sync_files=True)
            planner = planner_class(materialize, sources, dedup_replicated_tensors=not self.keep_only_main_replica,
                                    flatten_state_dict=False)
            dcp_save(pyt_state, storage_writer=writer, planner=planner)

    return MaterializingSave()
