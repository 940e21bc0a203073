"""``voxdiff.lightning.distributed``: the DDP/FSDP strategies the trainer configs build, the data order they share,
and the FSDP sharding of the diffusion system with its EMA (one gloo process here; two in tests/cli/test_fsdp.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.trainer.states import RunningStage
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from voxdiff.config import compose
from voxdiff.lightning.distributed import DDPStrategy, SharedSamplerSeed, ShardedUNetStrategy, ema_checkpoint_state
from voxdiff.models.sharding import fsdp_unit_types, is_sharded


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_trainer_configs_take_devices_and_nodes_from_slurm(name, monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    monkeypatch.setenv("SLURM_NNODES", "2")
    cfg = compose("train", ["experiment=exp11", f"trainer={name}"])
    assert cfg.trainer.devices == 4 and cfg.trainer.num_nodes == 2 and cfg.trainer.accelerator == "gpu"
    assert cfg.trainer.precision is None  # bf16-mixed on a bf16 GPU, as decided per device


def test_the_ddp_config_builds_ddp_with_its_memory_options():
    cfg = compose("train", ["experiment=exp11", "trainer=ddp", "trainer.strategy.bucket_cap_mb=50", "seed=7"])
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, DDPStrategy)
    assert strategy._ddp_kwargs == {"gradient_as_bucket_view": True, "bucket_cap_mb": 50}  # to DistributedDataParallel
    assert strategy.sampler_seed == 7


def test_the_fsdp_config_builds_the_sharded_unet_strategy():
    strategy = instantiate(compose("train", ["experiment=exp11", "trainer=fsdp"]).trainer.strategy)
    assert isinstance(strategy, ShardedUNetStrategy)
    assert strategy._save_distributed_checkpoint is False  # one checkpoint file
    assert strategy.sampler_seed == 42


class _Ranked:
    """Stands for a strategy of two ranks (what Lightning asks it for the sampler)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": 2, "rank": self.rank}


class _Shared(SharedSamplerSeed, _Ranked):
    pass


@pytest.mark.parametrize("shared", [False, True], ids=["per-rank seed", "shared seed"])
def test_ranks_split_each_epoch_only_with_a_shared_sampler_seed(shared, monkeypatch):
    """train.py seeds the ranks differently (seed + rank) and Lightning seeds the DistributedSampler from that:
    without SharedSamplerSeed the ranks shuffle differently and an epoch misses subjects, repeating others."""
    loader = DataLoader(list(range(10)), shuffle=True)
    partitions = []
    for epoch in range(6):
        seen = []
        for rank in (0, 1):
            monkeypatch.setenv("PL_GLOBAL_SEED", str(42 + rank))
            strategy = _Shared(rank, sampler_seed=42) if shared else _Ranked(rank)
            sampler = _get_distributed_sampler(loader, shuffle=True, overfit_batches=0, mode=RunningStage.TRAINING,
                                               **strategy.distributed_sampler_kwargs)
            sampler.set_epoch(epoch)
            seen += list(sampler)
        partitions.append(sorted(seen) == list(range(10)))
    assert all(partitions) if shared else not all(partitions)


