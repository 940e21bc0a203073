"""Multi-GPU pieces: DDP's replica-consistency check, FSDP for MONAI's UNet (sharding, EMA, strategy), and the end
of a run's other processes when the one that launched them fails.

FSDP (``trainer=fsdp``) is FSDP2 (``torch.distributed.fsdp.fully_shard``) under Lightning's
``ModelParallelStrategy``: the same code runs on GPUs (NCCL) and on the CPU (gloo), where Lightning's
``FSDPStrategy`` refuses to start ("requires a GPU accelerator").
:func:`~voxdiff.models.sharding.shard_unet` makes every MONAI resnet block and attention block one FSDP unit and the
UNet the root unit; each parameter becomes a ``DTensor`` whose dim-0 rows are split over the ranks (``Shard(0)``).
Gradients and AdamW's moments follow their parameter, and so does the EMA
(:func:`shard_system`): each rank averages its own shard. Full tensors exist only one unit at a time (all-gathered
for its forward and backward), and when a checkpoint is written: rank 0 gathers weights, AdamW state and EMA into
host memory (``StateDictOptions(full_state_dict=True, cpu_offload=True)``, torch's distributed-checkpoint API) and
writes one ordinary checkpoint file, which resumes under FSDP, DDP or one device and which ``sample.py`` reads on
one process. Its cost: about 16 bytes per parameter of host memory on rank 0's node while it is written (weights 4,
AdamW 8, EMA 4: 40 GiB for 2.66 B parameters).

Batch size and learning rate under DDP: ``data.batch_size`` is per process (per GPU); the effective batch is
``batch_size × devices × num_nodes × trainer.accumulate_grad_batches``. ``system.optim.lr`` is used as given (no
automatic scaling): when you multiply the effective batch by k, scale the learning rate yourself (linearly for
small k, by √k for large k, as is usual for AdamW).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from voxdiff.config import check_kind
from voxdiff.models.sharding import is_sharded, shard_unet
from voxdiff.step.ema import EMA


def parameter_checksum(module: torch.nn.Module) -> torch.Tensor:
    """A (2,) float64 fingerprint of the parameters: the sum and the sum of squares of all entries."""
    total = torch.zeros(2, dtype=torch.float64)
    for p in module.parameters():
        d = p.detach().to(torch.float64).cpu()
        total += torch.stack((d.sum(), d.square().sum()))
    return total


class ReplicaConsistency(L.Callback):
    """Check at the end of training that every DDP replica holds the same weights.

    Gathers :func:`parameter_checksum` from all ranks, writes them to ``<run dir>/replicas.json`` on rank 0 and
    raises if two replicas differ by more than ``rtol`` (a desynchronised replica trains silently otherwise).

    Args:
        rtol: relative tolerance of the comparison (DDP all-reduces gradients, so replicas agree to rounding).
        filename: the report, relative to ``trainer.default_root_dir``.
    """

    def __init__(self, rtol: float = 1e-9, filename: str = "replicas.json") -> None:
        self.rtol = rtol
        self.filename = filename

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        local = parameter_checksum(pl_module).to(pl_module.device)
        gathered = trainer.strategy.all_gather(local)  # (world, 2), or (2,) with one process
        sums = gathered.reshape(-1, 2).cpu().tolist()
        if trainer.is_global_zero:
            report = {"world_size": trainer.world_size, "global_step": trainer.global_step, "checksums": sums}
            path = Path(trainer.default_root_dir) / self.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2))
        reference = torch.tensor(sums[0], dtype=torch.float64)
        for rank, values in enumerate(sums):
            if not torch.allclose(torch.tensor(values, dtype=torch.float64), reference, rtol=self.rtol, atol=0.0):
                raise RuntimeError(f"DDP replica {rank} holds different weights from replica 0 "
                                   f"({values} vs {sums[0]}): the processes desynchronised")



# ------------------------------------------------------------------------------------------------------------- FSDP
def shard_system(system: Any, mesh: Any) -> None:
    """Shard a :class:`~voxdiff.lightning.diffusion.DiffusionSystem`'s UNet over ``mesh`` and its EMA with it
    (``configure_model`` under ``trainer=fsdp``; a second call does nothing).

    Rank 0's initial weights go to every rank's shards (``set_model_state_dict(broadcast_from_rank0=True)``; the
    ranks are seeded differently), then the EMA is made anew over the sharded parameters, so that it holds shards
    of the same layout (the EMA the system was built with holds full copies and is dropped).
    """
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = system.model
    if is_sharded(model):
        return
    mesh = mesh["data_parallel"] if mesh.ndim > 1 else mesh
    weights = model.state_dict() if dist.get_rank() == 0 else {}
    shard_unet(model, mesh)
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    step = system.step
    if step.ema is not None:
        step.ema = EMA(model, **dataclasses.asdict(step.recipe.ema))


def ema_checkpoint_state(ema: Any, model: torch.nn.Module) -> dict[str, Any]:
    """``ema.state_dict()`` with full tensors: as it is on one process; under FSDP the shards are gathered to
    rank 0's host memory by torch's ``get_model_state_dict`` (the EMA swapped into the model meanwhile), and the
    other ranks return an empty ``shadow`` (only rank 0 writes the checkpoint). Call it on every rank."""
    if not is_sharded(model):
        return ema.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with ema.swapped(model):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # one rank on the CPU: the "gathered" tensors are the parameters themselves, which the swap restores
        params = dict(model.named_parameters())
        full = {n: t.clone() if t.data_ptr() == params[n].to_local().data_ptr() else t for n, t in full.items()
                if n in params}
    state = {k: v for k, v in ema.state_dict().items() if k != "shadow"}
    state["shadow"] = {n: full[n] for n in ema.names} if full else {}
    return state


#: seconds the processes Lightning launched get to end by themselves (writing their own failure's record) once the
#: process that launched them has failed, before :func:`stop_launched_processes` kills them; and the time
#: :class:`RankWatch` gives this process's own failure handling after a launched process failed
LAUNCHED_GRACE_S = 3.0
#: seconds :func:`stop_launched_processes` waits for the first launched process to end when this process's error
#: says a peer's connection closed (:func:`peer_gone`): that peer is ending, but writing its own failure's record and
#: tearing down can take longer than :data:`LAUNCHED_GRACE_S` on a loaded machine (a CI run once exited 1 with rank 0's
#: "Connection closed by peer" traceback instead of the failed rank's code 7)
PEER_EXIT_WAIT_S = 60.0
#: what a collective's error says when another process's connection closed under it (gloo; NCCL's watchdog)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited")
#: seconds between :class:`RankWatch`'s looks at the processes it launched
WATCH_PERIOD_S = 0.5


def exit_code(returncode: int) -> int:
    """A process's exit code as a shell reports it: ``returncode``, or 128 + the signal for one killed by a signal
    (``subprocess``'s negative return code)."""
    return 128 - returncode if returncode < 0 else returncode


def rank_failed_line(local_rank: int, returncode: int) -> str:
    """What the launching process says when one of its processes failed (its own message is above it)."""
    return (f"[voxdiff] local rank {local_rank} failed (exit code {exit_code(returncode)}; its message is above): "
            "the run's other processes are ended, and this one exits with its code")


class RankWatch(threading.Thread):
    """In the process that launched the run's others (Lightning's launcher without Slurm or torchrun): when one of
    them fails, end the others and exit with its code.

    It replaces Lightning's ``_ChildProcessObserver``, which ends them too, but with SIGKILL to every process,
    itself included: the command exited 137 ("killed") whatever the failure, an out-of-memory (7) or a non-finite
    loss (3) alike, while this process waits for the failed one in a collective (NCCL: until the process group's
    timeout) or fails with a "Connection closed by peer" traceback (gloo). The exit is ``os._exit``: this process may
    be blocked in a collective, and its work ends with the run (as under SIGKILL: a checkpoint being written is left
    as a temporary file, which the run directory's next start removes).

    :meth:`stand_down`, from this process's own failure handling (the strategy's ``on_exception``,
    :class:`WatchedRanks`, and :func:`stop_launched_processes`), stops the watch first, so that the failure of this
    process is reported as its own. Where the processes fail together (a non-finite loss reaches every rank through
    the all-reduced gradients), the watch gives this one ``grace_s`` to stand it down before it acts. ``stopping``
    (:func:`stop_requested`) says that the run is being stopped from outside (Ctrl-C, SIGTERM): every process ends by
    itself then, the children first, and Lightning's handling in this process (a graceful shutdown, a resume
    checkpoint) must not be cut short by their exit codes.
    """

    def __init__(self, procs: list[subprocess.Popen], period_s: float = WATCH_PERIOD_S,
                 exit: Callable[[int], Any] = os._exit, stopping: Callable[[], bool] = lambda: False,
                 grace_s: float = LAUNCHED_GRACE_S) -> None:
        super().__init__(daemon=True, name="voxdiff-rank-watch")
        self.procs, self.period_s, self._exit, self._stopping = procs, period_s, exit, stopping
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._stood_down = threading.Event()

    def stand_down(self) -> None:
        """Stop watching; returns once a failure the watch is handling has been handled (which exits the process)."""
        with self._lock:
            self._stood_down.set()

    def run(self) -> None:
        while not self._stood_down.wait(self.period_s):
            codes = [p.poll() for p in self.procs]
            if all(c == 0 for c in codes):
                return
            failed = next(((r, c) for r, c in enumerate(codes, start=1) if c not in (None, 0)), None)
            if failed is None:
                continue
            if self._stood_down.wait(self.grace_s):  # this process is failing too: its own report comes first
                return
            with self._lock:
                if self._stood_down.is_set() or self._stopping():
                    return
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                print(rank_failed_line(*failed), file=sys.stderr, flush=True)
                self._exit(exit_code(failed[1]))
                return


def watch_interrupts() -> threading.Event:
    """An event set when this process receives SIGINT (Ctrl-C), the handler before it (Python's
    ``KeyboardInterrupt``, which Lightning handles) then called as before. Only in the main thread (where a handler
    can be set); elsewhere the event is never set."""
    interrupted = threading.Event()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is threading.main_thread() and callable(previous):
        def on_interrupt(signum: int, frame: Any) -> Any:
            interrupted.set()
            return previous(signum, frame)

        signal.signal(signal.SIGINT, on_interrupt)
    return interrupted


def stop_requested(trainer: Any, interrupted: threading.Event) -> bool:
    """Whether the run is being stopped from outside: this process received SIGINT (``interrupted``,
    :func:`watch_interrupts`) or SIGTERM (Lightning's signal connector's ``received_sigterm``)."""
    connector = getattr(trainer, "_signal_connector", None)
    return interrupted.is_set() or bool(getattr(connector, "received_sigterm", False))


class WatchedLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher of a run's other local processes (``trainer.devices=N`` without Slurm or torchrun),
    with :class:`RankWatch` in place of Lightning's observer (:attr:`watch`, None until it launched any)."""

    watch: RankWatch | None = None

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            interrupted = watch_interrupts()
            self.watch = RankWatch(self.procs, stopping=lambda: stop_requested(trainer, interrupted))
            self.watch.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class WatchedRanks:
    """Strategy mixin: the processes Lightning launches itself are watched by :class:`WatchedLauncher`, and the
    watch stands down as soon as this process's own run fails (Lightning's ``on_exception``, before its teardown and
    the loggers' finalizing, which on a loaded machine outlast the watch's grace): a rank failing at the same step
    (a non-finite loss) then does not end this one before it reports its own failure."""

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]
        launcher = self._launcher  # type: ignore[has-type]
        if type(launcher) is _SubprocessScriptLauncher:
            self._launcher = WatchedLauncher(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes)

    def on_exception(self, exception: BaseException) -> None:
        watch = getattr(self._launcher, "watch", None)  # type: ignore[attr-defined]
        if watch is not None:
            watch.stand_down()
        super().on_exception(exception)  # type: ignore[misc]


