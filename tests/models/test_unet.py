import pytest
import torch
from monai.networks.nets import DiffusionModelUNet

from voxdiff.encodings import HaarWavelet, SpaceToDepth, VQVAELatent
from voxdiff.errors import ConfigError
from voxdiff.models import build_unet, build_unet_from_spec, count_parameters, unet_io_channels


def _params(**kw) -> float:
    with torch.device("meta"):
        return count_parameters(build_unet(**kw)) / 1e6


# the parameter counts that the measured table (shared/reference) reports for MONAI's UNet
@pytest.mark.parametrize(
    "kw,expected_m",
    [
        (dict(channels=[64, 128, 256, 512], attention_levels=[False, False, True, True], in_channels=8,
              out_channels=4, num_head_channels=64), 166.6),
        (dict(channels=[256, 512, 1024, 2048], attention_levels=[False, False, True, True], in_channels=8,
              out_channels=4, num_head_channels=64), 2664.6),
        (dict(channels=[512, 1024, 2048], attention_levels=[False, True, True], in_channels=8, out_channels=4,
              num_head_channels=64), 2662.8),
        (dict(channels=[32, 64, 256, 512, 512], attention_levels=[False, False, False, True, True],
              in_channels=16, out_channels=8, num_head_channels=32), 270.75),
    ],
)
def test_parameter_counts_match_measured_table(kw, expected_m):
    assert _params(num_res_blocks=2, **kw) == pytest.approx(expected_m, abs=0.05)


def test_factory_builds_monai_unet_that_runs():
    model = build_unet(in_channels=2, out_channels=1, channels=[8, 16], attention_levels=[False, True],
                       num_res_blocks=1, num_head_channels=8, norm_num_groups=8)
    assert isinstance(model, DiffusionModelUNet)
    out = model(torch.randn(2, 2, 4, 4, 4), torch.tensor([1, 500]))
    assert out.shape == (2, 1, 4, 4, 4)


@pytest.mark.parametrize(
    "encoding,mode,expected",
    [(SpaceToDepth(2), "bravo", (16, 8)), (HaarWavelet(), "bravo", (16, 8)), (VQVAELatent(4, 4), "bravo", (8, 4)),
     (SpaceToDepth(2), "seg", (8, 8))],
)
def test_io_channels_follow_encoding_and_mode(encoding, mode, expected):
    assert unet_io_channels(encoding, mode) == expected


def test_unknown_mode():
    with pytest.raises(ConfigError, match="mode=bravo"):
        unet_io_channels(SpaceToDepth(2), "image")


BASE = dict(in_channels=16, out_channels=8, channels=[32, 64, 128], attention_levels=[False, True, True],
            num_res_blocks=2, num_head_channels=32, norm_num_groups=32)


# one case per validation rule: (override, key named in the message, a fragment of the fix)
@pytest.mark.parametrize(
    "override,key,fix",
    [
        (dict(channels=[64]), "model.channels", "at least two levels"),
        (dict(channels=[32, -64, 128]), "model.channels", "positive integer"),
        (dict(attention_levels=[False, True]), "model.attention_levels", "one entry per level (3)"),
        (dict(attention_levels=[0, 1, 1]), "model.attention_levels", "true or false"),
        (dict(num_res_blocks=[2, 2]), "model.num_res_blocks", "one entry per level (3)"),
        (dict(num_res_blocks=0), "model.num_res_blocks", "positive integer"),
        (dict(norm_num_groups=24), "model.norm_num_groups", "model.norm_num_groups=32"),
        (dict(channels=[48, 64, 128], num_head_channels=48, norm_num_groups=16), "model.num_head_channels",
         "attention_levels[1]=false"),
        (dict(num_head_channels=[32, 32]), "model.num_head_channels", "one entry per level"),
        (dict(gradient_checkpointing="all"), "model.gradient_checkpointing", "none, block, layer"),
        (dict(use_flash_attention="yes"), "model.use_flash_attention", "use model.use_flash_attention=auto"),
        (dict(compile="yes"), "model.compile", "use model.compile=auto"),
        (dict(compile_mode="fastest"), "model.compile_mode", "max-autotune"),
        (dict(compile_mode="max-autotune", compile_backend="aot_eager"), "model.compile_mode", "compile_mode=null"),
        (dict(compile_backend="tensorrt-ish"), "model.compile_backend", "inductor"),
        (dict(in_channels=0), "model.in_channels", "follows from the encoding"),
    ],
)
def test_invalid_arguments_fail_at_build_time_naming_key_value_fix(override, key, fix):
    with pytest.raises(ConfigError) as err:
        build_unet(**{**BASE, **override})
    msg = str(err.value)
    assert msg.startswith(key + "="), msg
    assert fix in msg, msg
    assert "Fix:" in msg