# ----------------------------------------------------------------------------------------------------- sharding
@pytest.fixture
def gloo_world(tmp_path):
    """A process group of this one process (gloo) and its 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _system(tiny_cfg, *overrides):
    return instantiate(tiny_cfg("system.ema.decay=0.5", *overrides, config_name="train").system)


def test_configure_model_shards_the_unet_and_its_ema(tiny_cfg, gloo_world):
    system = _system(tiny_cfg)
    full = {k: v.clone() for k, v in system.model.state_dict().items()}
    system._device_mesh = gloo_world
    system.configure_model()
    system.configure_model()  # a second call (validate after fit) does nothing
    units = [m for m in system.model.modules() if isinstance(m, fsdp_unit_types())]
    assert units and all(type(m).__name__.startswith("FSDP") for m in [*units, system.model])
    params = dict(system.model.named_parameters())
    assert is_sharded(system.model) and len(system.ema.shadow) == len(params)
    for name, shadow in zip(system.ema.names, system.ema.shadow):
        assert isinstance(shadow, DTensor) and shadow.placements == params[name].placements
        torch.testing.assert_close(shadow.full_tensor(), full[name])  # the average starts at the weights


@pytest.mark.parametrize("start_step", [0, 1], ids=["average", "copy"])
def test_the_sharded_ema_averages_each_shard(tiny_cfg, gloo_world, start_step):
    """EMA.update on DTensor shards: the copy of the first updates and the average (the copy raised in
    ``_foreach_copy_``, which DTensor does not implement, before the update worked on local shards)."""
    system = _system(tiny_cfg, f"system.ema.start_step={start_step}")
    system._device_mesh = gloo_world
    system.configure_model()
    before = [s.full_tensor().clone() for s in system.ema.shadow]
    with torch.no_grad():
        for p in system.model.parameters():
            p.add_(1.0)
    system.ema.update(system.model)
    params = dict(system.model.named_parameters())
    for name, old, shadow in zip(system.ema.names, before, system.ema.shadow):
        new = params[name].full_tensor()
        expected = new if start_step else 0.5 * old + 0.5 * new
        torch.testing.assert_close(shadow.full_tensor(), expected)


def test_the_ema_is_saved_whole_and_loaded_into_shards(tiny_cfg, gloo_world):
    system = _system(tiny_cfg)
    system._device_mesh = gloo_world
    system.configure_model()
    with torch.no_grad():
        for s in system.ema.shadow:
            s.to_local().mul_(3.0)
    weights = {k: v.full_tensor().clone() for k, v in system.model.state_dict().items()}
    state = ema_checkpoint_state(system.ema, system.model)  # swaps the EMA in to gather it, and back
    for name, shadow in zip(system.ema.names, system.ema.shadow):
        saved = state["shadow"][name]
        assert not isinstance(saved, DTensor) and saved.device.type == "cpu"
        torch.testing.assert_close(saved, shadow.full_tensor())
    torch.testing.assert_close({k: v.full_tensor() for k, v in system.model.state_dict().items()}, weights)
    other = _system(tiny_cfg)
    other._device_mesh = gloo_world
    other.configure_model()
    other.ema.load_state_dict(state)
    for mine, theirs in zip(other.ema.shadow, system.ema.shadow):
        assert isinstance(mine, DTensor) and mine.placements == theirs.placements
        torch.testing.assert_close(mine.full_tensor(), theirs.full_tensor())


def test_the_processes_lightning_launched_are_ended_when_their_launcher_fails():
    """stop_launched_processes on the children of Lightning's own launcher: one that ends within the grace keeps its
    exit code; one that would wait forever (as a rank waits in a collective for a failed rank 0) is killed."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from voxdiff.lightning.distributed import stop_launched_processes

    launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=3, num_nodes=1)
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    failing = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(7)"])
    launcher.procs = [waiting, failing]
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=launcher))
    start = time.monotonic()
    try:
        assert stop_launched_processes(trainer, grace_s=2.0) == {1: "killed", 2: 7}
    finally:
        waiting.kill()
    assert time.monotonic() - start < 30
    assert waiting.returncode == -9 and failing.returncode == 7  # reaped: no process left behind


def test_a_process_that_launched_nothing_has_nothing_to_end():
    from types import SimpleNamespace

    from voxdiff.lightning.distributed import stop_launched_processes

    assert stop_launched_processes(SimpleNamespace(strategy=SimpleNamespace(launcher=None))) == {}


def _children(*codes_after):
    """Real child processes: ``None`` sleeps (as a rank waiting in a collective), ``(code, s)`` exits with ``code``
    after ``s`` seconds."""
    import subprocess
    import sys

    return [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)" if c is None else
                              f"import time, sys; time.sleep({c[1]}); sys.exit({c[0]})"]) for c in codes_after]


