"""Tests of the memo of meta kernels (``voxdiff.preflight.tracker.MetaMemo``): a replay is what the kernel returns,
only what may be replayed is, and a traced step predicts the same with the memo as without it."""

from __future__ import annotations

import dataclasses

import torch
from monai.networks.nets import DiffusionModelUNet

from voxdiff.preflight import predict_step_memory, tracker
from voxdiff.preflight.memory import trace_training_step
from voxdiff.preflight.resources import step_cost
from voxdiff.preflight.tracker import MetaMemo, MetaMemoMode, StorageTracker, tensors_in
from voxdiff.preflight.world import meta_step
from voxdiff.step import SEED

aten = torch.ops.aten


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_a_replay_has_the_kernels_metadata() -> None:
    memo = MetaMemo()
    x = _meta(2, 8, 4, 6, 5).to(memory_format=torch.channels_last_3d)
    w, b = _meta(8), _meta(8)
    args = (x, w, b, 2, 8, 120, 4, 1e-6)
    direct = aten.native_group_norm.default(*args)
    first, replay = memo(aten.native_group_norm.default, args, {}), memo(aten.native_group_norm.default, args, {})
    assert (memo.misses, memo.hits) == (1, 1)
    for a, r in zip(direct, replay):
        assert (a.shape, a.stride(), a.dtype) == (r.shape, r.stride(), r.dtype)
    assert first[0].stride() == x.stride() == replay[0].stride()  # channels-last kept
    grads = [memo(aten.native_group_norm_backward.default,
                  (torch.empty_like(x), x, direct[1], direct[2], w, 2, 8, 120, 4, mask), {}) for mask in
             ([True, True, True], [True, False, False], [True, False, False])]
    assert grads[2][1] is None and grads[2][2] is None and grads[0][1].shape == (8,)  # None outputs replayed
    assert memo.hits == 2  # the third call replays the second's record
    replayed = memo(aten.native_group_norm.default, args, {})[0]
    assert replayed.untyped_storage()._cdata != first[0].untyped_storage()._cdata  # a new storage each time


def test_scalars_of_other_types_are_other_signatures() -> None:
    """``2`` and ``2.0`` are equal (and hash equal) in Python, but an integer tensor plus 2.0 is a float tensor."""
    memo = MetaMemo()
    i = _meta(3, dtype=torch.int64)
    results = [memo(aten.add.Tensor, (i, s), {}) for s in (2, 2.0, True, 2, 2.0)]
    assert [r.dtype for r in results] == [torch.int64, torch.float32, torch.int64, torch.int64, torch.float32]
    assert memo.hits == 2


def test_views_in_place_ops_cpu_tensors_and_aliases_run_their_kernels() -> None:
    memo = MetaMemo()
    x = _meta(4, 6)
    view = memo(aten.view.default, (x, [24]), {})
    assert view.untyped_storage()._cdata == x.untyped_storage()._cdata  # still a view of x
    out = memo(aten.add_.Tensor, (x, x), {})
    assert out is x
    cpu = memo(aten.add.Tensor, (torch.ones(2), 1), {})  # real values: never replayed as meta
    assert cpu.device.type == "cpu" and cpu.tolist() == [2.0, 2.0]
    assert memo(aten.add.Tensor, (torch.ones(2), 1), {}).tolist() == [2.0, 2.0]
    assert memo.hits == 0 and not memo.records
    assert memo._record(x, [x]) is tracker._UNMEMOIZABLE  # an output that is an input is not replayed
    narrow = _meta(10)[2:]
    assert memo._record(narrow, []) is tracker._UNMEMOIZABLE  # nor one at an offset of a larger storage


def test_records_are_cleared_past_the_cap() -> None:
    memo = MetaMemo(max_entries=2)
    for n in (1, 2, 3):
        memo(aten.add.Tensor, (_meta(n), 1.0), {})
    assert len(memo.records) == 1


