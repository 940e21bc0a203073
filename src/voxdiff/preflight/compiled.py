"""The memory of a ``torch.compile``'d model (inductor, default mode), predicted on a CPU without a GPU.

``torch.compile(model)`` hands the model's training forward and backward to AOTAutograd, which traces them as
one joint graph and splits it with inductor's partitioner (``torch._inductor.compile_fx.partition_fn``: inductor's
joint-graph passes, then ``min_cut_rematerialization_partition``). The partitioner decides which tensors the
forward saves for the backward and which the backward recomputes; inductor then fuses pointwise ops into kernels,
so most intermediates are never written to memory. Both decide the peak.

:func:`trace_compiled` runs that same tracing and partitioning on fake CPU tensors made from the meta model (no
memory, no GPU), with CUDA autocast emulated as the eager trace does it
(:class:`~voxdiff.preflight.world.CudaAutocastEmulator`): the forward and backward graphs that come out are
those inductor would compile on the GPU, up to the device of the fake tensors. :func:`plan_graph` then simulates
the liveness of the buffers inductor materialises in each graph (:data:`EXTERN_OPS` — convolutions, matrix
products, attention —, reductions, graph outputs, inputs of extern kernels, and pointwise results that inductor's
lowering heuristics realise; see :func:`plan_graph`): each buffer is allocated when its kernel runs and freed after
its last reader; the forward's outputs (the model output and the saved tensors) live on; in the backward, the saved
tensors die at their last use (AOTAutograd hands them over and clears its own references) and the gradients stay.

:class:`CompiledModule` stands in for the compiled model in the eager trace of the training step
(:func:`voxdiff.preflight.memory.predict_step_memory` with ``compile=True``): its forward and backward replay those
allocations on the meta device, so the storage tracker sees the compiled model's buffers between the eager parts
of the step (noise, loss, optimizer, EMA) exactly where they happen.

Limits (documented, not hidden): the graph order and inductor's lowering-time decisions are used here. Inductor's
scheduler then fuses kernels (dropping a buffer only they share) and reorders them (``reorder_for_peak_memory``;
on the CPU it moves the extraction of convolution weight gradients to the end of the backward, so that each
``convolution_backward`` keeps its input gradient alive until then): neither is modelled, and the backward is
where the prediction misses (measured on an H100: ``docs/preflight_error_table.md``). The CUDA graphs of
``mode="reduce-overhead"`` and the channels-last copies of layout optimisation (which inductor turns off for these
UNets) are not modelled. Gradient checkpointing inside a compiled model is not traced here
(:class:`CompiledTraceError`): the caller falls back to the eager prediction, an upper bound.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, fx, nn

from voxdiff.models import checkpointed_modules
from voxdiff.preflight.tracker import BLOCK_BYTES, round_block
from voxdiff.preflight.world import CudaAutocastEmulator, flash_backward_temporary_bytes

__all__ = [
    "EXTERN_OPS",
    "CompiledModule",
    "CompiledProfile",
    "CompiledTraceError",
    "GraphPlan",
    "InductorRules",
    "cache_dir",
    "compiled_profile",
    "plan_graph",
    "trace_compiled",
]

aten = torch.ops.aten
prims = torch.ops.prims

EXTERN_OPS: frozenset[Any] = frozenset({
    aten.convolution.default, aten.convolution_backward.default, aten.mm.default, aten.addmm.default,
    aten.bmm.default, aten.baddbmm.default, aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
})  # fmt: skip
"""Ops inductor runs as extern kernels (cuDNN/cuBLAS/attention libraries): their outputs are buffers and their
inputs must be buffers."""

_FLASH_BACKWARD = frozenset({
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
})  # fmt: skip
"""Flash-attention backward ops: on the GPU, FlashAttention-2's backward holds fp32 temporaries while it runs."""

_FUSIBLE_NON_POINTWISE = frozenset({
    aten.full.default, aten.scalar_tensor.default, prims.iota.default, aten._unsafe_index.Tensor,
    aten.index.Tensor, aten.constant_pad_nd.default, aten.gather.default,
})  # fmt: skip
"""Ops without the ``pointwise`` tag that inductor lowers as pointwise loops (constants, gathers, padding)."""