class SharedSamplerSeed:
    """Strategy mixin: every rank's ``DistributedSampler`` shuffles with the run's seed.

    ``train.py`` seeds each rank differently (``seed + rank``: the ranks draw different diffusion noise), and
    Lightning seeds the ``DistributedSampler`` with that per-rank seed (``PL_GLOBAL_SEED``): the ranks would
    shuffle differently, and an epoch would not split the data set over them (a subject twice, another never).

    Args:
        sampler_seed: the seed of the data order, the same on every rank (``${seed}`` in the trainer configs).
        kind: ``trainer.strategy.kind``, what the strategy does with the model (:func:`voxdiff.config.strategy_kind`,
            which the preflight reads without importing Lightning): must be the class's ``kind``.
    """

    #: ``ddp`` or ``fsdp`` (:data:`voxdiff.config.PARALLEL_KINDS`), set by each strategy
    kind: str

    def __init__(self, *args: Any, sampler_seed: int = 0, kind: str | None = None, **kwargs: Any) -> None:
        check_kind(type(self), kind, key="trainer.strategy")
        super().__init__(*args, **kwargs)
        self.sampler_seed = int(sampler_seed)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {**super().distributed_sampler_kwargs, "seed": self.sampler_seed}  # type: ignore[misc]


class DDPStrategy(SharedSamplerSeed, WatchedRanks, _LightningDDPStrategy):
    """The strategy of ``trainer=ddp`` (``configs/trainer/ddp.yaml``): Lightning's ``DDPStrategy`` (its arguments,
    e.g. ``gradient_as_bucket_view``, ``bucket_cap_mb``, go to ``DistributedDataParallel``) with
    :class:`SharedSamplerSeed` and :class:`WatchedRanks`."""

    kind = "ddp"


