"""The exit codes of every voxdiff command (train, sample, cache_latents, preflight) and of ``slurm/job.sh``.

One table, defined here only: the entry points import the constants, the README's "Errors and exit codes" section
lists the same rows (a test compares them), and ``slurm/job.sh`` reads them as shell variables::

    eval "$(python -m voxdiff.cli.exit_codes)"      # EXIT_CONFIG=2 EXIT_NONFINITE=3 ...

1 is not voxdiff's: it is Python's status for an uncaught exception (a traceback), which is a bug to report.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_NO_FIT = 4
EXIT_DATA = 5
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
             "loggers are built (trainer.devices=0, callbacks.best.mode=median); also torch.compile failing on the "
             "first training step (model.compile)",
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


@contextmanager
def refusals() -> Iterator[None]:
    """Around a command's work: bad input becomes one line on stderr and its exit code, never a traceback
    (``ConfigError`` → :data:`EXIT_CONFIG`, ``DataError`` → :data:`EXIT_DATA`)."""
    # deferred: python -m voxdiff.cli.exit_codes (slurm/job.sh) prints the table without importing torch
    from voxdiff.data.nifti import DataError
    from voxdiff.errors import ConfigError

    try:
        yield
    except ConfigError as e:
        print(f"[voxdiff] config error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG) from None
    except DataError as e:
        print(f"[voxdiff] data error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_DATA) from None


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
