"""Debian's real headless Chromium for the report test: installed by the test if missing (as tests/slurm/harness.py
installs Slurm); a missing browser that cannot be installed fails the test, it is never skipped.

:func:`render` loads a page from a ``file://`` URL with no network, takes a screenshot, and reports what the browser
itself decoded: each image's ``naturalWidth`` (0 for an image that failed to load) and the rows of the metric table,
read from the DOM after the load event by a script added to a copy of the page (the report itself has no script).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from apt_packages import ensure  # tests/ is on sys.path (its conftest.py)

PACKAGES = ["chromium"]
_PROBE = ("<script>addEventListener('load',()=>{const b=document.body;"
          "b.dataset.widths=[...document.images].map(i=>i.naturalWidth).join(',');"
          "b.dataset.rows=document.querySelectorAll('table#metrics tbody tr').length;});</script>")


def ensure_installed() -> str:
    """The path of ``chromium``, installed with apt-get if missing (needs root and apt; one install at a time across
    the suite's processes: ``apt_packages.ensure``)."""
    ensure(PACKAGES, ("chromium",))
    return shutil.which("chromium")


def _chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [ensure_installed(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--no-first-run", "--disable-background-networking", f"--user-data-dir={profile}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)


def render(page: Path, screenshot: Path, width: int = 1200, height: int = 2400) -> dict:
    """Screenshot ``page`` and read back its decoded images and table rows.

    Returns:
        ``{"image_widths": [int, ...], "table_rows": int, "blank": bool, "screenshot": Path}``; ``blank`` is
        true when the screenshot is (almost) one colour.
    """
    probe = page.with_name(page.stem + ".probe.html")
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", _PROBE + "</body>"), encoding="utf-8")
    try:
        dom = _chromium("--virtual-time-budget=10000", "--dump-dom", probe.resolve().as_uri()).stdout
    finally:
        probe.unlink()
    body = re.search(r"<body([^>]*)>", dom)
    attrs = dict(re.findall(r'data-(\w+)="([^"]*)"', body.group(1) if body else ""))
    _chromium(f"--window-size={width},{height}", f"--screenshot={screenshot}", page.resolve().as_uri())
    from matplotlib.image import imread

    pixels = imread(screenshot)[..., :3]
    return {
        "image_widths": [int(w) for w in attrs.get("widths", "").split(",") if w],
        "table_rows": int(attrs.get("rows", -1)),
        "blank": bool(np.ptp(pixels) < 0.05 or pixels.std() < 0.01),
        "screenshot": screenshot,
    }