_MUTATES_FIRST_INPUT = frozenset({
    aten.index_put.default, aten._unsafe_index_put.default, aten.scatter_add.default,
})  # fmt: skip
"""Functional scatters that inductor runs in place on their (realised) first input."""

_VIEW_OPS_WITHOUT_TAG = frozenset({aten._unsafe_view.default})

_HEAVY_CPU_OPS = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})


class CompiledTraceError(RuntimeError):
    """The compiled model could not be traced; the message says why (the caller falls back to eager)."""


@dataclass(frozen=True)
class InductorRules:
    """Inductor's lowering-time realisation thresholds (``torch._inductor.config``) for one device kind.

    Attributes:
        device: ``cuda`` (the GPU the preflight predicts) or ``cpu`` (to check against a real CPU compile).
        reads_threshold: ``realize_reads_threshold``: a pointwise result used more than once is materialised when
            it reads more buffers than this.
        opcount_threshold: ``realize_opcount_threshold`` (30 on GPU, ``realize_cpu_opcount_threshold`` 50 on CPU):
            a pointwise body with more ops is materialised.
        acc_reads_threshold: ``realize_acc_reads_threshold`` (8 on GPU, 12 on CPU): a pointwise body reading more
            buffers is materialised even when used once.
        heavy_ops_realise_on_reuse: CPU only: a result used more than once whose body has ``exp``, ``log``,
            ``sigmoid``, ``tanh``... is materialised (``StorageBox.should_realize_on_reuse``).
        granularity: allocation rounding in bytes (the CUDA caching allocator's 512; 1 for the CPU allocator).
        convolution_fixes_layout: whether a convolution reading a pointwise result fixes its layout, so that
            the result is copied into a concatenation instead of written into it: where inductor's layout
            optimisation (channels-last convolutions) is off. ``GraphLowering.decide_layout_opt`` turns it off on
            the GPU for a UNet (its convolutions over concatenations have twice as many input as output channels);
            on the CPU it is on with mkldnn, unless ``torch._inductor.config.layout_optimization`` is False. The
            channels-last copies of layout optimisation are not modelled.
    """

    device: str
    reads_threshold: int
    opcount_threshold: int
    acc_reads_threshold: int
    heavy_ops_realise_on_reuse: bool
    granularity: int
    convolution_fixes_layout: bool

    @classmethod
    def for_device(cls, device: str) -> InductorRules:
        """The rules of ``torch._inductor.config`` as installed, for ``cuda`` or ``cpu``."""
        from torch._inductor import config as ic

        cpu = device == "cpu"
        opcount = ic.realize_opcount_threshold
        if opcount is None:
            opcount = ic.realize_cpu_opcount_threshold if cpu else ic._realize_opcount_threshold_default
        acc = ic.realize_acc_reads_threshold
        if acc is None:
            acc = ic.realize_cpu_acc_reads_threshold if cpu else ic._realize_acc_reads_threshold_default
        fixes = not (cpu and ic.layout_optimization and torch.backends.mkldnn.is_available())
        return cls(device, ic.realize_reads_threshold, opcount, acc, cpu, 1 if cpu else BLOCK_BYTES, fixes)


# ------------------------------------------------------------------------------------------------------------
# tracing
# ------------------------------------------------------------------------------------------------------------


class _Partitioned(Exception):
    """Raised from the partition hook once both graphs are in hand: nothing is compiled or run."""