def test_group_norm_message_names_offending_channel():
    with pytest.raises(ConfigError, match=r"48 \(in model.channels=\[48, 64, 128\]\) is not"):
        build_unet(**{**BASE, "channels": [48, 64, 128]})


def test_middle_block_attention_head_size_checked_even_without_attention_levels():
    # MONAI's middle block always has attention over channels[-1]: 96 channels in heads of 64 cannot work
    with pytest.raises(ConfigError, match="middle block always has attention over the last level's 96 channels"):
        build_unet(**{**BASE, "channels": [32, 64, 96], "attention_levels": [False, False, False],
                      "num_head_channels": 64})


def test_a_channels_last_unet_keeps_that_layout_and_computes_what_the_contiguous_one_does():
    """``model.channels_last=true``: the convolution weights and the input are channels-last (the input converted at
    every call, whatever layout it comes in), the output and the gradients are those of the contiguous model with the
    same weights, and the state dict is the same (a checkpoint loads either way)."""
    kw = dict(in_channels=2, out_channels=2, channels=[8, 16], attention_levels=[False, True], num_res_blocks=1,
              num_head_channels=8, norm_num_groups=4)
    torch.manual_seed(0)
    plain = build_unet(**kw)
    for p in plain.parameters():  # MONAI zero-initialises output convs: perturb so that every path carries signal
        p.data.add_(0.05 * torch.randn_like(p))
    last = build_unet(**kw, channels_last=True)
    last.load_state_dict(plain.state_dict())
    layout = torch.channels_last_3d
    weights = [p for p in last.parameters() if p.dim() == 5]
    assert all(p.is_contiguous(memory_format=layout) for p in weights)
    assert any(not p.is_contiguous() for p in weights)  # (a 1x1x1 kernel is contiguous in both layouts)
    assert all(p.is_contiguous() for p in plain.parameters())
    seen = []
    last.conv_in.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous(memory_format=layout)))
    x, t = torch.randn(2, 2, 8, 8, 8), torch.tensor([3, 700])
    outs, grads = [], []
    for model in (plain, last):
        out = model(x, t)
        out.square().mean().backward()
        outs.append(out)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert seen == [True] and x.is_contiguous()  # converted for the model, the caller's tensor untouched
    assert outs[1].shape == outs[0].shape and outs[1].is_contiguous(memory_format=layout)
    # equal up to the order of float sums (the kernels differ by layout): 1e-5 of the largest value
    assert (outs[1] - outs[0]).abs().max() <= 1e-5 * outs[0].abs().max()
    assert (grads[1] - grads[0]).abs().max() <= 1e-5 * grads[0].abs().max()
    assert not torch.equal(outs[0], torch.zeros_like(outs[0]))
    assert list(last.state_dict()) == list(plain.state_dict())
    with pytest.raises(ConfigError, match=r"model.channels_last=yes: must be true, false or auto. Fix: use "
                       r"model.channels_last=auto \(on for a compiled CUDA run"):
        build_unet(**kw, channels_last="yes")