def test_the_rank_watch_ends_the_others_and_exits_with_the_failed_ones_code(capsys):
    """RankWatch (in place of Lightning's observer, which SIGKILLs every process, the launcher included: exit 137):
    when a launched process fails, the others are killed and the launcher exits with the failed one's code."""
    from voxdiff.lightning.distributed import RankWatch

    waiting, failing = procs = _children(None, (3, 0.3))
    exits = []
    try:
        RankWatch(procs, period_s=0.1, exit=exits.append, grace_s=0.2).run()
    finally:
        waiting.kill()
    assert exits == [3]
    assert waiting.returncode == -9 and failing.returncode == 3
    assert ("[voxdiff] local rank 2 failed (exit code 3; its message is above): the run's other processes are ended, "
            "and this one exits with its code") in capsys.readouterr().err


def test_the_rank_watch_stands_down_for_the_launchers_own_failure_and_stops_when_all_succeed():
    import threading

    from voxdiff.lightning.distributed import RankWatch, exit_code

    (failing,) = procs = _children((3, 0.0))
    failing.wait()
    watch = RankWatch(procs, period_s=0.05, exit=lambda code: pytest.fail(f"exited {code}"))
    watch.stand_down()  # the launcher's own failure handling (stop_launched_processes) came first
    watch.run()  # returns at once, without exiting
    # the launcher failing too, a moment later (a non-finite loss reaches every rank): within the watch's grace
    late = RankWatch(procs, period_s=0.05, exit=lambda code: pytest.fail(f"exited {code}"), grace_s=10.0)
    threading.Timer(0.5, late.stand_down).start()
    late.run()
    done = _children((0, 0.0), (0, 0.1))
    RankWatch(done, period_s=0.05, exit=lambda code: pytest.fail(f"exited {code}")).run()
    assert [p.returncode for p in done] == [0, 0]
    assert exit_code(-9) == 137 and exit_code(7) == 7


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_voxdiffs_strategies_launch_their_processes_with_the_rank_watch(strategy):
    from lightning.fabric.plugins.environments import LightningEnvironment

    from voxdiff.lightning.distributed import WatchedLauncher

    built = DDPStrategy(kind="ddp") if strategy == "ddp" else ShardedUNetStrategy(kind="fsdp")
    built.cluster_environment = LightningEnvironment()  # what Lightning's connector sets on a machine without Slurm
    built._configure_launcher()
    assert type(built.launcher) is WatchedLauncher and built.launcher.watch is None  # none launched yet


def test_the_rank_watch_stands_by_while_the_run_is_stopped_from_outside():
    """Ctrl-C or SIGTERM reach every process, and the children end first: their exit codes must not cut short
    Lightning's handling in the launcher (its graceful shutdown, a resume checkpoint)."""
    from voxdiff.lightning.distributed import RankWatch

    (failing,) = procs = _children((1, 0.0))
    failing.wait()
    RankWatch(procs, period_s=0.05, exit=lambda code: pytest.fail(f"exited {code}"), stopping=lambda: True).run()


def test_sigint_and_sigterm_say_that_the_run_is_being_stopped():
    import os
    import signal
    import threading
    import time
    from types import SimpleNamespace

    from voxdiff.lightning.distributed import stop_requested, watch_interrupts

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a command
    try:
        interrupted = watch_interrupts()
        running = SimpleNamespace(_signal_connector=SimpleNamespace(received_sigterm=False))
        assert not stop_requested(running, interrupted)
        with pytest.raises(KeyboardInterrupt):  # the handler before it still runs: Lightning sees Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert interrupted.is_set() and stop_requested(running, interrupted)
    finally:
        signal.signal(signal.SIGINT, before)
    terminated = SimpleNamespace(_signal_connector=SimpleNamespace(received_sigterm=True))
    assert stop_requested(terminated, threading.Event())


