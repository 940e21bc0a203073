"""What one rank of a DDP or FSDP run holds: the training step traced as rank 0 of N runs it, without N processes.

The preflight traces the real thing rather than dividing totals: :func:`fake_world` stands in for N ranks with
torch's *fake* process group (one process; every collective returns at once, moves no data, and its output
tensors are those the caller allocated, as on a GPU), and :func:`wrap_for_rank` wraps the meta-device UNet as
``train.py`` does on each GPU:

* ``ddp``: torch's ``DistributedDataParallel`` with the configured ``gradient_as_bucket_view`` and
  ``bucket_cap_mb`` (``configs/trainer/ddp.yaml``) — its reducer allocates the gradient buckets; with
  ``gradient_as_bucket_view=true`` the gradients are views into them, else a second copy;
* ``fsdp``: :func:`voxdiff.models.sharding.shard_unet`, the function ``DiffusionSystem.configure_model``
  calls — FSDP2 shards every parameter over the ranks (dim-0 rows, padded to equal shards), gathers a unit's
  weights into its all-gather buffers for its forward and again for its backward, reduce-scatters its
  gradients, and the optimizer's moments and the EMA are made from the shards.

The traced step is then the same :class:`~voxdiff.step.TrainStep` as for one GPU, and the storage tracker counts
what this rank allocates: its shards, the unit in flight, the buckets. FSDP2 runs on meta tensors here through
three substitutions, made only inside :func:`fake_world`: its device is ``meta`` (not the mesh's), ``meta`` gets
the CPU's stream and event stubs (no streams: frees are immediate, as on the CPU), and its check that no parameter
is on meta is skipped. ``tests/preflight/test_distributed_memory.py`` checks the result against the CPU allocator
in real two-process gloo runs of DDP and FSDP.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from voxdiff.models.sharding import shard_unet
from voxdiff.run.spec import Parallel


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[Any]:
    """Be rank 0 of ``world_size`` ranks in this one process, for a trace on meta tensors; yields a 1-D
    ``DeviceMesh`` on ``meta`` over them. See the module docstring for what is substituted while inside.

    Raises:
        RuntimeError: a process group is initialised already (a real run): the trace would replace it.
    """
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    import torch.distributed.fsdp._fully_shard._fsdp_init as fsdp_init
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    import torch.distributed.fsdp._fully_shard._fsdp_state as fsdp_state
    import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard
    import torch.nn.parallel.distributed as ddp
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group is initialised already; trace before the run starts")

    original_handle = device_mesh._get_device_handle

    def device_handle(device_type: str = "cuda") -> Any:
        return torch.cpu if device_type == "meta" else original_handle(device_type)

    patches = [(fully_shard, "_get_device_from_mesh", lambda mesh: torch.device("meta")),
               (ddp, "_verify_param_shape_across_processes", lambda *args, **kwargs: None),
               (ddp, "_sync_module_states", lambda *args, **kwargs: None),
               (param_group.FSDPParamGroup, "_validate_no_meta_params", lambda self: None),
               *[(m, "_get_device_handle", device_handle)
                 for m in (device_mesh, collectives, fsdp_init, param_group, fsdp_state)]]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        with _MetaRoundTrip():
            yield device_mesh.init_device_mesh("meta", (world_size,))
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        dist.destroy_process_group()


class _MetaRoundTrip(TorchDispatchMode):
    """Give back the CPU data of a small tensor that went to ``meta`` and returns to the CPU.

    DDP sends its bucket assignment from rank 0 to the others by copying (``copy_``) a small CPU tensor of indices
    to the parameters' device, broadcasting it and copying it back (when it rebuilds its buckets in the order the
    gradients came, before the second forward). On meta the copy back has no data; the fake broadcast changed
    nothing, so the data is the CPU tensor that went in.
    """

    _LIMIT = 1 << 20  # elements: the indices of a UNet's parameters, never activations

    def __init__(self) -> None:
        super().__init__()
        self._sources: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}  # id(meta) -> (ref, CPU data)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and src.device.type == "meta":
                ref, data = self._sources.get(id(src), (None, None))
                if ref is not None and ref() is src:
                    return dst.copy_(data)
            if dst.device.type == "meta" and src.device.type == "cpu" and src.numel() <= self._LIMIT:
                self._sources = {k: v for k, v in self._sources.items() if v[0]() is not None}
                self._sources[id(dst)] = (weakref.ref(dst), src.clone())
        return func(*args, **kwargs)


def wrap_for_rank(model: nn.Module, parallel: Parallel, mesh: Any) -> nn.Module:
    """``model`` as one rank runs it under ``parallel`` (inside :func:`fake_world`, or a real process group):
    DDP-wrapped, sharded (FSDP, in place), or as it is."""
    if parallel.strategy == "ddp":
        import torch.distributed as dist

        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=parallel.gradient_as_bucket_view,
                                                  bucket_cap_mb=parallel.bucket_cap_mb)
        if dist.get_backend() == "fake":  # its all-reduce has no result: stand in for the built-in hook, which
            ddp.register_comm_hook(None, _bucket_as_reduced)  # reduces the bucket in place (no allocation)
        return ddp
    if parallel.strategy == "fsdp":
        return shard_unet(model, mesh)
    return model


def _bucket_as_reduced(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none
    """A DDP communication hook for the fake process group: the bucket, as the built-in all-reduce returns it."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