@pytest.mark.parametrize("value,device,compiled,flat,want", [
    ("auto", "cuda", True, False, True),  # a compiled GPU run: channels-last (measured faster)
    ("auto", "cuda", False, False, False),  # eager on a GPU: unmeasured
    ("auto", "cpu", True, False, False),  # a CPU: slower (oneDNN picks its own layouts)
    ("auto", "cuda", True, True, False),  # FSDP flattens the weights
    (True, "cpu", False, False, True), (False, "cuda", True, False, False),  # as given
])
def test_channels_last_auto_is_on_for_a_compiled_gpu_run_only(value, device, compiled, flat, want):
    """``model.channels_last=auto`` resolves in one place, for the run's device, compile and strategy; the spec of a
    config resolves it with the rest (``model_spec``), and a model is not built with it unresolved."""
    from voxdiff.models.unet import resolve_channels_last, unet_spec

    assert resolve_channels_last(value, device, compiled, flat) is want
    spec = unet_spec(in_channels=2, out_channels=2, channels=[8, 16], attention_levels=[False, True],
                     num_res_blocks=1, num_head_channels=8, norm_num_groups=4, compile=compiled, channels_last=value)
    assert spec.resolved is (value != "auto")
    assert spec.for_device(device, flat_weights=flat).channels_last is want
    if value == "auto":
        with pytest.raises(ValueError, match="model.channels_last=auto needs the device the model runs on"):
            build_unet_from_spec(spec)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_sdpa_attention_matches_the_materialised_path(dtype, tol):
    """``use_flash_attention=True`` (MONAI's ``F.scaled_dot_product_attention`` path, flash on a GPU) computes the
    same function as the materialised scores: same weights, same output and gradients within the dtype's rounding.
    """
    kw = dict(in_channels=2, out_channels=2, channels=[8, 16], attention_levels=[True, True], num_res_blocks=1,
              num_head_channels=4, norm_num_groups=4)
    torch.manual_seed(0)
    plain = build_unet(**kw, use_flash_attention=False)
    sdpa = build_unet(**kw, use_flash_attention=True)
    sdpa.load_state_dict(plain.state_dict())
    for p in plain.parameters():  # MONAI zero-initialises output convs: perturb so that every path carries signal
        p.data.add_(0.05 * torch.randn_like(p))
    sdpa.load_state_dict(plain.state_dict())
    x, t = torch.randn(2, 2, 8, 8, 8), torch.tensor([3, 700])
    outs, grads = [], []
    for model in (plain, sdpa):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = model(x, t)
        out.float().square().mean().backward()
        outs.append(out.float())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    scale = outs[0].abs().max()
    assert (outs[0] - outs[1]).abs().max() <= tol * scale
    assert (grads[0] - grads[1]).abs().max() <= tol * grads[0].abs().max()
    assert not torch.equal(outs[0], torch.zeros_like(outs[0]))


def test_auto_switches_are_decided_by_the_device_the_model_runs_on():
    """``use_flash_attention`` and ``compile``: ``auto`` is on for a CUDA run and off on the CPU; true and false
    stay what they say; a model is not built while a switch is still ``auto``."""
    from monai.networks.blocks.selfattention import SABlock

    from voxdiff.models import unet_spec
    from voxdiff.models.unet import build_unet_from_spec

    def flags(model):
        return {m.use_flash_attention for m in model.modules() if isinstance(m, SABlock)}

    kw = {**BASE, "in_channels": 2, "out_channels": 2}
    auto = unet_spec(**kw, use_flash_attention="auto", compile="auto")
    assert (auto.for_device("cuda").use_flash_attention, auto.for_device("cuda").compile) == (True, True)
    assert (auto.for_device("cpu").use_flash_attention, auto.for_device("cpu").compile) == (False, False)
    forced = unet_spec(**kw, use_flash_attention=True, compile=False, compile_mode="max-autotune")
    assert forced.for_device("cpu").use_flash_attention is True and forced.for_device("cuda").compile is False
    with torch.device("meta"):
        assert flags(build_unet_from_spec(auto, device_type="cuda")) == {True}
        assert flags(build_unet_from_spec(auto, device_type="cpu")) == {False}
        with pytest.raises(ValueError, match="device"):
            build_unet_from_spec(auto)