def test_a_peer_whose_connection_closed_is_waited_for_so_its_code_is_the_runs():
    """Rank 0's collective failed because a launched rank's connection closed (gloo's "Connection closed by peer"):
    that rank is ending, and on a loaded machine its exit (its own failure's record, the teardown) can take longer
    than the grace, after which it would be killed and the run would exit with rank 0's traceback (once seen in CI:
    exit 1 instead of the failed rank's 7). ``first_exit_s`` waits for it; ``end_launched_ranks`` then reports its
    code. Any other error keeps the short grace: a rank waiting in a collective is killed after it."""
    import time
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from voxdiff.cli.train import RankFailed, end_launched_ranks
    from voxdiff.lightning.distributed import peer_gone, stop_launched_processes

    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:38614")
    try:
        raise ValueError("hydra's wrapper") from gloo
    except ValueError as wrapped:
        assert peer_gone(gloo) and peer_gone(wrapped)
    assert not peer_gone(RuntimeError("CUDA out of memory")) and not peer_gone(KeyboardInterrupt())

    def trainer_with(children):
        launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=len(children) + 1, num_nodes=1)
        launcher.procs = children
        return SimpleNamespace(strategy=SimpleNamespace(launcher=launcher))

    slow = _children((7, 2.5))
    try:
        assert stop_launched_processes(trainer_with(slow), grace_s=0.5) == {1: "killed"}  # the short grace alone
    finally:
        slow[0].kill()
    slow = _children((7, 2.5))
    start = time.monotonic()
    assert stop_launched_processes(trainer_with(slow), grace_s=0.5, first_exit_s=30) == {1: 7}
    assert time.monotonic() - start < 20  # it waited for the peer, not for the whole of first_exit_s
    slow = _children((7, 4.5))  # longer than LAUNCHED_GRACE_S: without the wait it would be killed, no RankFailed
    with pytest.raises(RankFailed, match=r"local rank 1 failed \(exit code 7; its message is above\)") as failed:
        end_launched_ranks(trainer_with(slow), gloo)
    assert failed.value.code == 7


@pytest.mark.parametrize("stop", ["non-finite", "sigterm"])
def test_a_stop_that_reaches_every_rank_waits_for_the_launched_ranks_to_end_by_themselves(stop, capsys):
    """A non-finite loss (the guard's record is all-reduced) and SIGTERM (Lightning forwards it) stop every rank at
    the same step: a launched rank still ending by itself (its teardown, its own message, then about 3 s in the
    interpreter's exit on this machine) is waited for, not killed as one waiting in a collective. On a loaded
    machine its end took longer than the short grace (a CI run once: "local rank 1 killed after 3 s", its own
    message lost)."""
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from voxdiff.cli.train import end_launched_ranks
    from voxdiff.lightning.distributed import LAUNCHED_GRACE_S
    from voxdiff.step import NonFiniteLossError

    error, code = ((NonFiniteLossError(5, "loss", float("nan")), 3) if stop == "non-finite" else
                   (SIGTERMException(), 143))
    launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    launcher.procs = _children((code, LAUNCHED_GRACE_S + 1.5))
    end_launched_ranks(SimpleNamespace(strategy=SimpleNamespace(launcher=launcher)), error)
    assert launcher.procs[0].returncode == code
    how = "failed" if stop == "non-finite" else "was interrupted"
    assert f"[voxdiff] rank 0 {how}; the processes it launched: local rank 1 ended (exit code {code})" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_rank_watch_stands_down_as_soon_as_the_launchers_own_run_fails(strategy):
    """Lightning tells the strategy of the launcher's exception (``on_exception``) before its teardown and loggers'
    finalizing, which on a loaded machine outlast the watch's grace: the watch stands down there, so that a launched
    rank failing at the same step (a non-finite loss) does not end the launcher before it reports its own failure."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from voxdiff.lightning.distributed import RankWatch

    built = DDPStrategy(kind="ddp") if strategy == "ddp" else ShardedUNetStrategy(kind="fsdp")
    built.cluster_environment = LightningEnvironment()
    built._configure_launcher()
    (failing,) = procs = _children((3, 0.0))
    failing.wait()
    built.launcher.watch = RankWatch(procs, period_s=0.05, exit=lambda code: pytest.fail(f"exited {code}"),
                                     grace_s=0.1)
    built.on_exception(RuntimeError("the launcher's own failure"))
    built.launcher.watch.run()  # returns without exiting: it stood down
