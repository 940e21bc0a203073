"""Stage 1: the VQ-VAE system's shapes from the real configs, its validation, MONAI's checkpointing, training."""

import math

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from voxdiff.config import compose
from voxdiff.data import VolumeDataModule
from voxdiff.encodings import VQVAELatent
from voxdiff.encodings.vqvae import build_vqvae, read_stage1_checkpoint, vqvae_spec, weights_sha256
from voxdiff.errors import ConfigError
from voxdiff.lightning.vqvae import VQVAESystem

TINY = dict(factor=4, latent_channels=4, channels=[8, 16], num_res_layers=1, num_embeddings=32)


@pytest.mark.parametrize("experiment,issue_shape", [("vqvae_4x", (4, 40, 64, 64)), ("vqvae_8x", (4, 20, 32, 32))])
def test_latent_shapes_of_the_issue_experiments(experiment, issue_shape):
    """160x256x256 through the experiment's real encoder (built on meta) gives the issue's latent shapes."""
    cfg = compose("train", [f"experiment={experiment}"])
    assert list(cfg.data.volume_shape) == [160, 256, 256]
    with torch.device("meta"):
        system = instantiate(cfg.system)
        x = torch.empty(1, 1, *cfg.data.volume_shape)
        z = system.vqvae.encoder(x)  # (1, latent_channels, d, h, w)
        y = system.vqvae.decoder(z)
    assert tuple(z.shape[1:]) == issue_shape
    assert tuple(y.shape) == tuple(x.shape)
    assert VQVAELatent(cfg.encoding.factor, cfg.encoding.latent_channels).encoded_shape((1, 160, 256, 256)) == \
        tuple(z.shape[1:])
    assert system.spec.use_checkpoint is True and system.vqvae.use_checkpointing is True  # on for GPU experiments


def test_architecture_errors_name_the_key_and_the_fix():
    with pytest.raises(ConfigError) as e:
        vqvae_spec(**{**TINY, "factor": 8})
    assert e.value.key == "system.vqvae.channels" and "3 stride-2 levels" in str(e.value)
    assert "give 3 channel counts" in str(e.value)
    with pytest.raises(ConfigError, match="system.vqvae.factor=6"):
        vqvae_spec(**{**TINY, "factor": 6})
    with pytest.raises(ConfigError, match="system.vqvae.decay=1.0"):
        vqvae_spec(**{**TINY, "decay": 1.0})
    with pytest.raises(ConfigError, match="system.vqvae.num_res_channels"):
        vqvae_spec(**{**TINY, "num_res_channels": [8]})
    with pytest.raises(ConfigError, match=r"system.vqvae.channels=\[8, x\]: must be a list of positive integers"):
        vqvae_spec(**{**TINY, "channels": [8, "x"]})
    with pytest.raises(ConfigError, match="system.vqvae.use_checkpoint"):
        vqvae_spec(**{**TINY, "use_checkpoint": "yes"})
    with pytest.raises(ConfigError, match="system.loss.reconstruction=huber"):
        VQVAESystem(vqvae=TINY, loss={"reconstruction": "huber"})
    with pytest.raises(ConfigError, match="system.optim.lr"):
        VQVAESystem(vqvae=TINY, optim={"lr": -1.0})
    with pytest.raises(ConfigError, match="the depth 18 is not divisible by the VQ-VAE factor 4"):
        VQVAESystem(vqvae=TINY, volume_shape=[18, 32, 32])


