"""Feature extractors: a seeded random network, MedicalNet weights from a checked file (never downloaded), the
project's VQ-VAE encoder."""

import pytest
import torch
from voxdiff.errors import ConfigError
from voxdiff.evaluation.features import (
    MedicalNetFeatures,
    RandomResNetFeatures,
    VQVAEFeatures,
    _resnet,
    build_extractors,
    file_sha256,
)

VOLUMES = torch.rand(2, 1, 16, 16, 16, generator=torch.Generator().manual_seed(0))


def test_random_features_are_fixed_by_the_seed_and_leave_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b, c = RandomResNetFeatures(0), RandomResNetFeatures(0), RandomResNetFeatures(1)
    assert torch.equal(torch.random.get_rng_state(), state)
    fa = a(VOLUMES)
    assert fa.shape == (2, 512) and fa.dtype == torch.float64
    torch.testing.assert_close(fa, b(VOLUMES))
    assert not torch.equal(a.network.conv1.weight, c.network.conv1.weight)
    assert "not comparable" in a.label and not a.comparable


@pytest.fixture(scope="module")
def medicalnet_file(tmp_path_factory):
    """A file in MedicalNet's release layout: DataParallel 'module.' names and a segmentation head."""
    torch.manual_seed(5)
    net = _resnet(10)
    state = {f"module.{k}": v for k, v in net.state_dict().items()}
    state["module.conv_seg.0.weight"] = torch.zeros(2, 512, 1, 1, 1)
    path = tmp_path_factory.mktemp("medicalnet") / "resnet_10.pth"
    torch.save({"state_dict": state}, path)
    return path, net.eval()


def test_medicalnet_weights_load_from_a_checked_file(medicalnet_file):
    path, reference = medicalnet_file
    f = MedicalNetFeatures(path, file_sha256(path), depth=10)
    assert f.comparable and f.name == "medicalnet_resnet10"
    with torch.no_grad():
        expected = reference(f.preprocess(VOLUMES)).double()
    torch.testing.assert_close(f(VOLUMES), expected)
    raw = MedicalNetFeatures(path, file_sha256(path), depth=10, zscore=False)  # WDM feeds [0, 1] volumes
    assert torch.equal(raw.preprocess(VOLUMES), VOLUMES) and not torch.allclose(raw(VOLUMES), f(VOLUMES))


@pytest.mark.parametrize("change, key", [("sha", "medicalnet.sha256"), ("depth", "medicalnet.depth"),
                                         ("arch", "medicalnet.weights"), ("missing", "medicalnet.weights")])
def test_medicalnet_refuses_what_it_cannot_trust(medicalnet_file, tmp_path, change, key):
    path, _ = medicalnet_file
    sha, depth = file_sha256(path), 10
    if change == "sha":
        sha = "0" * 64
    elif change == "depth":
        depth = 11
    elif change == "arch":
        depth = 50  # a ResNet-10 file is not a ResNet-50
    else:
        path = tmp_path / "absent.pth"
    with pytest.raises(ConfigError) as e:
        MedicalNetFeatures(path, sha, depth=depth)
    assert e.value.key == key


def test_absent_extractors_say_why():
    extractors, absent = build_extractors(0, None, {"weights": None})
    assert [e.name for e in extractors] == ["random_resnet10"]
    assert "never downloads" in absent["medicalnet"] and "stage1_ckpt" in absent["vqvae_encoder"]


def test_vqvae_encoder_features_from_a_stage1_checkpoint(tmp_path):
    from voxdiff.lightning.vqvae import VQVAESystem

    torch.manual_seed(0)
    system = VQVAESystem(vqvae={"factor": 4, "latent_channels": 3, "channels": [4, 6], "num_res_layers": 1,
                                "num_res_channels": 4, "num_embeddings": 8}, volume_shape=[16, 16, 16])
    path = tmp_path / "stage1.ckpt"
    torch.save({"hyper_parameters": dict(system.hparams), "state_dict": system.state_dict()}, path)
    f = VQVAEFeatures(path)
    feats = f(VOLUMES)
    # every encoder block pooled: per level a stride-2 conv and a residual unit (4, 4, 6, 6), then the latents (3)
    assert feats.shape == (2, 4 + 4 + 6 + 6 + 3)
    assert torch.isfinite(feats).all() and not torch.allclose(feats[0], feats[1])
    assert "not comparable" in f.label
