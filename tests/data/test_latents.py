"""The latent cache: round trip through the stage-1 decoder, refusal of stale caches, the split, the masks."""

import json
import shutil

import pytest
import torch
from voxdiff.data import PhantomDataset, VolumeDataModule
from voxdiff.data.latents import (
    INDEX_NAME,
    LatentDataModule,
    check_latent_cache,
    pack_mask,
    unpack_mask,
    write_latent_cache,
)
from voxdiff.encodings import LearnedEncoding, SpaceToDepth, VQVAELatent
from voxdiff.encodings.vqvae import read_stage1_checkpoint
from voxdiff.errors import ConfigError
from voxdiff.lightning.vqvae import VQVAESystem

SHAPE = (16, 32, 32)


def make_stage1_checkpoint(path, factor=4, seed=0, scale=2.5):
    """A stage-1 checkpoint as Lightning writes it (state_dict + hyper_parameters), codebook started from data."""
    torch.manual_seed(seed)
    levels = factor.bit_length() - 1
    system = VQVAESystem(vqvae=dict(factor=factor, latent_channels=4, channels=[8] * levels, num_res_layers=1,
                                    num_embeddings=16), volume_shape=list(SHAPE))
    image = PhantomDataset(SHAPE, 1, seed_offset=seed)[0]["image"][None]
    with torch.no_grad():
        system._init_codebook(system.vqvae.encode(image))
    system.latent_scale.fill_(scale)
    torch.save({"state_dict": system.state_dict(), "hyper_parameters": dict(system.hparams)}, path)
    return path


@pytest.fixture(scope="module")
def phantoms():
    return PhantomDataset(SHAPE, 4, cache=True)


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    return make_stage1_checkpoint(tmp_path_factory.mktemp("stage1") / "a.ckpt")


@pytest.fixture(scope="module")
def cache(tmp_path_factory, stage1, phantoms):
    out = tmp_path_factory.mktemp("cache") / "latents"
    write_latent_cache(VQVAELatent(4, 4, checkpoint=str(stage1)), phantoms, out, SHAPE, batch_size=2)
    return out


def _module(cache, ckpt, **kw):
    args = dict(latent_dir=cache and str(cache), volume_shape=list(SHAPE), stage1_checkpoint=ckpt and str(ckpt),
                factor=4,
                latent_channels=4, val_fraction=0.25, split_seed=0, batch_size=2)
    return LatentDataModule(**{**args, **kw})


def test_pack_mask_round_trip():
    mask = (torch.rand(1, 5, 7, 9) > 0.7).float()  # 315 voxels: not a multiple of 8
    bits = pack_mask(mask)
    assert bits.dtype == torch.uint8 and bits.numel() == 40
    assert torch.equal(unpack_mask(bits, (5, 7, 9)), mask)


def test_cache_round_trips_through_the_stage1_decoder(cache, stage1, phantoms):
    """decode(cached latent) == decode(quantize(encode(x))) of a fresh encode of the same volume."""
    from voxdiff.encodings.vqvae import build_vqvae

    index = json.loads((cache / INDEX_NAME).read_text())
    s1 = read_stage1_checkpoint(stage1)
    ae = build_vqvae(s1.spec)
    ae.load_state_dict(s1.state)
    ae.eval()
    encoding = VQVAELatent(4, 4, checkpoint=str(stage1))
    assert index["scale_factor"] == pytest.approx(2.5) and index["latent_shape"] == [4, 4, 8, 8]
    for sample in phantoms:
        record = torch.load(cache / index["subjects"][sample["subject"]], weights_only=True)
        for key in ("image", "mask"):
            x = sample[key][None]
            with torch.no_grad():
                q, _ = ae.quantize(ae.encode(x))
                fresh = ae.decode(q)
                codes = ae.index_quantize(x)
            cached = record[f"{key}_z"][None]
            assert cached.shape == (1, 4, 4, 8, 8)
            torch.testing.assert_close(cached, 2.5 * q, rtol=0, atol=1e-6)  # quantised latents, scaled
            assert torch.equal(ae.quantizer.quantize(cached / 2.5), codes)  # same codes
            torch.testing.assert_close(encoding.decode(cached), fresh, rtol=0, atol=1e-5)
        assert torch.equal(unpack_mask(record["mask_bits"], SHAPE), sample["mask"])
        assert torch.equal(record["affine"], sample["affine"])
    assert set(index["subjects"]) == {s["subject"] for s in phantoms}
    assert index["stage1"]["sha256"] == s1.sha256