def _saved_bytes(model, x):
    """Bytes autograd keeps for backward during one forward, and the loss."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        recon, vq_loss = model(x)
        loss = (recon - x).abs().mean() + vq_loss
    return total, loss


def test_monai_use_checkpoint_really_saves_activations():
    """system.vqvae.use_checkpoint=true → MONAI's use_checkpointing: same outputs and gradients, fewer saved bytes."""
    x = torch.rand(2, 1, 16, 32, 32)
    results = {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = build_vqvae(vqvae_spec(**{**TINY, "use_checkpoint": flag})).eval()  # eval: no codebook update
        saved, loss = _saved_bytes(model, x)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results[flag] = (saved, loss.detach(), grads)
    assert results[True][0] < 0.2 * results[False][0], results
    torch.testing.assert_close(results[True][1], results[False][1])
    for a, b in zip(results[True][2], results[False][2]):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_training_improves_reconstruction_psnr(tmp_path):
    """A short training run on the demo phantom: validation PSNR rises; scale, montage and checkpoint are right."""
    L.seed_everything(0)
    data = VolumeDataModule([16, 32, 32], num_subjects=6, val_fraction=0.34, batch_size=2)
    system = VQVAESystem(vqvae={**TINY, "decay": 0.9}, optim={"lr": 1e-3}, volume_shape=[16, 32, 32])
    trainer = L.Trainer(max_steps=60, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        check_val_every_n_epoch=30, default_root_dir=tmp_path)
    before = trainer.validate(system, datamodule=data, verbose=False)[0]
    trainer.fit(system, datamodule=data)
    after = trainer.validate(system, datamodule=data, verbose=False)[0]
    assert after["val/psnr_image"] > before["val/psnr_image"] + 1.0, (before, after)
    assert after["val/ssim_image"] > before["val/ssim_image"]
    assert after["val/perplexity"] > 2  # the codebook did not collapse to one code

    # latent_scale is 1 / std of the quantised validation image latents
    system.eval()
    with torch.no_grad():
        q = torch.cat([system(b["image"])[2] for b in data.val_dataloader()])
    assert float(system.latent_scale) == pytest.approx(1.0 / q.double().std().item(), rel=1e-4)
    assert (tmp_path / "montages" / "vqvae_epoch0029.png").is_file()  # the validation inside fit

    # a Lightning checkpoint of it is a stage-1 checkpoint (read with weights_only=True) and encodes as trained
    path = tmp_path / "stage1.ckpt"
    trainer.save_checkpoint(path)
    stage1 = read_stage1_checkpoint(path)
    assert stage1.spec == system.spec and stage1.latent_scale == float(system.latent_scale)
    assert stage1.volume_shape == (16, 32, 32)
    state = {k: v for k, v in system.state_dict().items() if k.startswith("vqvae.") or k == "latent_scale"}
    assert stage1.sha256 == weights_sha256(state)
    encoding = VQVAELatent(4, 4, checkpoint=str(path))
    image = next(iter(data.val_dataloader()))["image"]
    with torch.no_grad():
        torch.testing.assert_close(encoding.encode(image), system(image)[2] * system.latent_scale)
        recon = encoding.decode(encoding.encode(image))
    psnr = 10 * math.log10(1.0 / float(((recon.clamp(0, 1) - image) ** 2).mean()))
    assert psnr == pytest.approx(after["val/psnr_image"], abs=1.5)
    assert list(encoding.state_dict()) == [] and list(encoding.parameters()) == []  # kept out of the module tree


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_fused_adamw_under_bf16_clips_its_gradients(tmp_path, algorithm):
    """Fused AdamW (the default on a GPU) with bf16 and a clip value: Lightning's clipping refuses such an optimizer
    ("does not allow for gradient clipping", seen on an H200 at stage 1's first step); the system clips itself.
    The gradients the optimizer steps with are clipped, and the norm before clipping is logged."""
    L.seed_everything(0)
    clip = 1e-4
    data = VolumeDataModule([16, 32, 32], num_subjects=4, val_fraction=0.25, batch_size=2)
    system = VQVAESystem(vqvae=TINY, optim={"lr": 1e-3, "fused": True}, volume_shape=[16, 32, 32])
    seen: list[tuple[float, float]] = []  # (total norm, largest element) of the gradients optimizer.step() used

    class Watch(L.Callback):  # Lightning runs the closure (backward, clipping) inside step(): look after it
        def on_train_start(self, trainer, module) -> None:
            def after_step(optimizer, args, kwargs) -> None:
                grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                seen.append((float(torch.nn.utils.get_total_norm(grads)), max(float(g.abs().max()) for g in grads)))

            trainer.optimizers[0].register_step_post_hook(after_step)

    trainer = L.Trainer(max_steps=2, accelerator="cpu", precision="bf16-mixed", gradient_clip_val=clip,
                        gradient_clip_algorithm=algorithm, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[Watch()], default_root_dir=tmp_path)
    trainer.fit(system, datamodule=data)
    assert trainer.optimizers[0].defaults["fused"] is True and len(seen) == 2
    logged = float(trainer.callback_metrics["train/grad_norm"])
    if algorithm == "norm":
        assert logged > 100 * clip  # the norm before clipping: an untrained VQ-VAE's is far above the clip value
        assert all(norm <= clip * 1.001 for norm, _ in seen), seen
    else:
        assert all(largest <= clip for _, largest in seen), seen


def test_encoding_refuses_a_checkpoint_of_another_factor(tmp_path):
    system = VQVAESystem(vqvae=TINY)
    path = tmp_path / "s1.ckpt"
    torch.save({"state_dict": system.state_dict(), "hyper_parameters": dict(system.hparams)}, path)
    with pytest.raises(ConfigError, match="encoding.factor=8: the stage-1 checkpoint .* was trained with factor 4"):
        VQVAELatent(8, 4, checkpoint=str(path)).load_weights()
    with pytest.raises(ConfigError, match="not a voxdiff VQ-VAE stage-1 checkpoint"):
        torch.save({"state_dict": {}, "hyper_parameters": {}}, tmp_path / "other.ckpt")
        VQVAELatent(4, 4, checkpoint=str(tmp_path / "other.ckpt")).load_weights()


def test_the_vqvae_latent_is_the_learned_encoding_protocol(tmp_path):
    """from_weights, weights_identity, latent_scale, weights_record: what the latent cache and train.py use."""
    from voxdiff.encodings import LearnedEncoding

    system = VQVAESystem(vqvae=TINY, volume_shape=[16, 32, 32])
    system.latent_scale.fill_(1.75)
    path = tmp_path / "s1.ckpt"
    torch.save({"state_dict": system.state_dict(), "hyper_parameters": dict(system.hparams)}, path)
    encoding = VQVAELatent.from_weights(str(path))
    assert isinstance(encoding, LearnedEncoding) and encoding.weights_path == str(path)
    assert (encoding.factor, encoding.latent_channels) == (TINY["factor"], TINY["latent_channels"])
    assert encoding.weights_identity == read_stage1_checkpoint(path).sha256 and encoding.latent_scale == 1.75
    assert encoding.trained_volume_shape == (16, 32, 32)
    assert encoding.autoencoder is None  # read, not built: the cache check needs the identity only
    record = encoding.weights_record()
    assert record["checkpoint"] == str(path.resolve()) and record["sha256"] == encoding.weights_identity
    assert record["architecture"] == system.spec.as_dict()
    encoding.encode(torch.zeros(1, 1, 16, 32, 32))
    assert encoding.autoencoder is not None
    with pytest.raises(ConfigError, match="stage1_ckpt=.*nothing.ckpt: no such file"):
        VQVAELatent.from_weights(str(tmp_path / "nothing.ckpt"), key="stage1_ckpt")
    with pytest.raises(ConfigError, match="encoding.checkpoint=.*nothing.ckpt: no such file"):
        VQVAELatent(4, 4, checkpoint=str(tmp_path / "nothing.ckpt")).check_ready()
    VQVAELatent(4, 4).check_ready()  # no weights named yet: shapes only (preflight), nothing to read


@pytest.mark.parametrize("fused", [True, False])
def test_fp16_loss_scaling_clips_the_true_gradients(tmp_path, fused):
    """Under fp16 (a GradScaler: the default on a GPU without bf16) Lightning unscales the gradients before the
    clipping hook only for an optimizer that does not unscale them itself; fused AdamW (the GPU default) does, so the
    system unscales them first: the norm it clips and logs is the gradients' own, as under fp32, not the loss
    scale's 65536 times it. A foreach AdamW, which Lightning unscales for, is not unscaled twice (GradScaler would
    refuse it). (Lightning's fp16 plugin runs on the CPU too, which shows it here.)"""
    from lightning.pytorch.plugins.precision import MixedPrecision

    import voxdiff.lightning.vqvae as vqvae_module

    def norms(**precision):
        L.seed_everything(0)
        data = VolumeDataModule([16, 32, 32], num_subjects=4, val_fraction=0.25, batch_size=2)
        system = VQVAESystem(vqvae=TINY, optim={"lr": 1e-3, "fused": fused, "foreach": None if fused else True},
                             volume_shape=[16, 32, 32])
        seen: list[float] = []
        clip = vqvae_module.clip_gradients

        def spy(params, value, algorithm="norm", **kwargs):
            norm = clip(params, value, algorithm, **kwargs)
            seen.append(float(norm))
            return norm

        vqvae_module.clip_gradients = spy
        try:
            L.Trainer(max_steps=2, accelerator="cpu", gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, default_root_dir=tmp_path, **precision).fit(system, datamodule=data)
        finally:
            vqvae_module.clip_gradients = clip
        return seen

    fp32 = norms(precision="32-true")
    fp16 = norms(plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
    assert len(fp32) == len(fp16) == 2
    for true, seen in zip(fp32, fp16):
        assert seen == pytest.approx(true, rel=0.05)  # fp16's rounding, not its loss scale