def trace_compiled(
    model: nn.Module,
    inputs: Sequence[tuple[tuple[int, ...], torch.dtype]],
    autocast_dtype: torch.dtype | None,
) -> tuple[fx.GraphModule, fx.GraphModule, int, dict[str, int]]:
    """The forward and backward graphs inductor would compile for ``model``'s training forward.

    Args:
        model: the model, its parameters and buffers on the ``meta`` device; called as ``model(*inputs)``.
        inputs: ``(shape, dtype)`` of each positional input (e.g. ``x (B, C, d, h, w)`` fp32, ``t (B,)`` int64).
        autocast_dtype: the dtype of the (emulated CUDA) autocast region around the call, None for fp32.

    Returns:
        ``(forward graph, backward graph, number of parameters, calls)``: the graphs' leading inputs are the
        trainable parameters in ``model.named_parameters()`` order, then the inputs; ``calls`` counts the
        functions the model called (``scaled_dot_product_attention``, ``softmax``, ...).

    Raises:
        CompiledTraceError: the model is gradient-checkpointed, or AOTAutograd or the partitioner failed.
    """
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    if checkpointed_modules(model):
        raise CompiledTraceError("gradient checkpointing inside a compiled model is not traced")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    convert = mode.fake_tensor_converter

    def fake(t: Tensor) -> Tensor:
        out = convert.from_meta_and_device(mode, t.detach(), torch.device("cpu"))
        return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out

    params = [fake(p) for _, p in named]
    others = {n: fake(t) for n, t in [*frozen.items(), *model.named_buffers()]}
    with mode:
        args = [torch.empty(shape, dtype=dtype) for shape, dtype in inputs]
    names = [n for n, _ in named]
    autocast = CudaAutocastEmulator(autocast_dtype or torch.bfloat16, device_type="cpu",
                                    enabled=autocast_dtype is not None)

    calls: dict[str, int] = {}

    def forward(*flat: Tensor) -> Tensor:
        state = {**dict(zip(names, flat[: len(names)])), **others}
        with autocast.region():
            out = torch.func.functional_call(model, state, tuple(flat[len(names):]))
        if not calls:  # AOTAutograd runs the function more than once: count one call of the model
            calls.update(autocast.calls)
        return out

    graphs: list[fx.GraphModule] = []

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        # dynamo marks a module's parameters as static inputs; inductor's partitioner saves them for free
        kwargs["static_lifetime_input_indices"] = list(range(len(params)))
        graphs.extend(partition_fn(joint, joint_inputs, **kwargs))
        raise _Partitioned

    compiled = aot_function(forward, fw_compiler=_never, bw_compiler=_never, partition_fn=partition,
                            decompositions=select_decomp_table(), num_params_buffers=len(params))
    try:
        with autocast:
            compiled(*params, *args)
    except _Partitioned:
        pass
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes a fallback with its reason
        raise CompiledTraceError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    if len(graphs) != 2:
        raise CompiledTraceError("AOTAutograd produced no backward graph (no parameter needs a gradient?)")
    return graphs[0], graphs[1], len(params), calls


def _never(gm: fx.GraphModule, example_inputs: Any) -> Any:
    raise AssertionError("trace_compiled compiles nothing")


# ------------------------------------------------------------------------------------------------------------
# liveness of the buffers inductor materialises
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphPlan:
    """The buffers of one compiled graph, in execution order. Bytes are rounded as the CUDA allocator rounds.

    Attributes:
        events: ``(+1, name, bytes)`` when the kernel producing buffer ``name`` runs, ``(-1, name, bytes)`` after
            its last reader; owned inputs appear only with ``-1``.
        outputs: per graph output, the buffer it lives in: a buffer name, ``input:<placeholder>`` for a graph
            input returned as is, or None for a non-tensor output.
        layouts: ``name -> (shape, dtype)`` of buffers that are graph outputs (the rest are opaque bytes).
        sizes: ``name -> bytes`` of every buffer and owned input.
        start: bytes of the owned inputs when the graph starts.
        peak: the highest live bytes (owned inputs included) while the graph runs.
    """

    events: tuple[tuple[int, str, int], ...]
    outputs: tuple[str | None, ...]
    layouts: dict[str, tuple[tuple[int, ...], torch.dtype]]
    sizes: dict[str, int]
    start: int
    peak: int


def _flat_nodes(arg: Any) -> list[fx.Node | None]:
    if isinstance(arg, fx.Node):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [n for a in arg for n in _flat_nodes(a)]
    return [None]


def _nbytes(val: Any, granularity: int = BLOCK_BYTES) -> int:
    """Bytes of a freshly allocated (dense) tensor like ``val``, rounded up to ``granularity``."""
    return round_block(val.numel() * val.element_size(), granularity) if isinstance(val, Tensor) else 0


def _kind(node: fx.Node) -> str:
    if node.op != "call_function":
        return node.op
    target = node.target
    if target is operator.getitem:
        return "item"
    if target in EXTERN_OPS:
        return "extern"
    if getattr(target, "is_view", False) or target in _VIEW_OPS_WITHOUT_TAG:
        return "view"
    if target in _MUTATES_FIRST_INPUT:
        return "scatter"
    tags = getattr(target, "tags", ())
    if torch.Tag.reduction in tags:
        return "reduction"
    if torch.Tag.pointwise in tags or target in _FUSIBLE_NON_POINTWISE:
        return "pointwise"
    return "other"