def test_datamodule_batches_and_split(cache, stage1):
    dm = _module(cache, stage1)
    volumes = VolumeDataModule(list(SHAPE), num_subjects=4, val_fraction=0.25, split_seed=0)
    assert dm.val_subjects == volumes.val_subjects and dm.train_subjects == volumes.train_subjects
    train = next(iter(dm.train_dataloader()))
    assert set(train) == {"image_z", "mask_z", "mask", "subject", "affine"}  # no image: it is not stored
    assert train["image_z"].shape == train["mask_z"].shape == (2, 4, 4, 8, 8)
    val = next(iter(dm.val_dataloader()))
    assert val["mask"].shape == (1, 1, *SHAPE)  # the system samples from validation masks
    assert val["affine"].dtype == torch.float64
    latents_only = _module(cache, stage1, masks=False)
    assert "mask" not in next(iter(latents_only.val_dataloader()))


def test_cache_of_another_checkpoint_is_refused(cache, stage1, tmp_path):
    other = make_stage1_checkpoint(tmp_path / "b.ckpt", seed=1)
    with pytest.raises(ConfigError) as e:
        _module(cache, other)
    message = str(e.value)
    assert str(cache) in message and "another stage-1 checkpoint" in message
    assert str(stage1.resolve()) in message  # who made it
    assert f"python cache_latents.py stage1_ckpt={other} out={cache}" in message  # the fix


def test_same_weights_in_another_file_are_accepted(cache, stage1, tmp_path):
    copy = tmp_path / "copy.ckpt"
    shutil.copy(stage1, copy)
    assert _module(cache, copy).index["stage1"]["checkpoint"] == str(stage1.resolve())


def test_cache_of_another_volume_shape_is_refused(cache, stage1):
    with pytest.raises(ConfigError) as e:
        _module(cache, stage1, volume_shape=[32, 32, 32])
    message = str(e.value)
    assert str(cache) in message and "[16, 32, 32]" in message and "[32, 32, 32]" in message
    assert "python cache_latents.py" in message and "data.volume_shape=[32,32,32]" in message


def test_cache_of_another_factor_is_refused(cache, stage1):
    with pytest.raises(ConfigError, match="factor 4, but encoding.factor is 8"):
        check_latent_cache(cache, SHAPE, str(stage1), 8, 4)


def test_missing_checkpoint_names_the_one_that_made_the_cache(cache, stage1, tmp_path):
    with pytest.raises(ConfigError) as e:
        _module(cache, None)
    assert e.value.key == "encoding.checkpoint" and str(stage1.resolve()) in str(e.value)
    with pytest.raises(ConfigError) as e:
        _module(cache, tmp_path / "gone.ckpt")
    assert e.value.key == "encoding.checkpoint" and "no such file" in str(e.value)


def test_no_cache_and_an_interrupted_cache_say_how_to_make_one(stage1, phantoms, tmp_path):
    with pytest.raises(ConfigError, match="data.latent_dir=null.*python cache_latents.py"):
        _module(None, stage1)

    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            if i == 1:
                raise OSError("disk gone")
            return phantoms[i]

    out = tmp_path / "interrupted"
    with pytest.raises(OSError):
        write_latent_cache(VQVAELatent(4, 4, checkpoint=str(stage1)), Broken(), out, SHAPE)
    assert (out / "latents").is_dir() and not (out / INDEX_NAME).exists()
    with pytest.raises(ConfigError, match="no latent cache there.*python cache_latents.py"):
        _module(out, stage1)


