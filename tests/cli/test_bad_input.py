"""Bad input to the four entry points, as a careless user gives it: each row is the command line, the exit code
and the words the one-line message must carry (key or file, what is wrong, the fix). No traceback reaches the
user, and nothing is trained, written or built for any of them (issue 17).

The entry points run in-process (``main()`` of each CLI, with Hydra, as ``python train.py ...`` runs it); every
row is refused before a model is built, so the table takes seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys

import nibabel as nib
import numpy as np
import pytest

# the exit codes of the README's "Errors and exit codes" (voxdiff.cli.exit_codes; checked there against the table)
CONFIG, DATA, NO_FIT = 2, 5, 4

TRAIN = "train"
SAMPLE = "sample"
CACHE = "cache_latents"
EVALUATE = "evaluate"
PREFLIGHT = "preflight"

# (id, entry point, arguments, exit code, words of the message; {name} is a file of the `files` fixture)
ROWS = [
    ("clip_negative", TRAIN, ["trainer.gradient_clip_val=-1"], CONFIG,
     ["trainer.gradient_clip_val=-1", "must be a positive number", "null for no clipping", "Fix:"]),
    ("clip_zero", TRAIN, ["trainer.gradient_clip_val=0"], CONFIG,
     ["trainer.gradient_clip_val=0", "trainer.gradient_clip_val=null"]),
    ("accumulate_zero", TRAIN, ["trainer.accumulate_grad_batches=0"], CONFIG,
     ["trainer.accumulate_grad_batches=0", "positive integer", "Fix:"]),
    ("max_steps_text", TRAIN, ["trainer.max_steps=abc"], CONFIG,
     ["trainer.max_steps=abc", "integer", "Fix:"]),
    ("max_steps_zero", TRAIN, ["trainer.max_steps=0"], CONFIG,
     ["trainer.max_steps=0", "trains nothing", "Fix:"]),
    ("task_name_path", TRAIN, ["task_name=../../escaped"], CONFIG,
     ["task_name=../../escaped", "path separator", "Fix:"]),
    ("resume_empty", TRAIN, ["ckpt_path={empty}"], CONFIG, ["empty.ckpt", "is empty", "Fix:"]),
    ("resume_garbage", TRAIN, ["ckpt_path={garbage}"], CONFIG, ["garbage.ckpt", "not a PyTorch checkpoint"]),
    ("resume_truncated", TRAIN, ["ckpt_path={truncated}"], CONFIG,
     ["truncated.ckpt", "truncated or corrupt", "Fix:"]),
    ("resume_vqvae_into_diffusion", TRAIN, ["ckpt_path={vqvae}"], CONFIG,
     ["vqvae.ckpt", "VQ-VAE stage-1 checkpoint", "encoding.checkpoint="]),
    ("resume_other_architecture", TRAIN, ["ckpt_path={diffusion}", "model.channels=[8,8,8]"], CONFIG,
     ["model.channels", "[8, 8, 16]", "[8, 8, 8]", "Fix:"]),
    ("fresh_run_over_checkpoints", TRAIN, ["paths.run_dir={used_run}"], CONFIG,
     ["used_run", "already holds checkpoints", "ckpt_path=auto", "overwrite=true"]),
    ("run_dir_locked", TRAIN, ["paths.run_dir={locked_run}"], CONFIG,
     ["locked_run", "in use", f"pid {os.getppid()}", socket.gethostname()]),
    ("nan_voxel", TRAIN, ["data.root={nan_data}", "data.cache=none"], DATA,
     ["subject-001", "bravo.nii.gz", "NaN"]),
    ("blank_images", TRAIN, ["data.root={zero_data}"], DATA, ["bravo.nii.gz", "every voxel is 0"]),
    ("fsdp_sharded_checkpoints", TRAIN, ["trainer=fsdp", "trainer.accelerator=cpu",
                                         "+trainer.strategy.save_distributed_checkpoint=true"], CONFIG,
     ["trainer.strategy.save_distributed_checkpoint=true", "one checkpoint file", "Fix:"]),
    ("ddp_bucket_view_text", TRAIN, ["trainer=ddp", "trainer.accelerator=cpu",
                                     "trainer.strategy.gradient_as_bucket_view=yes"], CONFIG,
     ["trainer.strategy.gradient_as_bucket_view=yes", "true or false", "Fix:"]),
    ("ddp_bucket_cap_zero", TRAIN, ["trainer=ddp", "trainer.accelerator=cpu", "trainer.strategy.bucket_cap_mb=0"],
     CONFIG, ["trainer.strategy.bucket_cap_mb=0", "positive number", "Fix:", "MiB"]),
    ("fsdp_vqvae", TRAIN, ["experiment=vqvae_demo", "trainer=fsdp", "trainer.accelerator=cpu"], CONFIG,
     ["trainer=fsdp", "diffusion UNet", "trainer=ddp"]),
    ("stage1_garbage", TRAIN, ["experiment=exp9_demo", "encoding.checkpoint={garbage}",
                               "data.latent_dir={cache_bad_index}"], CONFIG,
     ["encoding.checkpoint", "garbage.ckpt", "not a PyTorch checkpoint"]),
    # trainer.devices as Lightning reads it (config.devices_per_node), refused by the run spec
    ("trainer_devices_zero", TRAIN, ["trainer.devices=0"], CONFIG, ["trainer.devices=0", "starts no process", "Fix:"]),
    ("trainer_devices_text", TRAIN, ["trainer.devices=abc"], CONFIG,
     ["trainer.devices=abc", "is not a device count", "Fix:", "trainer.devices=4"]),
    # refused while the Trainer and its callbacks are built (Hydra's and Lightning's own errors), before any data
    ("trainer_gpu_without_one", TRAIN, ["trainer.accelerator=gpu"], CONFIG,
     ["trainer.accelerator=gpu", "gpu", "Fix:"]),
    ("best_mode_median", TRAIN, ["callbacks.best.mode=median"], CONFIG,
     ["callbacks.best.mode=median", "min, max", "Fix:"]),
    ("stage1_kind_on_a_diffusion_config", TRAIN, ["system.kind=stage1"], CONFIG,
     ["system.kind=stage1", "system.vqvae", "experiment=vqvae_4x"]),
    ("val_check_interval_zero", TRAIN, ["+trainer.val_check_interval=0"], CONFIG,
     ["trainer.val_check_interval=0", "never validates", "Fix:"]),
    ("run_dir_empty", TRAIN, ["paths.run_dir="], CONFIG, ["paths.run_dir=", "current directory", "Fix:"]),
    ("mask_weight_negative", TRAIN, ["diffusion.mask_weight=-1"], CONFIG,
     ["diffusion.mask_weight=-1", "must be a number", "Fix:"]),
    ("mask_weight_latent_without_masks", TRAIN, ["experiment=exp9_demo", "encoding.checkpoint={vqvae}",
                                                 "diffusion.mask_weight=5", "data.masks=false"], CONFIG,
     ["data.masks=false", "diffusion.mask_weight=5", "data.masks=true"]),
    ("mask_sdf_zero", TRAIN, ["mode=seg", "diffusion.mask_sdf_scale=0"], CONFIG,
     ["diffusion.mask_sdf_scale=0", "must be a number", "Fix:"]),
    ("mask_sdf_in_bravo_mode", TRAIN, ["diffusion.mask_weight=0", "diffusion.mask_sdf_scale=2"], CONFIG,
     ["diffusion.mask_sdf_scale=2", "mode=bravo", "Fix:", "mode=seg"]),
    ("mask_sdf_with_a_mask_weight", TRAIN, ["mode=seg", "diffusion.mask_weight=20", "diffusion.mask_sdf_scale=2"],
     CONFIG, ["diffusion.mask_weight=20", "diffusion.mask_sdf_scale=2", "cannot be undone", "Fix:"]),
    ("mask_sdf_on_latents", TRAIN, ["experiment=exp9_demo", "encoding.checkpoint={vqvae}", "mode=seg",
                                    "diffusion.mask_sdf_scale=2"], CONFIG,
     ["diffusion.mask_sdf_scale=2", "learned encoding", "Fix:", "encoding=haar"]),
    ("latent_index_corrupt", TRAIN, ["experiment=exp9_demo", "encoding.checkpoint={vqvae}",
                                     "data.latent_dir={cache_bad_index}"], CONFIG,
     ["index.json", "not valid JSON", "cache_latents.py"]),
    ("model_far_too_large", TRAIN, ["model.channels=[1536,3072,6144]", "model.num_res_blocks=3",
                                    "model.num_head_channels=64", "model.norm_num_groups=32"], NO_FIT,
     ["does not fit", "host memory"]),
    ("guidance_dropout_in_seg_mode", TRAIN, ["mode=seg", "system.guidance.drop_prob=0.1"], CONFIG,
     ["system.guidance.drop_prob=0.1", "mode=seg", "Fix:"]),
    ("guidance_scale_without_dropout", TRAIN, ["system.sampling.guidance_scale=2"], CONFIG,
     ["system.sampling.guidance_scale=2", "drop_prob", "Fix:"]),
    ("rflow_with_min_snr", TRAIN, ["diffusion=rflow", "~diffusion.prediction_type", "~diffusion.eta",
                                   "diffusion.min_snr_gamma=5"], CONFIG,
     ["diffusion.min_snr_gamma=5", "no SNR weighting", "Fix:"]),
    ("sample_guidance_without_dropout", SAMPLE, ["ckpt_path={diffusion}", "guidance_scale=2"], CONFIG,
     ["guidance_scale=2", "drop_prob=0", "Fix:"]),
    ("evaluate_guidance_without_dropout", EVALUATE, ["ckpt_path={diffusion}", "guidance_scale=2"], CONFIG,
     ["guidance_scale=2", "drop_prob=0", "Fix:"]),
    ("sample_use_ema_not_boolean", SAMPLE, ["ckpt_path={diffusion}", "use_ema=maybe"], CONFIG,
     ["use_ema=maybe", "true or false", "Fix:"]),
    ("evaluate_use_ema_not_boolean", EVALUATE, ["ckpt_path={diffusion}", "use_ema=maybe"], CONFIG,
     ["use_ema=maybe", "true or false", "Fix:"]),
    ("guidance_interval_reversed", TRAIN, ["system.sampling.guidance_interval=[0.5,0.2]"], CONFIG,
     ["system.sampling.guidance_interval=[0.5, 0.2]", "0 <= lo < hi <= 1", "Fix:"]),
    ("guided_samples_outside_the_interval", TRAIN, ["system.guidance.drop_prob=0.1", "system.sampling.guidance_scale=2",
                                                    "system.sampling.guidance_interval=[0.9995,1]"], CONFIG,
     ["system.sampling.guidance_interval=[0.9995, 1.0]", "holds none of the", "would never run", "Fix:"]),
    ("sample_guidance_interval_out_of_range", SAMPLE, ["ckpt_path={diffusion}", "guidance_interval=[0,2]"], CONFIG,
     ["guidance_interval=[0, 2]", "0 <= lo < hi <= 1", "Fix:"]),
    ("evaluate_guidance_interval_not_a_list", EVALUATE, ["ckpt_path={diffusion}", "guidance_interval=0.2"], CONFIG,
     ["guidance_interval=0.2", "must be [lo, hi]", "Fix:"]),
    ("sample_guidance_scale_negative", SAMPLE, ["ckpt_path={diffusion}", "guidance_scale=-1"], CONFIG,
     ["guidance_scale=-1", "Fix:"]),
    ("sample_eta_too_large", SAMPLE, ["ckpt_path={diffusion}", "eta=3"], CONFIG, ["eta=3", "Fix:"]),
    ("evaluate_unweight_not_a_boolean", EVALUATE, ["ckpt_path={diffusion}", "unweight=yes"], CONFIG,
     ["unweight=yes", "must be true or false", "Fix: use unweight=true"]),
    ("sample_nan_weights", SAMPLE, ["ckpt_path={nan_weights}"], CONFIG,
     ["nan_weights.ckpt", "state_dict.model.", "NaN or infinite", "Fix:"]),
    ("evaluate_inf_ema_weights", EVALUATE, ["ckpt_path={inf_ema}"], CONFIG,
     ["inf_ema.ckpt", "ema.shadow.", "NaN or infinite"]),
    ("resume_nan_weights", TRAIN, ["ckpt_path={nan_weights}"], CONFIG,
     ["nan_weights.ckpt", "NaN or infinite", "earlier checkpoint"]),
    ("sample_empty", SAMPLE, ["ckpt_path={empty}"], CONFIG, ["empty.ckpt", "is empty"]),
    ("sample_garbage", SAMPLE, ["ckpt_path={garbage}"], CONFIG, ["garbage.ckpt", "not a PyTorch checkpoint"]),
    ("sample_truncated", SAMPLE, ["ckpt_path={truncated}"], CONFIG, ["truncated.ckpt", "truncated or corrupt"]),
    # evaluate.py reads a checkpoint through the same reader as every command (it printed torch's traceback)
    ("evaluate_empty", EVALUATE, ["ckpt_path={empty}"], CONFIG, ["empty.ckpt", "is empty"]),
    ("evaluate_garbage", EVALUATE, ["ckpt_path={garbage}"], CONFIG, ["garbage.ckpt", "not a PyTorch checkpoint"]),
    ("evaluate_truncated", EVALUATE, ["ckpt_path={truncated}"], CONFIG, ["truncated.ckpt", "truncated or corrupt"]),
    ("sample_device_unknown", SAMPLE, ["ckpt_path={diffusion}", "device=gpu"], CONFIG,
     ["device=gpu", "is not one of auto, cpu, cuda", "Fix:"]),
    ("evaluate_device_unknown", EVALUATE, ["ckpt_path={diffusion}", "device=gpu"], CONFIG,
     ["device=gpu", "is not one of auto, cpu, cuda", "Fix:"]),
    ("sample_cuda_without_gpu", SAMPLE, ["ckpt_path={diffusion}", "device=cuda"], CONFIG,
     ["device=cuda", "no CUDA GPU is visible", "device=auto"]),
    ("evaluate_cuda_without_gpu", EVALUATE, ["ckpt_path={diffusion}", "device=cuda"], CONFIG,
     ["device=cuda", "no CUDA GPU is visible", "device=auto"]),
    # covariates (issue 28): the table's problems name the file, the subject and the column (exit 5); the config's,
    # the sampler's and a resume's name the key (exit 2)
    ("covariates_no_table", TRAIN, ["data.root={cov_no_table}", "data.covariates=[age]"], DATA,
     ["cov_no_table/participants.tsv", "no participants table", "data.covariates_table=PATH", "Fix:"]),
    ("covariates_no_column", TRAIN, ["data.root={cov_data}", "data.covariates=[age,height]"], DATA,
     ["participants.tsv", "no column 'height'", "data.covariates", "Fix:"]),
    ("covariates_subject_missing", TRAIN, ["data.root={cov_data}", "data.covariates=[age]",
                                           "data.covariates_table={cov_missing_subject}"], DATA,
     ["missing_subject.tsv", "subject subject-002 has no row", "Fix:"]),
    ("covariates_not_numeric", TRAIN, ["data.root={cov_data}", "data.covariates=[age]",
                                       "data.covariates_table={cov_not_numeric}"], DATA,
     ["not_numeric.tsv", "subject-001", "'forty'", "numeric column 'age'", "Fix:"]),
    ("covariates_level_unseen", TRAIN, ["data.root={cov_data}", "data.covariates=[sex]",
                                        "data.covariates_table={cov_unseen_level}"], DATA,
     ["unseen_level.tsv", "(validation)", "'X'", "column 'sex'", "Fix:"]),
    ("covariates_kind_unknown", TRAIN, ["data.covariates=[age:ordinal]"], CONFIG,
     ["data.covariates=[age:ordinal]", "neither numeric nor categorical", "Fix:"]),
    ("covariates_not_the_phantoms", TRAIN, ["data.covariates=[height]"], CONFIG,
     ["data.covariates=[height]", "the phantom has no covariate 'height'", "age", "Fix:"]),
    ("resume_with_other_covariates", TRAIN, ["ckpt_path={diffusion}", "data.covariates=[age]"], CONFIG,
     ["data.covariates is [] in the checkpoint and [age] now", "data.covariates=[]", "Fix:"]),
    ("sample_covariate_out_of_range", SAMPLE, ["ckpt_path={covariates}", "covariates.age=200"], CONFIG,
     ["covariates.age=200", "outside the range this model was trained on", "Fix: use a number in"]),
    ("sample_covariate_level_unseen", SAMPLE, ["ckpt_path={covariates}", "covariates.sex=X"], CONFIG,
     ["covariates.sex=X", "not a level this model was trained on", "Fix: use one of F, M"]),
    ("evaluate_covariate_not_trained", EVALUATE, ["ckpt_path={covariates}", "covariates.lesion_load=2"], CONFIG,
     ["covariates.lesion_load=2", "trained on the covariates ['age', 'sex']", "Fix:"]),
    ("sample_covariates_for_a_model_without", SAMPLE, ["ckpt_path={diffusion}", "covariates.age=50"], CONFIG,
     ["covariates.age=50", "trained without covariates", "data.covariates=", "Fix:"]),
    ("evaluate_sweep_unknown_covariate", EVALUATE, ["ckpt_path={covariates}", "covariate_sweep=height"], CONFIG,
     ["covariate_sweep=height", "not a covariate of this model", "Fix:"]),
    ("evaluate_counterfactual_without_sweep", EVALUATE, ["ckpt_path={covariates}", "counterfactual=true"], CONFIG,
     ["counterfactual=true", "no covariate is swept", "Fix: add covariate_sweep=age"]),
    ("evaluate_counterfactual_n_uneven", EVALUATE, ["ckpt_path={covariates}", "counterfactual=true",
                                                    "covariate_sweep=age", "n=5"], CONFIG,
     ["n=5", "each of the split's 2 masks at every value of age", "Fix: use n=4"]),
    ("cache_no_arguments", CACHE, [], CONFIG, ["stage1_ckpt", "is required", "Fix:"]),
    ("cache_device_unknown", CACHE, ["stage1_ckpt={vqvae}", "out={tmp}/cache", "device=gpu"], CONFIG,
     ["device=gpu", "is not one of auto, cpu, cuda", "Fix:"]),
    ("cache_empty", CACHE, ["stage1_ckpt={empty}", "out={tmp}/cache"], CONFIG, ["empty.ckpt", "is empty"]),
    ("cache_truncated", CACHE, ["stage1_ckpt={truncated}", "out={tmp}/cache"], CONFIG,
     ["truncated.ckpt", "truncated or corrupt"]),
    ("sweep_header_only", PREFLIGHT, ["preflight.sweep={sweep_header_only}", "preflight.out={tmp}/out.csv"],
     CONFIG, ["header_only.csv", "no configuration rows"]),
    ("sweep_missing_columns", PREFLIGHT, ["preflight.sweep={sweep_columns}", "preflight.out={tmp}/out.csv"],
     CONFIG, ["columns.csv", "lacks the column", "reference/measured_vram.csv"]),
    ("sweep_all_invalid", PREFLIGHT, ["preflight.sweep={sweep_invalid}", "preflight.recipe=seed",
                                      "preflight.out={tmp}/out.csv"],
     CONFIG, ["invalid.csv", "no valid row", "norm_num_groups"]),
    ("sweep_binary", PREFLIGHT, ["preflight.sweep={sweep_binary}", "preflight.out={tmp}/out.csv"], CONFIG,
     ["binary.csv", "not a text CSV"]),
    # a command line Hydra cannot compose: the same line and code from every command (Hydra's own exit was 1)
    ("unknown_key_train", TRAIN, ["no_such_key=1"], CONFIG, ["no_such_key=1", "+no_such_key=1", "Fix:"]),
    ("unknown_key_sample", SAMPLE, ["ckpt_path={diffusion}", "no_such_key=1"], CONFIG,
     ["no_such_key=1", "+no_such_key=1"]),
    ("unknown_key_evaluate", EVALUATE, ["ckpt_path={diffusion}", "no_such_key=1"], CONFIG,
     ["no_such_key=1", "+no_such_key=1"]),
    ("unknown_key_cache", CACHE, ["stage1_ckpt={vqvae}", "out={tmp}/cache", "no_such_key=1"], CONFIG,
     ["no_such_key=1", "+no_such_key=1"]),
    ("unknown_key_preflight", PREFLIGHT, ["no_such_key=1"], CONFIG, ["no_such_key=1", "+no_such_key=1"]),
    ("unknown_group_option", TRAIN, ["model=no_such_model"], CONFIG,
     ["model=no_such_model", "Could not find", "Available options in 'model'", "default_3d_5lvl"]),
    ("override_unparsable", SAMPLE, ["ckpt_path={diffusion}", "n=[1"], CONFIG, ["n=[1", "key=[a,b]"]),
    ("delete_unknown_key", TRAIN, ["~no_such_key"], CONFIG, ["~no_such_key", "does not exist"]),
    # every output path is checked before the work starts
    ("sweep_out_in_a_missing_folder", PREFLIGHT, ["preflight.sweep={reference_csv}", "preflight.recipe=seed",
                                                  "preflight.out={tmp}/no_such_folder/out.csv"], CONFIG,
     ["preflight.out=", "no_such_folder", "does not exist", "mkdir -p"]),
    ("run_dir_under_a_file", TRAIN, ["paths.run_dir={garbage}/run"], CONFIG,
     ["paths.run_dir=", "garbage.ckpt is a file, not a folder", "Fix:"]),
    ("evaluate_out_dir_under_a_file", EVALUATE, ["ckpt_path={diffusion}", "out_dir={garbage}/eval"], CONFIG,
     ["out_dir=", "garbage.ckpt is a file, not a folder", "Fix:"]),
    ("cache_out_is_a_file", CACHE, ["stage1_ckpt={vqvae}", "out={garbage}"], CONFIG,
     ["out=", "is a file, not a folder", "Fix:"]),
    # a NIfTI whose voxel-to-world matrix cannot orient it (nibabel and MONAI failed on it with a traceback)
    ("nifti_singular_affine", TRAIN, ["data.root={singular_data}", "data.cache=none"], DATA,
     ["subject-001", "bravo.nii.gz", "affine", "singular", "set_sform"]),
    # weights of other shapes than the config builds: the keys, not load_state_dict's pages
    ("resume_other_shapes", TRAIN, ["ckpt_path={reshaped}"], CONFIG,
     ["reshaped.ckpt", "1 weights have other shapes (checkpoint vs model)", "{reshaped_key}", "Fix:"]),
    ("sample_other_shapes", SAMPLE, ["ckpt_path={reshaped}"], CONFIG,
     ["reshaped.ckpt", "1 weights have other shapes (checkpoint vs model)", "{reshaped_key}"]),
]


def _write_subjects(root, image_of, singular: int | None = None) -> str:
    """Three subjects of 16³ voxels; subject ``singular`` (if any) with an all-zero sform in both files, as a
    broken converter writes it (nibabel refuses to make such an image, so the header is edited)."""
    affine = np.diag([1.0, 1.0, 1.0, 1.0])
    for i in range(3):
        d = root / f"subject-{i:03d}"
        d.mkdir(parents=True)
        mask = np.zeros((16, 16, 16), np.float32)
        mask[4:8, 4:8, 4:8] = 1
        for name, volume in (("bravo", image_of(i)), ("seg", mask)):
            img = nib.Nifti1Image(volume, affine)
            if i == singular:
                for row in ("srow_x", "srow_y", "srow_z"):
                    img.header[row] = 0
                img.header["sform_code"], img.header["qform_code"] = 1, 0
                img = nib.Nifti1Image(volume, None, header=img.header)
            nib.save(img, str(d / f"{name}.nii.gz"))
    return str(root)


def _nan_image(i: int) -> np.ndarray:
    image = np.random.default_rng(i).uniform(10, 100, (16, 16, 16)).astype(np.float32)
    if i == 1:
        image[3, 4, 5] = np.nan
    return image


@pytest.fixture(scope="module")
def files(tmp_path_factory, diffusion_ckpt, vqvae_ckpt, covariate_ckpt, reference_csv):
    tmp = tmp_path_factory.mktemp("bad_input")
    from voxdiff.data.covariates import write_table
    from voxdiff.data.split import split_subjects

    cov_data = _write_subjects(tmp / "cov_data", lambda i: _nan_image(0) + i)
    names = [f"subject-{i:03d}" for i in range(3)]
    rows = {n: {"participant_id": n, "age": str(30 + 10 * i), "sex": "FM"[i % 2]} for i, n in enumerate(names)}
    write_table(tmp / "cov_data" / "participants.tsv", rows)
    write_table(tmp / "missing_subject.tsv", {k: v for k, v in rows.items() if k != "subject-002"})
    write_table(tmp / "not_numeric.tsv", {**rows, "subject-001": {**rows["subject-001"], "age": "forty"}})
    val = names[split_subjects(names, 0.25, 0)[1][0]]
    train_levels = {**{n: {**rows[n], "sex": "F"} for n in names}, val: {**rows[val], "sex": "X"}}
    write_table(tmp / "unseen_level.tsv", train_levels)
    (tmp / "empty.ckpt").write_bytes(b"")
    (tmp / "garbage.ckpt").write_bytes(np.random.default_rng(0).bytes(4096))
    data = diffusion_ckpt.read_bytes()
    (tmp / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    import torch

    poisoned = torch.load(diffusion_ckpt, map_location="cpu", weights_only=True)
    name = next(k for k, v in poisoned["state_dict"].items() if v.is_floating_point())
    poisoned["state_dict"][name] = poisoned["state_dict"][name].clone().fill_(float("nan"))
    torch.save(poisoned, tmp / "nan_weights.ckpt")
    poisoned_ema = torch.load(diffusion_ckpt, map_location="cpu", weights_only=True)
    first = next(iter(poisoned_ema["ema"]["shadow"]))
    poisoned_ema["ema"]["shadow"][first] = poisoned_ema["ema"]["shadow"][first].clone().fill_(float("inf"))
    torch.save(poisoned_ema, tmp / "inf_ema.ckpt")
    reshaped = torch.load(diffusion_ckpt, map_location="cpu", weights_only=True)
    reshaped_key = next(k for k, v in reshaped["state_dict"].items() if v.is_floating_point() and v.ndim == 1)
    weight = reshaped["state_dict"][reshaped_key]
    reshaped["state_dict"][reshaped_key] = torch.zeros(weight.shape[0] + 1, dtype=weight.dtype)
    torch.save(reshaped, tmp / "reshaped.ckpt")
    shutil.copy(vqvae_ckpt, tmp / "vqvae.ckpt")
    (tmp / "used_run" / "checkpoints").mkdir(parents=True)
    shutil.copy(diffusion_ckpt, tmp / "used_run" / "checkpoints" / "last.ckpt")
    (tmp / "locked_run").mkdir()
    (tmp / "locked_run" / ".voxdiff.lock").write_text(json.dumps(
        {"pid": os.getppid(), "host": socket.gethostname(), "started": "2026-01-01T00:00:00",
         "command": "python train.py"}))
    (tmp / "cache_bad_index").mkdir()
    (tmp / "cache_bad_index" / "index.json").write_text('{"format": "voxdiff-latents/1", "subj')
    header = reference_csv.read_text().splitlines()[0]
    (tmp / "header_only.csv").write_text(header + "\n")
    (tmp / "columns.csv").write_text("name,params_m\nrow1,12.5\n")
    rows = reference_csv.read_text().splitlines()
    cols = header.split(",")
    bad = []
    for line in rows[1:3]:
        values = dict(zip(cols, line.split(",")))
        values["norm_num_groups"] = "24"
        bad.append(",".join(values[c] for c in cols))
    (tmp / "invalid.csv").write_text("\n".join([header, *bad]) + "\n")
    (tmp / "binary.csv").write_bytes(bytes(range(256)) * 16)
    return {
        "tmp": str(tmp),
        "empty": str(tmp / "empty.ckpt"),
        "garbage": str(tmp / "garbage.ckpt"),
        "truncated": str(tmp / "truncated.ckpt"),
        "vqvae": str(tmp / "vqvae.ckpt"),
        "diffusion": str(diffusion_ckpt),
        "nan_weights": str(tmp / "nan_weights.ckpt"),
        "reshaped": str(tmp / "reshaped.ckpt"),
        "reshaped_key": reshaped_key,
        "reference_csv": str(reference_csv),
        "singular_data": _write_subjects(tmp / "singular_data", lambda i: _nan_image(0) + i, singular=1),
        "inf_ema": str(tmp / "inf_ema.ckpt"),
        "used_run": str(tmp / "used_run"),
        "locked_run": str(tmp / "locked_run"),
        "nan_data": _write_subjects(tmp / "nan_data", _nan_image),
        "zero_data": _write_subjects(tmp / "zero_data", lambda i: np.zeros((16, 16, 16), np.float32)),
        "cache_bad_index": str(tmp / "cache_bad_index"),
        "covariates": str(covariate_ckpt),
        "cov_data": cov_data,
        "cov_no_table": _write_subjects(tmp / "cov_no_table", lambda i: _nan_image(0) + i),
        "cov_missing_subject": str(tmp / "missing_subject.tsv"),
        "cov_not_numeric": str(tmp / "not_numeric.tsv"),
        "cov_unseen_level": str(tmp / "unseen_level.tsv"),
        "sweep_header_only": str(tmp / "header_only.csv"),
        "sweep_columns": str(tmp / "columns.csv"),
        "sweep_invalid": str(tmp / "invalid.csv"),
        "sweep_binary": str(tmp / "binary.csv"),
    }


def run_cli(entry: str, args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """``python <entry>.py ARGS`` in this process: (exit code, stdout, stderr)."""
    import importlib

    module = importlib.import_module(f"voxdiff.cli.{entry}")
    capsys.readouterr()
    if entry == PREFLIGHT:
        code = module.main(list(args))
    else:
        monkeypatch.setattr(sys, "argv", [f"{entry}.py", *args])
        try:
            module.main()
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_rows_use_voxdiffs_exit_codes():
    from voxdiff.cli.exit_codes import EXIT_CONFIG, EXIT_DATA, EXIT_NO_FIT

    assert (CONFIG, DATA, NO_FIT) == (EXIT_CONFIG, EXIT_DATA, EXIT_NO_FIT)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_refused_in_one_line(row, files, tiny_demo, tmp_path, monkeypatch, capsys):
    name, entry, args, code, words = row
    monkeypatch.chdir(tmp_path)
    args = [a.format(**files) for a in args]
    words = [w.format(**files) for w in words]
    if entry == TRAIN:
        base = tiny_demo if not any(a.startswith("experiment=") for a in args) else ["logger=csv", "trainer=cpu"]
        args = [*base, f"paths.log_dir={tmp_path}/a/b/logs", *args]
    elif entry != PREFLIGHT:
        args = [f"paths.log_dir={tmp_path}/logs", *args]
    if "device=cuda" in args:  # the machine without a GPU, on any machine
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    got, out, err = run_cli(entry, args, monkeypatch, capsys)
    assert "Traceback" not in out + err, err[-3000:]
    assert got == code, f"exit {got}\n{out[-2000:]}\n{err[-3000:]}"
    lines = [line for line in err.splitlines() if words[0] in line]
    assert lines, err[-3000:]
    assert all(w in lines[0] for w in words), lines[0]  # one line carries the key/file, the problem and the fix
    assert "weights_only=False" not in out + err  # never advise unpickling a file
    assert not list(tmp_path.rglob("*.ckpt")), "a refused run must not write checkpoints"
    if name == "task_name_path":
        assert not (tmp_path / "a" / "escaped").exists()


def test_a_full_disk_while_training_is_one_line_and_its_own_exit_code(tiny_demo, tmp_path, monkeypatch, capsys):
    """The disk fills after the preflight passed (it is told 100 GiB are free; the run directory is a 512 KiB
    tmpfs, too small for the first checkpoint): one line naming the folder and the sizes, EXIT_WRITE, no partial
    file. Before, the same message came inside a traceback with exit 1."""
    import subprocess

    from voxdiff.cli.exit_codes import EXIT_WRITE

    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(small)], check=True)
    try:
        monkeypatch.chdir(tmp_path)
        got, out, err = run_cli(TRAIN, [*tiny_demo, f"paths.run_dir={small}/run", "+preflight.disk_free_gib=100",
                                        "trainer.max_steps=2"], monkeypatch, capsys)
        assert "Traceback" not in out + err, err[-3000:]
        assert got == EXIT_WRITE, f"exit {got}\n{err[-3000:]}"
        line = next(line for line in err.splitlines() if "write failed" in line)
        assert f"no space left on {small}/run/checkpoints" in line and "free" in line and "paths.run_dir" in line
        assert "[Errno" not in line
        assert not list(small.rglob("*.ckpt")) and not list(small.rglob("*.tmp"))
    finally:
        import logging

        for handler in list(logging.root.handlers):  # Hydra's job log in the run directory, held open in-process
            if isinstance(handler, logging.FileHandler) and handler.baseFilename.startswith(str(small)):
                handler.close()
                logging.root.removeHandler(handler)
        subprocess.run(["umount", str(small)], check=True)


def test_cache_latents_refuses_every_problem_of_its_config_at_once(files, tmp_path):
    """cache_latents.py resolves its config once (its CacheSpec): three mistakes are three lines of one refusal."""
    from voxdiff.cli.cache_latents import validate
    from voxdiff.config import compose
    from voxdiff.errors import ConfigError, ConfigErrors

    cfg = compose(CACHE, [f"stage1_ckpt={files['garbage']}", f"out={tmp_path}/cache", "batch_size=0", "device=gpu",
                          "data.num_workers=-1"])
    with pytest.raises(ConfigErrors) as err:
        validate(cfg)
    assert [p.key for p in err.value.problems] == ["stage1_ckpt", "batch_size", "data.num_workers", "device"]
    spec = validate(compose(CACHE, [f"stage1_ckpt={files['vqvae']}", f"out={tmp_path}/cache", "device=auto"]))
    import torch

    assert spec.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert spec.volume_shape == tuple(spec.encoding.trained_volume_shape)
    assert spec.encoding.latent_scale > 0  # its weights are read
    # a volume of words is refused naming the key (before: int('a') raised a ValueError inside the shape check)
    with pytest.raises(ConfigError, match=r"data.volume_shape=\[a, b, c\]: must be a list of 3 positive integers"):
        validate(compose(CACHE, [f"stage1_ckpt={files['vqvae']}", f"out={tmp_path}/cache", "data.volume_shape=[a,b,c]"]))