class ShardedUNetStrategy(SharedSamplerSeed, WatchedRanks, ModelParallelStrategy):
    """The strategy of ``trainer=fsdp`` (``configs/trainer/fsdp.yaml``): Lightning's ``ModelParallelStrategy``
    with one data-parallel dimension over every process of every node, i.e. FSDP over the whole world (Lightning's
    default shards within a node and replicates across nodes through a second, tensor-parallel dimension that
    voxdiff does not use), writing one checkpoint file (``save_distributed_checkpoint=False``; a folder of shards
    is refused by :func:`voxdiff.run.spec.validate_trainer`: voxdiff's resume, ``ckpt_path=auto``,
    ``sample.py`` and ``evaluate.py`` read one file, as data only, and the shards' metadata is a pickle), with
    :class:`SharedSamplerSeed` and :class:`WatchedRanks`. The sharding itself happens in
    ``DiffusionSystem.configure_model`` (:func:`shard_system`). Other arguments are Lightning's."""

    kind = "fsdp"

    def __init__(self, save_distributed_checkpoint: bool = False, **kwargs: Any) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto" and self._tensor_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
            self._tensor_parallel_size = 1
        super().setup_environment()


def peer_gone(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says another process's connection closed under a collective
    (:data:`PEER_GONE`): that process failed or is ending, and this one's error followed from it."""
    seen: BaseException | None = error
    while seen is not None:
        if any(s in str(seen) for s in PEER_GONE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def stop_launched_processes(trainer: L.Trainer, grace_s: float = LAUNCHED_GRACE_S,
                            first_exit_s: float = 0.0) -> dict[int, int | str]:
    """After the process that launched the run's other processes failed, end those.

    Without Slurm or torchrun (``python train.py trainer=ddp trainer.devices=4`` on one machine), Lightning's
    launcher runs rank 0 in the command's process and starts the other local ranks as its children. When a child
    fails, :class:`RankWatch` ends the others. When rank 0 fails (out of memory, a non-finite loss, any error),
    nothing in Lightning does: its exception leaves the children waiting for it in a collective (the next
    all-reduce or broadcast), with NCCL until the process group's timeout (30 minutes by Lightning's default),
    holding their GPUs after the command has returned. Under Slurm, ``srun --kill-on-bad-exit=1``
    (``slurm/job.sh``) ends a job's other tasks; torchrun's agent ends its workers.

    The watch stands down first (this failure is reported by this process). Up to ``first_exit_s`` pass until one
    child has ended (where this process's error says a peer's connection closed, :func:`peer_gone`: one is ending);
    then each child gets ``grace_s`` (together) to end by itself, then is killed (SIGKILL: a process waiting in a
    collective does not act on SIGTERM, as Lightning's observer notes). A child that ended by itself with an error had
    failed on its own: with gloo this process's error (``Connection closed by peer``) followed from it.

    Returns:
        ``{local rank: exit code, or "killed"}`` of each child this process launched (empty: it launched none).
    """
    launcher = trainer.strategy.launcher
    procs: list[subprocess.Popen] = (getattr(launcher, "procs", None) or []
                                     if isinstance(launcher, _SubprocessScriptLauncher) else [])
    watch = getattr(launcher, "watch", None)
    if watch is not None:  # this failure is reported here, as this process's (or as the one it followed)
        watch.stand_down()
    first = time.monotonic() + first_exit_s
    while procs and all(p.poll() is None for p in procs) and time.monotonic() < first:
        time.sleep(0.05)
    ended: dict[int, int | str] = {}
    deadline = time.monotonic() + grace_s
    for local_rank, proc in enumerate(procs, start=1):
        try:
            ended[local_rank] = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            ended[local_rank] = "killed"
    return ended


class SeedEachSample(L.Callback):
    """Reseed the global RNG before each training batch from the optimizer step and the batch's subjects.

    A subject then draws the same diffusion noise and timestep at the same step however the effective batch is
    split over processes and micro-batches (one subject per micro-batch): a run on N processes and one process
    with ``trainer.accumulate_grad_batches=N`` see the same samples, which makes their weights comparable (the
    tests compare FSDP with one process this way). For experiments on reproducibility, not for training.
    """

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        import zlib

        subjects = ",".join(map(str, batch.get("subject", [batch_idx])))
        torch.manual_seed(zlib.crc32(f"{trainer.global_step}:{subjects}".encode()))
