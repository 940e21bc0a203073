"""The covariate embedding in MONAI's ``DiffusionModelUNet``: where it sits, what it costs, that it changes the
prediction, that it is refused without its input; and the measurement that chose it over cross-attention."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from monai.networks.nets import DiffusionModelUNet

from voxdiff.models.covariates import CovariateEmbedding
from voxdiff.models.unet import build_unet_from_spec, count_parameters, unet_spec

SPEC = unet_spec(16, 8, [16, 16, 32], [False, False, True], 1, 16, 8)


def test_the_embedding_sits_in_monais_class_slot_and_moves_the_prediction() -> None:
    torch.manual_seed(0)
    plain = build_unet_from_spec(SPEC)
    torch.manual_seed(0)
    model = build_unet_from_spec(replace(SPEC, covariate_dim=4))
    e = 4 * 16  # MONAI's time-embedding width: 4 * channels[0]
    assert isinstance(model.class_embedding, CovariateEmbedding)
    assert count_parameters(model) - count_parameters(plain) == 4 * e + e + e * e + e
    assert {k for k in model.state_dict() if k not in plain.state_dict()} == {
        "class_embedding.mlp.0.weight", "class_embedding.mlp.0.bias", "class_embedding.mlp.2.weight",
        "class_embedding.mlp.2.bias"}
    with torch.no_grad():  # MONAI zero-initialises each block's last convolution and the output: as if trained
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.05)
    x, t = torch.randn(2, 16, 8, 8, 8), torch.tensor([10, 500])
    a = model(x, timesteps=t, class_labels=torch.tensor([[1.0, 0, 1, 1], [1.0, 0, 1, 1]]))
    b = model(x, timesteps=t, class_labels=torch.tensor([[-1.0, 1, 0, 1], [1.0, 0, 1, 1]]))
    assert a.shape == (2, 8, 8, 8, 8)
    assert not torch.allclose(a[0], b[0]) and torch.allclose(a[1], b[1])  # per sample
    with pytest.raises(ValueError, match="class_labels should be provided"):
        model(x, timesteps=t)
    with pytest.raises(ValueError, match=r"covariates must be \(B, 4\)"):
        model(x, timesteps=t, class_labels=torch.zeros(2, 3))


def test_the_embedding_costs_less_than_cross_attention_for_the_same_covariates() -> None:
    """Why an embedding and not MONAI's cross-attention context: for 4 covariates on the demo's UNet the embedding
    adds K·E + E² + 2E parameters and no activation beyond (B, E), the context a key/value projection and a
    transformer per attention block."""
    kwargs = dict(spatial_dims=3, in_channels=16, out_channels=8, channels=(32, 64, 128),
                  attention_levels=(False, False, True), num_res_blocks=2, num_head_channels=32, norm_num_groups=8)
    with torch.device("meta"):
        plain = count_parameters(DiffusionModelUNet(**kwargs))
        embedded = count_parameters(build_unet_from_spec(replace(unet_spec(16, 8, [32, 64, 128], [False, False, True],
                                                                           2, 32, 8), covariate_dim=4)))
        attended = count_parameters(DiffusionModelUNet(**kwargs, with_conditioning=True, cross_attention_dim=4))
    assert embedded - plain == 4 * 128 + 128 + 128 * 128 + 128
    assert attended - plain > embedded - plain
