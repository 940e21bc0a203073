"""The exit codes of every voxdiff command (train, sample, evaluate, cache_latents, preflight) and of
``slurm/job.sh``, and the one path by which bad input becomes a one-line refusal with its code.

One table, defined here only: the entry points import the constants, the README's "Errors and exit codes" section
lists the same rows (a test compares them), and ``slurm/job.sh`` reads them as shell variables::

    eval "$(python -m voxdiff.cli.exit_codes)"      # EXIT_CONFIG=2 EXIT_NONFINITE=3 ...

1 is not voxdiff's: it is Python's status for an uncaught exception (a traceback), which is a bug to report.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_NO_FIT = 4
EXIT_DATA = 5
EXIT_WRITE = 6
EXIT_MEMORY = 7
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process ended by SIGTERM


@dataclass(frozen=True)
class ExitCode:
    code: int
    name: str
    meaning: str
    action: str


TABLE: tuple[ExitCode, ...] = (
    ExitCode(EXIT_OK, "EXIT_OK", "done", "nothing"),
    ExitCode(1, "-", "an unexpected error: Python printed a traceback (also Lightning's exit after Ctrl-C)",
             "a bug or a broken environment: report it with the command line and the traceback"),
    ExitCode(EXIT_CONFIG, "EXIT_CONFIG",
             "refused before anything ran: a config value, an argument or an input file (checkpoint, CSV, "
             "latent-cache index) cannot work, or the run directory is in use or holds another run; a folder or "
             "file a checkpoint names that the command line did not choose (data.root, data.latent_dir, "
             "encoding.checkpoint); a setting Hydra or Lightning refuses while the Trainer, its callbacks and "
             "loggers are built (trainer.accelerator=gpu without a GPU, callbacks.best.mode=median); also "
             "torch.compile failing on the first training step (model.compile)",
             "change what the one-line message names (key=value: problem. Fix: ...)"),
    ExitCode(EXIT_NONFINITE, "EXIT_NONFINITE",
             "training stopped on a NaN/inf loss or gradient norm, at most system.guard.check_every_n_steps "
             "steps after it and before any checkpoint was written after it",
             "resume from the last good checkpoint the message names, with a lower system.optim.lr, "
             "trainer.precision=32-true or a smaller trainer.gradient_clip_val"),
    ExitCode(EXIT_NO_FIT, "EXIT_NO_FIT",
             "the preflight's verdict: the training step does not fit the GPU (or, for a CPU run, the host's "
             "memory); nothing was built",
             "apply one of the changes the message lists with their predicted peaks"),
    ExitCode(EXIT_DATA, "EXIT_DATA",
             "the input data was refused: a NIfTI file is missing, unreadable, has NaN/inf voxels or no signal",
             "fix or remove the file the message names"),
    ExitCode(EXIT_WRITE, "EXIT_WRITE",
             "a file could not be written (a full disk or quota, no permission): the message names the file, what "
             "it needed and what was free; the previous checkpoint at that path is intact and no partial file is "
             "left",
             "free space there, or point paths.run_dir (evaluate.py: out_dir; cache_latents.py: out; preflight.py: "
             "preflight.out) at a file system with room, then run the same command again (train.py: ckpt_path=auto resumes)"),
    ExitCode(EXIT_MEMORY, "EXIT_MEMORY",
             "ran out of memory after the preflight's check passed (its prediction missed by more than its margin, "
             "another process held part of the GPU, or the allocator fragmented): train.py names the phase and step, "
             "what PyTorch measured beside the prediction and the last good checkpoint (nothing is written after "
             "it), and writes <run dir>/memory_error.json",
             "train.py: resume with ckpt_path=auto and the change the message works out from what was measured "
             "(+preflight.safety_margin=M, under which the preflight refuses the run and lists the changes it "
             "predicts to fit; or what else held the memory); sample.py, evaluate.py: a smaller batch_size"),
    ExitCode(EXIT_TERMINATED, "EXIT_TERMINATED",
             "stopped by SIGTERM (scancel, preemption, kill): a resume checkpoint was saved at the last finished "
             "step (the message says where); in a Slurm job that was not cancelled the job requeued itself",
             "resume with ckpt_path=auto paths.run_dir=<run dir> (a requeued Slurm job does this itself)"),
)


def building_refusal(exc: BaseException, cfg: Any) -> Any:
    """The one-line :class:`~voxdiff.errors.ConfigError` for an error raised while a command builds its objects from
    the config (Hydra's ``InstantiationException`` around a Trainer, callback, logger or data module; Lightning's
    ``MisconfigurationException``), or None when ``exc`` is neither (a genuine bug: its traceback stays).

    The key is the config node Hydra names (``full_key``), narrowed to the argument the message puts in backticks
    when the node has it (Lightning's style: "`devices` selected with `CPUAccelerator` should be an int > 0"), with
    the value it has in ``cfg``.
    """
    import re

    from hydra.errors import InstantiationException
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from omegaconf import OmegaConf

    # deferred: python -m voxdiff.cli.exit_codes (slurm/job.sh) prints the table without importing torch
    from voxdiff.errors import ConfigError

    if not isinstance(exc, (InstantiationException, MisconfigurationException)):
        return None
    text = str(exc)
    found = re.search(r"full_key:\s*(\S+)", text)
    node_key = found.group(1) if found else None
    cause = exc.__cause__ if isinstance(exc, InstantiationException) and exc.__cause__ is not None else exc
    problem = " ".join(str(cause).split()) or type(cause).__name__
    key, value = node_key or "config", None
    node = OmegaConf.select(cfg, node_key) if node_key else None
    named = re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", problem) + re.findall(r"`[^`]*?\b(\w+)=[^`]*`", problem)
    if OmegaConf.is_dict(node):  # else: the setting whose (non-numeric) value the message quotes, as in "gpu"
        named += [k for k in node if isinstance(node.get(k), str) and len(node.get(k)) > 2
                  and re.search(rf"\b{re.escape(node.get(k))}\b", problem)]
    for name in named:
        if OmegaConf.is_dict(node) and name in node:
            key, value = f"{node_key}.{name}", OmegaConf.select(cfg, f"{node_key}.{name}")
            break
    else:
        value = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node
        value = "..." if isinstance(value, (dict, list)) else value
    what = f"configs/{node_key.split('.')[0]}/" if node_key else "the config"
    return ConfigError(key, value, f"refused while building it ({type(cause).__name__}: {problem})",
                       f"correct {key} as the message says (the settings and their meaning are in {what})")


def command_line_refusal(exc: BaseException, overrides: list[str]) -> Any:
    """The one-line :class:`~voxdiff.errors.ConfigError` for a command line Hydra cannot compose (an unknown key, a
    config group option that does not exist, an override it cannot parse), from Hydra's own reason and fix.

    The key is the override Hydra names (``no_such_key=1``, ``model=nope``); the fix is what Hydra advises (``+key``
    to add a key, the options of a group), on the same line.
    """
    import re

    # deferred: python -m voxdiff.cli.exit_codes (slurm/job.sh) prints the table without importing torch
    from voxdiff.errors import ConfigError

    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    problem = (lines[0] if lines else type(exc).__name__).rstrip(".")
    rest = lines[1:]
    if rest and rest[0].startswith("Available options"):  # a group option that does not exist: list the others
        options = []
        for line in rest[1:]:
            if line.endswith(":") or "=" in line:  # Hydra's "Config search path:" section follows
                break
            options.append(line)
        fix = f"{rest[0].rstrip(':')}: {', '.join(options)}"
    elif rest:
        fix = " ".join(line.rstrip(".") for line in rest if not line.startswith("See https://"))
    else:
        fix = ""
    if not fix and any(line.startswith("See https://hydra.cc") for line in rest):  # the override grammar
        fix = "write it as key=value: a list as key=[a,b], a value with spaces or commas in quotes"
    fix = fix or "check the spelling against configs/ (python train.py --cfg job prints the composed config)"
    quoted = re.findall(r"'([^']+)'", " ".join(lines))  # what Hydra names: a key, 'group/option', the bad input
    parsed = [(arg, *arg.lstrip("+~").partition("=")) for arg in overrides]
    for matches in (lambda name, value: f"{name}/{value}" in quoted,  # a group option that does not exist
                    lambda name, value: name in quoted,  # a key
                    lambda name, value: any(q.startswith(f"{name}=") for q in quoted),  # an ambiguous value
                    lambda name, value: any(len(q) > 1 and q in value for q in quoted)):  # unparsable input
        for arg, name, eq, value in parsed:
            if matches(name, value):
                return ConfigError(name, value, problem, fix) if eq else ConfigError("command line", arg, problem,
                                                                                     fix)
    return ConfigError("command line", " ".join(overrides), problem, fix)


def hydra_main(config_name: str) -> Callable[[Callable[..., Any]], Callable[[], Any]]:
    """``@hydra.main`` for a voxdiff command on ``configs/<config_name>.yaml``, with one difference: a command line
    that Hydra cannot compose is refused as every other bad input is, in one line with :data:`EXIT_CONFIG` (Hydra
    itself prints its reason and exits 1). Hydra's own flags (``--help``, ``--cfg``, ``--multirun``) go to Hydra."""

    def decorate(task: Callable[..., Any]) -> Callable[[], Any]:
        import hydra
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        # deferred: python -m voxdiff.cli.exit_codes (slurm/job.sh) prints the table without importing torch
        from voxdiff.config import compose, config_dir

        run_hydra = hydra.main(config_path=str(config_dir()), config_name=config_name, version_base="1.3")(task)

        @functools.wraps(task)
        def main() -> Any:
            overrides = sys.argv[1:]
            if not any(arg.startswith("-") for arg in overrides):
                try:
                    cfg = compose(config_name, overrides)
                except (HydraException, OmegaConfBaseException) as exc:
                    print(f"[voxdiff] config error: {command_line_refusal(exc, overrides)}", file=sys.stderr,
                          flush=True)
                    raise SystemExit(EXIT_CONFIG) from None
                with refusals():  # Hydra creates the run directory before the command starts
                    _check_run_dir(cfg, overrides)
            return run_hydra()

        return main

    return decorate


def _check_run_dir(cfg: Any, overrides: list[str]) -> None:
    """Refuse a run directory Hydra could not create (under a file, not writable), naming the key the user set."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    # deferred: python -m voxdiff.cli.exit_codes (slurm/job.sh) prints the table without importing torch
    from voxdiff.files import check_output

    try:
        run_dir = OmegaConf.select(cfg, "paths.run_dir")
    except OmegaConfBaseException:  # resolved later, where a resolver needs the command's own set-up
        return
    if run_dir in (None, ""):  # an empty run directory has its own refusal (cli/run_dir.py)
        return
    given = [arg.lstrip("+").partition("=")[0] for arg in overrides]
    key = next((k for k in ("out_dir", "paths.run_dir", "paths.log_dir") if k in given), "paths.run_dir")
    check_output(key, str(run_dir), folder=True, fix="choose a folder this user can write to")


def known_failure(error: BaseException) -> tuple[int, str, Any] | None:
    """How a command reports ``error`` when it is one of its known failures: ``(exit code, what, message)`` for bad
    input (``ConfigError`` → :data:`EXIT_CONFIG`, ``DataError`` → :data:`EXIT_DATA`), a failed write or a full disk
    (→ :data:`EXIT_WRITE`) and an allocator's failure (→ :data:`EXIT_MEMORY`); None for anything else."""
    # deferred: python -m voxdiff.cli.exit_codes (slurm/job.sh) prints the table without importing torch
    from voxdiff.cli.out_of_memory import MemoryStop, is_out_of_memory, one_line
    from voxdiff.data.nifti import DataError
    from voxdiff.errors import ConfigError
    from voxdiff.files import CheckpointWriteError, out_of_space

    if isinstance(error, ConfigError):
        return EXIT_CONFIG, "config error", error
    if isinstance(error, DataError):
        return EXIT_DATA, "data error", error
    if isinstance(error, CheckpointWriteError):
        return EXIT_WRITE, "write failed", error.strerror or error
    if isinstance(error, MemoryStop):
        return EXIT_MEMORY, "out of memory", error
    if isinstance(error, Exception):
        if is_out_of_memory(error):  # a command's allocator failure (train.py's own report is a MemoryStop)
            return EXIT_MEMORY, "out of memory", one_line(error)
        if out_of_space(error):  # a full disk met outside voxdiff's own writes (a logger, a cache)
            return EXIT_WRITE, "write failed", f"no space left on the device ({' '.join(str(error).split())})"
    return None


@contextmanager
def refusals(cfg: Any = None) -> Iterator[None]:
    """Around a command's work: bad input, and a write that fails, become one line on stderr and their exit code,
    never a traceback (:func:`known_failure`). With ``cfg``, also what Hydra or Lightning refuse while the command
    builds its objects from it (:func:`building_refusal`) → :data:`EXIT_CONFIG`. Anything else is a bug: its
    traceback stays."""
    try:
        yield
    except Exception as e:
        known = known_failure(e)
        if known is None:
            refusal = building_refusal(e, cfg) if cfg is not None else None
            if refusal is None:
                raise  # a genuine bug: its traceback
            known = (EXIT_CONFIG, "config error", refusal)
        code, what, message = known
        print(f"[voxdiff] {what}: {message}", file=sys.stderr, flush=True)
        raise SystemExit(code) from None


def describe(code: int) -> str:
    """One line about ``code`` (``job.sh`` prints it when a step fails)."""
    for row in TABLE:
        if row.code == code:
            return f"{row.meaning}. What to do: {row.action}"
    return "not a voxdiff exit code (killed by a signal, or a crash outside Python)"


def shell() -> str:
    """``NAME=CODE`` lines for ``eval`` in ``slurm/job.sh``."""
    return "\n".join(f"{row.name}={row.code}" for row in TABLE if row.name != "-")


def markdown() -> str:
    """The README's table."""
    lines = ["| code | meaning | what to do |", "|---|---|---|"]
    lines += [f"| {row.code} | {row.meaning} | {row.action} |" for row in TABLE]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--describe":
        print(describe(int(sys.argv[2])))
    else:
        print(shell())
