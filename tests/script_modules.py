"""Load a repository script (``scripts/``, ``bench/``: files, not modules of the package) as a module, for tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """The module of the repository file ``relative`` (e.g. ``"bench/bench_gpu_step.py"``), executed once per call,
    its folder on ``sys.path`` as when Python runs the file (``bench/bench_convs.py`` imports ``bench_gpu_step``)."""
    path = ROOT / relative
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