def _users_through_views(node: fx.Node, kind: dict[fx.Node, str]) -> list[fx.Node]:
    """The users of ``node``, looking through views of it."""
    out: list[fx.Node] = []
    for u in node.users:
        out += _users_through_views(u, kind) if kind.get(u) == "view" else [u]
    return out


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def plan_graph(
    gm: fx.GraphModule,
    rules: InductorRules,
    owned_inputs: dict[str, str] | None = None,
    input_sizes: dict[str, int] | None = None,
) -> GraphPlan:
    """Simulate the buffers of ``gm`` as inductor would allocate and free them.

    A node is a buffer when inductor materialises it:

    * extern kernels (:data:`EXTERN_OPS`), reductions, scatters and every op it does not lower as a pointwise
      loop: always (each output of a multi-output op is a buffer);
    * a pointwise result (``pointwise``-tagged ops, constants, gathers): when it is a graph output, when an
      extern kernel, a scatter or a non-pointwise op reads it (through views), and where inductor's lowering
      realises it (:class:`InductorRules`): used more than once with more than ``reads_threshold`` buffer reads
      or a body of more than ``opcount_threshold`` ops (on the CPU also with a heavy op in it), or reading more
      than ``acc_reads_threshold`` buffers. Otherwise it is fused into every kernel that reads it, which then
      reads the buffers it reads.

    Views alias their base. A concatenation's pointwise inputs are written into its output (inductor's
    ``ConcatKernel``), which then exists from the first of them on, unless an extern kernel reads that input
    (:attr:`InductorRules.convolution_fixes_layout`). A pointwise kernel whose output has the size of a buffer it
    made earlier that dies there writes into it (``inplace_buffers``; inputs of the graph are not reused), and a
    scatter works in place on its first input. The outputs of a multi-output kernel appear together, before its
    inputs are freed. FlashAttention-2's backward adds its fp32 temporaries on the GPU
    (:func:`~voxdiff.preflight.world.flash_backward_temporary_bytes`).

    Args:
        gm: a forward or backward graph of :func:`trace_compiled` (nodes carry ``meta["val"]``).
        rules: the device's realisation thresholds.
        owned_inputs: placeholders whose memory the graph releases after their last use (the saved tensors of a
            backward), mapped to the buffer they live in (aliases of one buffer share it).
        input_sizes: bytes of those buffers (default: the placeholder's own size).

    Returns:
        A :class:`GraphPlan`.
    """
    owned_inputs = owned_inputs or {}
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    out_node = nodes[-1]
    kind = {n: _kind(n) for n in nodes}

    # ---- which nodes need a buffer because of who reads them
    needs_buffer: set[fx.Node] = set()

    def base(n: fx.Node) -> fx.Node:
        while kind[n] == "view":
            n = n.args[0]
        return n

    for n in nodes:
        if kind[n] in ("extern", "other", "scatter"):
            needs_buffer.update(base(a) for a in n.all_input_nodes)
    graph_outputs = [n for n in _flat_nodes(out_node.args[0]) if n is not None]
    needs_buffer.update(base(n) for n in graph_outputs)

    # ---- concatenation: inductor's ConcatKernel has a pointwise input written straight into its slice of the
    # output (``NonOwningLayout``) unless an extern kernel also reads that input (its layout is then fixed and
    # the input is copied); the output buffer exists from the first such input on
    concat_into: dict[fx.Node, fx.Node] = {}

    def fixes_layout(user: fx.Node) -> bool:
        return kind[user] == "extern" and (rules.convolution_fixes_layout or user.target is not aten.convolution.default)

    for n in nodes:
        if n.target is aten.cat.default:
            for a in n.args[0]:
                if (isinstance(a, fx.Node) and kind[a] == "pointwise" and a not in concat_into
                        and a.meta["val"].dtype == n.meta["val"].dtype
                        and not any(fixes_layout(u) for u in _users_through_views(a, kind))):
                    concat_into[a] = n

    # ---- decide, in order, what is a buffer; a fused node's reads are the buffers its chain reads
    root: dict[fx.Node, str | None] = {}  # node -> buffer it lives in (None: fused, recomputed by its readers)
    reads: dict[fx.Node, frozenset[str]] = {}
    ops: dict[fx.Node, frozenset[fx.Node]] = {}
    heavy: dict[fx.Node, bool] = {}

    def reads_through(n: fx.Node) -> tuple[frozenset[str], frozenset[fx.Node], bool]:
        """The buffers ``n``'s kernel body reads, the ops in it (``n`` and the fused producers it inlines, each
        once) and whether one of them is heavy."""
        buffers: set[str] = set()
        body, has_heavy = {n}, _op_name(n) in _HEAVY_CPU_OPS
        for a in n.all_input_nodes:
            if root.get(a) is None and a in reads:  # fused producer: its reads and ops become ours
                buffers |= reads[a]
                body |= ops[a]
                has_heavy |= heavy[a]
            elif root.get(a) is not None:
                buffers.add(root[a])  # type: ignore[arg-type]
        return frozenset(buffers), frozenset(body), has_heavy

    for n in nodes:
        k = kind[n]
        if k == "output":
            continue
        if k == "placeholder":
            root[n] = owned_inputs.get(n.name, f"input:{n.name}")
            continue
        if k == "get_attr":  # a constant of the graph (e.g. a folded arange): not allocated by the step
            root[n] = f"const:{n.name}"
            continue
        if k == "view":
            src = n.args[0]
            root[n] = root.get(src)
            if root[n] is None:  # a view of a fused result is fused too
                reads[n], ops[n], heavy[n] = reads_through(n)
            continue
        r, body, h = reads_through(n)
        c = len(body)
        if k in ("extern", "other", "reduction", "scatter", "item"):
            root[n] = n.name
        else:  # pointwise
            users = len(n.users)
            realise = (
                n in needs_buffer
                or c > 100
                or (users > 1 and (len(r) > rules.reads_threshold or c > rules.opcount_threshold
                                   or (rules.heavy_ops_realise_on_reuse and h)))
                or (len(r) > 1 and (len(r) > rules.acc_reads_threshold or c > rules.opcount_threshold))
            )  # fmt: skip
            root[n] = (concat_into[n].name if n in concat_into else n.name) if realise else None
        if root[n] is None:
            reads[n], ops[n], heavy[n] = r, body, h
        else:
            reads[n], ops[n], heavy[n] = r, frozenset({n}), False
            reads[n] = r  # the kernel's own reads
    # multi-output containers: their items are the buffers; the container itself allocates nothing
    containers = {n for n in nodes if isinstance(n.meta.get("val"), (tuple, list)) and kind[n] != "output"}

    # ---- last reader of every buffer
    position = {n: i for i, n in enumerate(nodes)}
    last: dict[str, int] = {}
    for n in nodes:
        if kind[n] in ("output", "placeholder", "get_attr", "view", "item") or root.get(n) is None:
            continue
        for b in reads[n]:
            last[b] = max(last.get(b, -1), position[n])
    end = len(nodes)
    outputs: list[str | None] = []
    layouts: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for o in _flat_nodes(out_node.args[0]):
        if o is None or not isinstance(o.meta.get("val"), Tensor):
            outputs.append(None)
            continue
        b = root.get(o)
        if b is None:  # cannot happen: outputs need buffers
            raise AssertionError(f"graph output {o.name} has no buffer")
        outputs.append(b)
        last[b] = end
        val = o.meta["val"]
        if b not in layouts and not b.startswith(("input:", "const:")) and (
            b == o.name or _nbytes(val, 1) == _nbytes(by_name[b].meta.get("val"), 1)
        ):
            layouts[b] = (tuple(val.shape), val.dtype)  # allocated in the layout it is returned in

    # ---- replay
    owned = set(owned_inputs.values())  # freed after their last use, never written over (not donated)
    sizes: dict[str, int] = {}
    for name, buf in owned_inputs.items():
        sizes[buf] = (input_sizes or {}).get(buf, _nbytes(by_name[name].meta.get("val"), rules.granularity))
    live = start = sum(sizes.values())
    peak = live
    events: list[tuple[int, str, int]] = []
    frees: dict[int, list[str]] = defaultdict(list)
    for b, p in last.items():
        frees[p].append(b)
    alive: dict[str, int] = dict(sizes)
    for i, n in enumerate(nodes):
        if n.op == "output":
            break
        if n in containers:  # a multi-output kernel: its outputs appear together, before its inputs are freed
            produced = [u for u in n.users if kind[u] == "item" and root.get(u) == u.name]
        elif n in concat_into or n.target is aten.cat.default:  # the concatenation's buffer, if not there yet
            cat = concat_into.get(n, n)
            produced = [cat] if cat.name not in sizes else []
        elif root.get(n) == n.name and kind[n] not in ("placeholder", "item"):
            produced = [n]
        else:
            produced = []
        for m in produced:
            nbytes = _nbytes(m.meta.get("val"), rules.granularity)
            donor = None
            if kind[m] == "scatter":
                src = root.get(m.args[0])
                donor = src if src is not None and last.get(src) == i and src in alive else None
            elif kind[m] == "pointwise":
                donor = next((b for b in sorted(reads[m]) if last.get(b) == i and alive.get(b) == nbytes
                              and b not in layouts and b not in owned), None)  # fmt: skip
            if donor is not None:  # written in place: the donor's block carries on under the new name
                events += [(-1, donor, alive[donor]), (1, m.name, alive[donor])]
                sizes[m.name] = alive.pop(donor)
                alive[m.name] = sizes[m.name]
            else:
                sizes[m.name] = nbytes
                alive[m.name] = nbytes
                live += nbytes
                events.append((1, m.name, nbytes))
                peak = max(peak, live)
            if m.name not in last:  # nobody reads it
                last[m.name] = i
                frees[i].append(m.name)
        if n.target in _FLASH_BACKWARD and rules.device == "cuda":
            tmp = round_block(flash_backward_temporary_bytes(n.args[1].meta["val"]), rules.granularity)
            peak = max(peak, live + tmp)
            events += [(1, f"{n.name}:tmp", tmp), (-1, f"{n.name}:tmp", tmp)]
        for b in frees.get(i, ()):
            nbytes = alive.pop(b, None)
            if nbytes is not None:
                live -= nbytes
                events.append((-1, b, nbytes))
    return GraphPlan(tuple(events), tuple(outputs), layouts, sizes, start, peak)


