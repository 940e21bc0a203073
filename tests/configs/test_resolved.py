"""Every experiment composes to the values of ``tests/fixtures/resolved_configs.json``, on a CPU and for a GPU.

A refactor of ``configs/`` must keep them; a deliberate change rewrites the snapshot
(``python scripts/snapshot_configs.py --write``) and its diff shows which runs change.
"""

import json

from script_modules import load_script


def _snapshot_module():
    return load_script("scripts/snapshot_configs.py")


def test_every_experiment_resolves_as_recorded():
    snap = _snapshot_module()
    recorded = json.loads(snap.SNAPSHOT.read_text())
    now = json.loads(json.dumps(snap.snapshot()))
    assert set(now["cpu"]) == set(recorded["cpu"]), "an experiment was added or removed: rewrite the snapshot"
    diff = snap.differences(recorded, now)
    assert not diff, "resolved config values changed:\n" + "\n".join(diff[:40])


def test_the_comparison_sees_a_changed_value():
    snap = _snapshot_module()
    old = {"cpu": {"exp11": {"model": {"channels": [32, 64]}, "mode": "bravo"}}}
    new = {"cpu": {"exp11": {"model": {"channels": [32, 128]}}}}
    assert snap.differences(old, new) == ["cpu.exp11.mode: 'bravo' -> (absent)",
                                          "cpu.exp11.model.channels: [32, 64] -> [32, 128]"]