def test_a_traced_step_and_its_cost_are_the_same_without_the_memo(monkeypatch) -> None:
    """A bf16 UNet step's trace on meta (every allocation and free, in order, and the phases' peaks), its predicted
    memory (every field but the seconds the trace took) and its FLOPs and operator counts: with the memo as the
    traces use it (twice: the second run replays every op) and with a memo that never replays."""

    def build() -> DiffusionModelUNet:
        return DiffusionModelUNet(spatial_dims=3, in_channels=2, out_channels=1, channels=(16, 32),
                                  attention_levels=(False, True), num_res_blocks=1, num_head_channels=16,
                                  norm_num_groups=8)

    batch = {"image": (2, 1, 16, 16, 16), "mask": (2, 1, 16, 16, 16)}

    def trace():
        with torch.device("meta"):
            model = build()
        traced = trace_training_step(meta_step(model, SEED, "bf16-mixed"), batch, attention="flash")
        with torch.device("meta"):
            model = build()
        report = predict_step_memory(build, (2, 2, 16, 16, 16), SEED, batch=batch)
        return (traced.events, traced.phase_starts, traced.steps, dataclasses.replace(report, trace_seconds=0.0),
                step_cost(model, batch, "bravo"))

    monkeypatch.setattr(tracker, "META_MEMO", MetaMemo())
    memoized = trace()
    misses = tracker.META_MEMO.misses
    replayed = trace()
    assert tracker.META_MEMO.misses == misses and tracker.META_MEMO.hits > misses > 0  # all replayed the 2nd time
    monkeypatch.setattr(tracker, "META_MEMO", MetaMemo(enabled=False))
    plain = trace()
    assert tracker.META_MEMO.hits == 0
    assert memoized == replayed == plain
    assert len(plain[0]) > 100 and plain[3].peak_allocated > 0 and plain[4].tflop > 0


def test_the_tracker_counts_a_replay_as_an_allocation() -> None:
    x = _meta(256, 256)
    tr = StorageTracker(granularity=1)
    with tr:
        a = aten.linalg_vector_norm.default(x, 2.0)
        b = aten.linalg_vector_norm.default(x, 2.0)  # replayed
    assert (a.shape, b.shape) == ((), ()) and tr.live == tr.peak == 8
    with MetaMemoMode():
        c = aten.mul.Tensor(x, 2.0)
    assert c.shape == x.shape and c.device.type == "meta"


def test_tensors_in_walks_as_a_pytree_does() -> None:
    """The tracker counts an op's outputs in this order (the allocator model replays it), as torch's pytree would."""
    from torch.utils._pytree import tree_leaves

    a, b, c, d = (torch.empty(n) for n in (1, 2, 3, 4))
    structseq = torch.max(torch.empty(2, 3), dim=0)  # torch.return_types.max, a tuple subclass
    obj = ((a, [b, None, 2.0]), {"x": c, "y": (d,)}, structseq, torch.Size([3]))
    expected = [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
    assert [id(t) for t in tensors_in(obj)] == [id(t) for t in expected] and len(expected) == 6


def test_a_mode_entered_before_the_trace_sees_every_op() -> None:
    """A caller's own dispatch mode around a trace (``voxdiff.benchmarks.convs`` records every convolution so) sees
    each op of every run: the memo replays nothing below it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[str(func)] = self.calls.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    with torch.device("meta"):
        model = DiffusionModelUNet(spatial_dims=3, in_channels=2, out_channels=1, channels=(16, 32),
                                   attention_levels=(False, False), num_res_blocks=1, norm_num_groups=8)
    batch = {"image": (1, 1, 8, 8, 8), "mask": (1, 1, 8, 8, 8)}
    counts = []
    for _ in range(2):
        with Count() as count:
            step_cost(model, batch, "bravo")
            tracker_ = StorageTracker()
            with tracker_:
                aten.native_group_norm.default(_meta(1, 16, 8, 8, 8), None, None, 1, 16, 512, 8, 1e-6)
        counts.append(count.calls)
    assert counts[0] == counts[1] and counts[0]["aten.convolution.default"] > 4
    assert counts[0]["aten.native_group_norm.default"] > 4