def test_every_reference_row_round_trips_through_the_spec(h100_csv):
    """UNetSpec.from_row reads each row of reference/h100_measured.csv; to_row writes the same cells back (the head
    size per level, in full) and from_row reads those to an equal spec."""
    import csv

    from voxdiff.models import ROW_COLUMNS, UNetSpec

    rows = list(csv.DictReader(open(h100_csv, newline="")))
    assert len(rows) == 113
    for row in rows:
        spec = UNetSpec.from_row(row)
        written = spec.to_row()
        assert UNetSpec.from_row(written) == spec, row["name"]
        assert written["num_head_channels"] == " ".join([row["num_head_channels"]] * spec.levels)
        same = [c for c in ROW_COLUMNS if c in row and c != "num_head_channels"]
        assert {c: written[c] for c in same} == {c: row[c] for c in same}, row["name"]


def test_row_format_keeps_what_the_reference_cannot_say():
    """Per-level head sizes, the block granularity and SDPA attention survive a round trip; an unresolved switch
    has no row value."""
    from voxdiff.models import UNetSpec, unet_spec

    spec = unet_spec(16, 8, [32, 64, 128], [False, True, True], [1, 2, 2], [8, 16, 32], 8, True, "block")
    row = spec.to_row()
    assert row["num_head_channels"] == "8 16 32" and row["grad_checkpointing"] == "block"
    assert row["use_flash_attention"] == "1" and UNetSpec.from_row(row) == spec
    layer = UNetSpec.from_row({**row, "grad_checkpointing": "1"})  # the reference's 1: per resnet/attention block
    assert layer.gradient_checkpointing == "layer" and layer.to_row()["grad_checkpointing"] == "1"
    with pytest.raises(ValueError, match="use_flash_attention=auto"):
        unet_spec(16, 8, [32, 64], [False, True], use_flash_attention="auto").to_row()
    with pytest.raises(ConfigError, match="norm_num_groups"):
        UNetSpec.from_row({**row, "channels": "30 64 128"})


def test_an_input_the_unet_cannot_take_is_refused():
    from voxdiff.models import unet_spec

    spec = unet_spec(16, 8, [32, 64, 128], [False, False, True])
    spec.check_input((1, 16, 8, 12, 16))
    with pytest.raises(ConfigError, match=r"input_shape=\[1, 16, 8, 10, 16\]: spatial size \(8, 10, 16\) is not "
                                          r"divisible by 2\*\*\(levels-1\)=4"):
        spec.check_input((1, 16, 8, 10, 16))
    with pytest.raises(ConfigError, match="has 8 channels but in_channels=16"):
        spec.check_input((1, 8, 8, 8, 8))


def test_an_auto_compile_mode_takes_cuda_graphs_on_one_gpu_only():
    """``compile_mode=auto``: ``reduce-overhead`` (CUDA graphs) on a CUDA run that can replay them, torch's default
    mode (None) on the CPU, on a run that cannot, and with a backend other than inductor; a named mode stays."""
    from voxdiff.models import unet_spec

    kw = {**BASE, "in_channels": 2, "out_channels": 2, "compile": "auto"}
    auto = unet_spec(**kw, compile_mode="auto")
    assert not auto.resolved
    assert auto.for_device("cuda").compile_mode == "reduce-overhead" and auto.for_device("cuda").cuda_graphs
    assert auto.for_device("cuda").resolved
    assert auto.for_device("cuda", cuda_graphs=False).compile_mode is None
    assert auto.for_device("cpu").compile_mode is None and not auto.for_device("cpu").cuda_graphs
    assert unet_spec(**kw, compile_mode="auto", compile_backend="aot_eager").for_device("cuda").compile_mode is None
    named = unet_spec(**kw, compile_mode="max-autotune-no-cudagraphs")
    assert named.for_device("cuda").compile_mode == "max-autotune-no-cudagraphs"
    assert not named.for_device("cuda").cuda_graphs
    assert not unet_spec(**{**kw, "compile": False}, compile_mode="auto").for_device("cuda").cuda_graphs