# ------------------------------------------------------------------------------------------------------------
# the profile of a compiled model, and its stand-in in the eager trace
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompiledProfile:
    """What a compiled model allocates in its forward and backward (see :func:`compiled_profile`).

    Attributes:
        forward: the forward graph's plan; its first output is the model output, the rest are saved for backward.
        backward: the backward graph's plan, its owned inputs being the saved buffers; its outputs are the
            gradients of the parameters, then of the inputs.
        saved_inputs: names of forward inputs (``input:<placeholder>``) the backward reads, by position:
            ``input_index -> buffer name``; the stand-in keeps those inputs alive until their last use.
        n_params: number of trainable parameters (the graphs' leading inputs).
        input_layouts: ``(shape, dtype)`` of the model inputs the profile was traced for.
        calls: functions the model called while traced (``scaled_dot_product_attention``, ``softmax``, ...).
    """

    forward: GraphPlan
    backward: GraphPlan
    saved_inputs: dict[int, str]
    n_params: int
    input_layouts: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    calls: dict[str, int]

    def attention_path(self, attention: str) -> str:
        """What the compiled model does with attention (``attention`` is the requested SDPA behaviour)."""
        sdpa, softmax = self.calls.get("scaled_dot_product_attention", 0), self.calls.get("softmax", 0)
        parts = []
        if sdpa:
            parts.append(f"{'flash' if attention == 'flash' else 'SDPA'} ({sdpa} SDPA calls, compiled)")
        if softmax:
            parts.append(f"materialised scores ({softmax} softmax calls, compiled)")
        return ", ".join(parts) if parts else "none"


