import copy
import re

import pytest
import torch

from voxdiff.errors import ConfigError
from voxdiff.models import apply_gradient_checkpointing, build_unet, checkpointed_modules
from voxdiff.models.checkpointing import remove_gradient_checkpointing

SMALL = dict(in_channels=2, out_channels=1, channels=[16, 32, 32], attention_levels=[False, False, True],
             num_res_blocks=1, num_head_channels=16, norm_num_groups=8)
FIVE_LEVEL = dict(in_channels=16, out_channels=8, channels=[16, 32, 64, 64, 64],
                  attention_levels=[False, False, False, True, True], num_res_blocks=2, num_head_channels=16,
                  norm_num_groups=8)


def _pair(granularity, kw=SMALL):
    torch.manual_seed(0)
    ref = build_unet(**kw)
    with torch.no_grad():  # MONAI zero-initialises the last conv; make gradients flow everywhere
        ref.out[2].conv.weight.normal_(std=0.1)
    ckpt = build_unet(**kw, gradient_checkpointing=granularity)
    ckpt.load_state_dict(ref.state_dict())
    return ref, ckpt


@pytest.mark.parametrize("granularity", ["block", "layer"])
def test_outputs_and_gradients_equal_uncheckpointed(granularity):
    ref, ckpt = _pair(granularity)
    x, t = torch.randn(2, 2, 8, 8, 8), torch.tensor([3, 700])
    out_ref, out_ckpt = ref(x, t), ckpt(x, t)
    torch.testing.assert_close(out_ckpt, out_ref, rtol=0, atol=0)
    out_ref.square().mean().backward()
    out_ckpt.square().mean().backward()
    for (name, p_ref), p_ckpt in zip(ref.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p_ckpt.grad, p_ref.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_granularities_select_the_promised_modules():
    model = build_unet(**SMALL)
    blocks = apply_gradient_checkpointing(model, "block")
    assert blocks == ["down_blocks.0", "down_blocks.1", "down_blocks.2", "middle_block", "up_blocks.0",
                      "up_blocks.1", "up_blocks.2"]
    layers = apply_gradient_checkpointing(model, "layer")  # replaces the block policy
    assert checkpointed_modules(model) == layers
    assert all(re.search(r"(resnets|attentions)\.\d+$|resnet_[12]$|attention$", n) for n in layers), layers
    # every resnet (3 levels x 1 down + 3 levels x 2 up + 2 mid) and attention (1 down + 2 up + 1 mid)
    assert len(layers) == (3 + 6 + 2) + (1 + 2 + 1)
    remove_gradient_checkpointing(model)
    assert checkpointed_modules(model) == []
    assert "forward" not in model.down_blocks[0].resnets[0].__dict__


def _saved_bytes(model, x, t):
    """Bytes of the distinct storages autograd saves for backward during one forward."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x, t)
    return sum(storages.values())


def test_saved_bytes_fall_for_a_5_level_model():
    x, t = torch.randn(1, 16, 32, 32, 32), torch.tensor([10])
    saved = {}
    for granularity in ("none", "block", "layer"):
        torch.manual_seed(0)
        saved[granularity] = _saved_bytes(build_unet(**FIVE_LEVEL, gradient_checkpointing=granularity), x, t)
    # stated factors: per-layer checkpointing keeps at most 1/3 of what autograd saves without it; per-block
    # at most 1/10 (the segment inputs a checkpoint keeps are not "saved tensors", so this measure favours
    # coarse segments; the preflight's traced peak measures both).
    assert saved["layer"] * 3 <= saved["none"]
    assert saved["block"] * 10 <= saved["none"]


def test_inactive_without_gradients(monkeypatch):
    import voxdiff.models.checkpointing as policy

    _, ckpt = _pair("layer")
    x, t = torch.randn(1, 2, 8, 8, 8), torch.tensor([5])
    calls = []
    original = policy.checkpoint
    monkeypatch.setattr(policy, "checkpoint", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        ckpt(x, t)
    assert calls == []
    ckpt(x, t)
    assert len(calls) == len(checkpointed_modules(ckpt))


def test_deepcopy_keeps_policy_bound_to_the_copy():
    _, ckpt = _pair("block")
    clone = copy.deepcopy(ckpt)
    assert clone.down_blocks[0].forward.__self__ is clone.down_blocks[0]
    assert checkpointed_modules(clone) == checkpointed_modules(ckpt)


def test_state_dict_keys_unchanged():
    ref, ckpt = _pair("layer")
    assert list(ref.state_dict()) == list(ckpt.state_dict())


def test_unknown_granularity_and_unsupported_model():
    with pytest.raises(ConfigError, match="model.gradient_checkpointing=everything"):
        apply_gradient_checkpointing(build_unet(**SMALL), "everything")
    with pytest.raises(ConfigError, match="supports MONAI's DiffusionModelUNet"):
        apply_gradient_checkpointing(torch.nn.Linear(2, 2), "layer")