def test_a_cache_written_before_the_index_named_its_encoding_is_still_checked(cache, stage1, tmp_path):
    """An index without ``encoding`` (written by main before it was recorded) is a VQ-VAE cache: accepted with its
    own weights, refused with others."""
    old = tmp_path / "old"
    shutil.copytree(cache, old)
    index = json.loads((old / INDEX_NAME).read_text())
    assert index.pop("encoding") == "voxdiff.encodings.vqvae.VQVAELatent"
    (old / INDEX_NAME).write_text(json.dumps(index))
    assert check_latent_cache(old, SHAPE, str(stage1), 4, 4)["stage1"]["sha256"] == index["stage1"]["sha256"]
    with pytest.raises(ConfigError, match="another stage-1 checkpoint"):
        check_latent_cache(old, SHAPE, str(make_stage1_checkpoint(tmp_path / "b.ckpt", seed=1)), 4, 4)


class Gain(LearnedEncoding):
    """A learned encoding that is not the VQ-VAE: its weights are one gain per output channel, in a file.

    ``(B, C, D, H, W)`` → ``(B, 2C, D/2, H/2, W/2)``: the mean and the max of each 2×2×2 block, times the gains.
    """

    factor = 2

    def __init__(self, checkpoint: str | None = None) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.gain: torch.Tensor | None = None

    @classmethod
    def from_weights(cls, path, key="encoding.checkpoint"):
        return cls(str(path))

    @property
    def weights_path(self):
        return self.checkpoint

    def load_weights(self, path=None):
        self.checkpoint = str(path or self.checkpoint)
        self.gain = torch.load(self.checkpoint, weights_only=True)["gain"]
        return self

    @property
    def weights_identity(self):
        import hashlib

        return hashlib.sha256(torch.load(self.checkpoint, weights_only=True)["gain"].numpy().tobytes()).hexdigest()

    @property
    def latent_scale(self):
        return 0.5

    def encoded_channels(self, in_channels):
        return 2 * in_channels

    def encode(self, x):
        self._check_input(x)
        if self.gain is None:
            self.load_weights()
        pooled = torch.cat([torch.nn.functional.avg_pool3d(x, 2), torch.nn.functional.max_pool3d(x, 2)], dim=1)
        return pooled * self.gain.view(1, -1, 1, 1, 1) * self.latent_scale

    def decode(self, z):
        return torch.nn.functional.interpolate(z[:, :1] / self.gain[0] / self.latent_scale, scale_factor=2)


def test_the_cache_takes_any_learned_encoding_through_the_protocol(phantoms, tmp_path, monkeypatch):
    """write_latent_cache and the cache check use only LearnedEncoding: a learned encoding of another module writes
    a cache that is accepted with its weights and refused with other weights."""
    import sys
    import types

    module = types.ModuleType("voxdiff.encodings.gain")
    monkeypatch.setattr(Gain, "__module__", module.__name__)
    module.Gain = Gain
    monkeypatch.setitem(sys.modules, module.__name__, module)
    weights, other = tmp_path / "gain.pt", tmp_path / "other.pt"
    torch.save({"gain": torch.tensor([2.0, 3.0])}, weights)
    torch.save({"gain": torch.tensor([2.0, 4.0])}, other)
    index = write_latent_cache(Gain(str(weights)), phantoms, tmp_path / "cache", SHAPE)
    assert index["encoding"] == "voxdiff.encodings.gain.Gain" and index["latent_shape"] == [2, 8, 16, 16]
    assert index["factor"] == 2 and index["latent_channels"] == 2 and index["scale_factor"] == 0.5
    assert index["stage1"] == {"checkpoint": str(weights.resolve()), "sha256": Gain(str(weights)).weights_identity}
    record = torch.load(tmp_path / "cache" / index["subjects"][phantoms[0]["subject"]], weights_only=True)
    torch.testing.assert_close(record["image_z"][None], Gain(str(weights)).encode(phantoms[0]["image"][None]))
    dm = _module(tmp_path / "cache", weights, factor=2, latent_channels=2)
    assert next(iter(dm.train_dataloader()))["image_z"].shape == (2, 2, 8, 16, 16)
    with pytest.raises(ConfigError, match="made by another stage-1 checkpoint"):
        _module(tmp_path / "cache", other, factor=2, latent_channels=2)