def _profile(fw: fx.GraphModule, bw: fx.GraphModule, n_params: int, rules: InductorRules,
             input_layouts: tuple[tuple[tuple[int, ...], torch.dtype], ...], calls: dict[str, int]) -> CompiledProfile:
    forward = plan_graph(fw, rules)
    fw_roots = {}  # forward output name -> buffer
    for o, buf in zip(_flat_nodes(list(fw.graph.nodes)[-1].args[0]), forward.outputs):
        if o is not None and buf is not None:
            fw_roots[o.name] = buf
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    input_index = {f"input:{n.name}": i - n_params for i, n in enumerate(placeholders) if i >= n_params}
    owned: dict[str, str] = {}
    saved_inputs: dict[int, str] = {}
    for n in bw.graph.nodes:
        if n.op != "placeholder" or n.name not in fw_roots:
            continue  # tangents, and parameters saved as they are (alive anyway)
        buf = fw_roots[n.name]
        if buf.startswith("input:"):
            if buf not in input_index:
                continue  # a parameter
            saved_inputs[input_index[buf]] = buf
        owned[n.name] = buf
    sizes = {buf: forward.sizes.get(buf, 0) for buf in owned.values()}
    for i, buf in saved_inputs.items():
        shape, dtype = input_layouts[i]
        sizes[buf] = round_block(torch.Size(shape).numel() * dtype.itemsize, rules.granularity)
    backward = plan_graph(bw, rules, owned, sizes)
    return CompiledProfile(forward, backward, saved_inputs, n_params, input_layouts, calls)


_PROFILES: dict[str, CompiledProfile] = {}
_SOURCE_HASH = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _model_key(model: nn.Module, input_layouts: Any, autocast_dtype: Any, device: str) -> str:
    """What a profile depends on: the model's structure and parameters, its inputs, the precision, the device's
    rules, the torch version and this module's own source."""
    h = hashlib.sha256()
    h.update(repr(model).encode())
    for name, module in model.named_modules():  # settings a repr does not show (e.g. use_flash_attention)
        plain = {k: v for k, v in vars(module).items() if isinstance(v, (bool, int, float, str, type(None), tuple))}
        h.update(f"{name}{type(module).__qualname__}{sorted(plain.items(), key=lambda kv: kv[0])}".encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{name}{tuple(t.shape)}{t.dtype}{t.requires_grad}".encode())
    h.update(f"{input_layouts}{autocast_dtype}{InductorRules.for_device(device)}{torch.__version__}".encode())
    h.update(_SOURCE_HASH.encode())
    return h.hexdigest()


def cache_dir() -> Path:
    """Where compiled profiles are kept between runs: ``$VOXDIFF_CACHE_DIR``, else ``$XDG_CACHE_HOME/voxdiff``,
    else ``~/.cache/voxdiff``; in its ``preflight-compiled`` folder."""
    root = os.environ.get("VOXDIFF_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "voxdiff"
    return Path(root) / "preflight-compiled"


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _plan_to_json(plan: GraphPlan) -> dict[str, Any]:
    return {"events": plan.events, "outputs": plan.outputs, "sizes": plan.sizes, "start": plan.start,
            "peak": plan.peak, "layouts": {k: [list(s), str(d)] for k, (s, d) in plan.layouts.items()}}


def _plan_from_json(d: dict[str, Any]) -> GraphPlan:
    return GraphPlan(tuple((int(a), str(b), int(c)) for a, b, c in d["events"]), tuple(d["outputs"]),
                     {k: (tuple(s), _dtype(t)) for k, (s, t) in d["layouts"].items()}, dict(d["sizes"]),
                     int(d["start"]), int(d["peak"]))


def _save(path: Path, profile: CompiledProfile) -> None:
    data = {"forward": _plan_to_json(profile.forward), "backward": _plan_to_json(profile.backward),
            "saved_inputs": profile.saved_inputs, "n_params": profile.n_params, "calls": profile.calls,
            "input_layouts": [[list(s), str(d)] for s, d in profile.input_layouts]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:  # a read-only or full disk costs a new trace next time, nothing else
        pass


def _load(path: Path) -> CompiledProfile | None:
    try:
        d = json.loads(path.read_text())
        return CompiledProfile(_plan_from_json(d["forward"]), _plan_from_json(d["backward"]),
                               {int(k): v for k, v in d["saved_inputs"].items()}, int(d["n_params"]),
                               tuple((tuple(s), _dtype(t)) for s, t in d["input_layouts"]), dict(d["calls"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent or unreadable: trace again


def compiled_profile(
    model: nn.Module,
    inputs: Sequence[tuple[tuple[int, ...], torch.dtype]],
    autocast_dtype: torch.dtype | None,
    device: str = "cuda",
) -> CompiledProfile:
    """Trace (:func:`trace_compiled`) and plan (:func:`plan_graph`) ``model`` compiled by inductor for ``device``
    (``cuda``: the GPU the preflight predicts; ``cpu``: inductor's CPU rules, to check against a CPU compile).

    A trace takes seconds to tens of seconds for a large UNet on a CPU, so profiles are kept per model structure,
    input layouts, precision, device, torch version and version of this module: in the process, and as JSON in
    :func:`cache_dir` (a later ``preflight.py`` or ``train.py`` on the same configuration reads it back).

    Raises:
        CompiledTraceError: see :func:`trace_compiled`.
    """
    layouts = tuple((tuple(int(s) for s in shape), dtype) for shape, dtype in inputs)
    key = _model_key(model, layouts, autocast_dtype, device)
    if key not in _PROFILES:
        path = cache_dir() / f"{key}.json"
        profile = _load(path)
        if profile is None:
            fw, bw, n_params, calls = trace_compiled(model, layouts, autocast_dtype)
            profile = _profile(fw, bw, n_params, InductorRules.for_device(device), layouts, calls)
            _save(path, profile)
        _PROFILES[key] = profile
    return _PROFILES[key]


def _replay(events: Iterable[tuple[int, str, int]], held: dict[str, Tensor], layouts: dict[str, Any],
            device: torch.device) -> None:
    """Allocate and free, on ``device``, what a plan's events say; graph outputs get their real layout."""
    for sign, name, nbytes in events:
        if sign < 0:
            held.pop(name, None)
        elif name in layouts:
            shape, dtype = layouts[name]
            held[name] = torch.empty(shape, dtype=dtype, device=device)
        else:
            held[name] = torch.empty(nbytes, dtype=torch.uint8, device=device)


class _CompiledMemory(torch.autograd.Function):
    """The compiled model's forward and backward as allocations only (values are meaningless)."""

    @staticmethod
    def forward(ctx: Any, profile: CompiledProfile, *args: Tensor) -> Tensor:  # type: ignore[override]
        params, inputs = args[: profile.n_params], args[profile.n_params:]
        device = inputs[0].device
        held: dict[str, Tensor] = {}
        _replay(profile.forward.events, held, profile.forward.layouts, device)
        out_name = profile.forward.outputs[0]
        out = held.pop(out_name)  # type: ignore[arg-type]
        ctx.profile, ctx.device = profile, device
        ctx.held = held  # the saved buffers, until the backward frees them
        for i, buf in profile.saved_inputs.items():
            held[buf] = inputs[i]  # an input the backward reads stays alive with it
        ctx.n_inputs = len(inputs)
        ctx.params = [(tuple(p.shape), p.dtype) for p in params]
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        profile: CompiledProfile = ctx.profile
        held: dict[str, Tensor] = ctx.held
        ctx.held = {}
        _replay(profile.backward.events, held, profile.backward.layouts, ctx.device)
        grads = [held.get(buf) if buf is not None else None for buf in profile.backward.outputs[: profile.n_params]]
        held.clear()
        return (None, *grads, *([None] * ctx.n_inputs))


class CompiledModule(nn.Module):
    """Stands in for ``torch.compile(model)`` in a traced training step: same parameters, and a forward/backward
    that allocate on the meta device what inductor's compiled graphs allocate (:class:`CompiledProfile`).

    Args:
        model: the eager model (its parameters are this module's).
        profile: the compiled profile of ``model`` for the inputs it will be called with.
    """

    def __init__(self, model: nn.Module, profile: CompiledProfile) -> None:
        super().__init__()
        self.model = model
        self.profile = profile
        self.out_channels = getattr(model, "out_channels", None)

    def forward(self, *inputs: Tensor, **kwargs: Tensor) -> Tensor:
        args = (*inputs, *kwargs.values())
        got = tuple((tuple(a.shape), a.dtype) for a in args)
        if got != self.profile.input_layouts:
            raise CompiledTraceError(f"the compiled profile was traced for inputs {self.profile.input_layouts}, "
                                     f"the step calls the model with {got}")
        params = [p for p in self.model.parameters() if p.requires_grad]
        return _CompiledMemory.apply(self.profile, *params, *args)