def test_a_weight_free_encoding_is_refused_by_the_cache_writer(phantoms, tmp_path):
    with pytest.raises(TypeError, match="needs a LearnedEncoding .* got SpaceToDepth, which is weight-free"):
        write_latent_cache(SpaceToDepth(2), phantoms, tmp_path / "cache", SHAPE)


# ------------------------------------------------------------------ a cache reads only the files inside itself (#29)


def _leaving(cache, tmp_path, how):
    """A copy of ``cache`` whose first index entry leaves the folder ``how``; returns (copy, subject, entry)."""
    copy, outside = tmp_path / "cache", tmp_path / "outside"
    shutil.copytree(cache, copy)
    outside.mkdir()
    index = json.loads((copy / INDEX_NAME).read_text())
    subject, rel = next(iter(index["subjects"].items()))
    shutil.copy(copy / rel, outside / "x.pt")  # a valid latent file, so only where it is can be refused
    entry = {"absolute": str(outside / "x.pt"), "dotdot": "../outside/x.pt", "symlink": "latents/link.pt",
             "symlinked folder": "linked/x.pt"}[how]
    if how == "symlink":
        (copy / "latents" / "link.pt").symlink_to(outside / "x.pt")
    if how == "symlinked folder":
        (copy / "linked").symlink_to(outside, target_is_directory=True)
    index["subjects"][subject] = entry
    (copy / INDEX_NAME).write_text(json.dumps(index))
    return copy, subject, entry


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink", "symlinked folder"])
def test_an_index_entry_that_leaves_the_cache_is_refused(cache, stage1, tmp_path, how):
    copy, subject, entry = _leaving(cache, tmp_path, how)
    with pytest.raises(ConfigError) as e:
        _module(copy, stage1)
    message = str(e.value)
    assert e.value.key == "data.latent_dir" and e.value.value == str(copy)
    assert str(copy / INDEX_NAME) in message and repr(subject) in message and repr(entry) in message
    assert "python cache_latents.py" in e.value.fix


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_a_dataset_never_reads_a_file_outside_its_cache(cache, tmp_path, how):
    """The dataset checks each file again when it reads it (a link made after the cache was checked)."""
    from voxdiff.data.latents import LatentDataset

    copy, subject, entry = _leaving(cache, tmp_path, how)
    dataset = LatentDataset(copy, json.loads((copy / INDEX_NAME).read_text()), [subject])
    with pytest.raises(ConfigError) as e:
        dataset[0]
    assert e.value.key == "data.latent_dir" and repr(entry) in str(e.value)


def test_the_cache_writer_names_its_files_inside_the_cache(stage1, phantoms, tmp_path):
    """Index entries are names relative to the cache folder, whatever the subjects are called."""
    from pathlib import Path, PurePosixPath

    class Hostile(torch.utils.data.Dataset):
        names = ("../../evil", "/etc/passwd", "a/../../b")

        def __len__(self):
            return len(self.names)

        def __getitem__(self, i):
            return {**phantoms[i], "subject": self.names[i]}

    out = tmp_path / "cache"
    index = write_latent_cache(VQVAELatent(4, 4, checkpoint=str(stage1)), Hostile(), out, SHAPE)
    assert set(index["subjects"]) == set(Hostile.names)
    for rel in index["subjects"].values():
        path = PurePosixPath(rel)
        assert not path.is_absolute() and ".." not in path.parts and path.parts[0] == "latents", rel
        assert (out / rel).resolve().parent == (out / "latents").resolve()
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["cache"]
    assert len(_module(out, stage1).train_subjects) == 2


def test_drop_last_leaves_out_the_smaller_training_batch(cache, stage1):
    """4 cached subjects: 3 train, 1 validates. At batch 2 the training loader gives one whole batch with
    drop_last (one shape for a compiled step), two without; batch 4 with it is refused."""
    assert [len(b["subject"]) for b in _module(cache, stage1, drop_last=True).train_dataloader()] == [2]
    assert sorted(len(b["subject"]) for b in _module(cache, stage1).train_dataloader()) == [1, 2]
    with pytest.raises(ConfigError, match=r"data.batch_size=4: is more than the 3 training subjects"):
        _module(cache, stage1, batch_size=4, drop_last=True)
