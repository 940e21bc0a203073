"""From a checkpoint to figures and report sections: generation (diffusion) or reconstruction (VQ-VAE stage 1),
then the metrics of :mod:`voxdiff.evaluation.metrics` against the real volumes of the same split.

Every figure is a dict ``{"value", "n" (or "n_generated"/"n_real"/"pairs"), "direction", "definition", "label"}``
as it appears in ``metrics.json`` and in the report's table; with a bootstrap (:mod:`voxdiff.evaluation.uncertainty`),
``"ci": [low, high]`` and ``"se"`` too, where the figure has an interval.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from voxdiff.evaluation import lesions as L
from voxdiff.evaluation import metrics as M
from voxdiff.evaluation import uncertainty as U
from voxdiff.evaluation.features import FeatureExtractor
from voxdiff.evaluation.report import data_uri, histogram_png, lesion_distribution_png

#: where on the schedule (t/T) a mask model is shown the real masks to denoise (:func:`denoising_figures`). Each
#: fraction's noise is seeded by its place in this tuple (``evaluate.py``), so a new one goes at the end; the figures
#: are listed in the order of the noise (:data:`DENOISE_ORDER`)
DENOISE_AT = (0.05, 0.2, 0.5, 0.01)
DENOISE_ORDER = tuple(sorted(DENOISE_AT))

#: definitions of the figures (the report's table and metrics.json)
DEFINITIONS: dict[str, tuple[str, str, str]] = {
    # name: (label, direction, definition)
    "diversity_ms_ssim_generated": (
        "Diversity: mean pairwise MS-SSIM, generated", "match",
        "Mean MS-SSIM over the unordered pairs of generated volumes (float64): all of them, or a seeded random "
        "subset of diversity_pairs of them (N and the pairs computed are beside it). Lower = more diverse; compare "
        "with the same figure for the real volumes (a much higher value: too little variety, mode collapse)."),
    "diversity_ms_ssim_real": (
        "Diversity: mean pairwise MS-SSIM, real", "info",
        "The same figure for the real volumes of the split: the diversity the generated set should reach."),
    "ssim": ("Paired SSIM (generated vs real of its mask)", "higher",
             "SSIM of each generated volume against the real image of the mask it was conditioned on, mean over "
             "samples (MONAI SSIMMetric, Gaussian window 7, σ 1.5, data range 1)."),
    "psnr": ("Paired PSNR, dB", "higher",
             "Peak signal-to-noise ratio of each generated volume against the real image of its mask (peak 1), "
             "mean over samples (MONAI PSNRMetric)."),
    "ms_ssim": ("Paired MS-SSIM", "higher",
                "MS-SSIM of each generated volume against the real image of its mask, mean over samples (MONAI "
                "MultiScaleSSIMMetric; kernel, σ and weights as stated in metric_settings.ms_ssim)."),
    "lesion_contrast_generated": (
        "Lesion contrast, generated", "match",
        "Mean intensity inside the mask minus the mean in a 2-voxel shell around it, over generated volumes: "
        "does the lesion stand out as in the real images? Compare with the real figure."),
    "lesion_contrast_real": ("Lesion contrast, real", "info",
                             "The same figure for the real images of the masks."),
    "anatomy_sharpness": (
        "Anatomy: sharpness, generated ÷ real", "match",
        "Mean gradient magnitude (central differences of the volume smoothed by a 1-voxel Gaussian, so voxel noise "
        "does not count) inside each volume's own head (foreground above 0.15, holes of each axial slice filled), "
        "generated over real. A blurred head scores below 1 (a 1.5-voxel Gaussian blur of the phantom: 0.64), but "
        "every edge counts, wrong ones too: blotches and the 2-voxel blocks of an undertrained S2D model raise it."),
    "anatomy_tissue_distance": (
        "Anatomy: tissue-mix distance", "lower",
        "Total-variation distance ½·Σ|p_gen − p_real| between the mean shares of head voxels in the intensity "
        "classes dark < 0.25 (CSF, ventricles, skull tables) ≤ grey < 0.49 ≤ deep grey < 0.63 ≤ bright (white "
        "matter, fat, lesions) of generated and real volumes. 0: the same tissue mix; a blurred head moves voxels "
        "from the dark and bright classes to grey (a 1.5-voxel blur of the phantom: 0.25), but a smooth blob with a "
        "soft outline can mix its classes as the data do: read it beside the sharpness and the ventricle count."),
    "ventricle_voxels_generated": (
        "Ventricles: CSF-dark voxels in the central box, generated", "match",
        "Mean over generated volumes of voxdiff.data.phantom.ventricle_voxels (voxels below 0.25 in the phantom's "
        "central box that holds the ventricles); phantom runs only. 0: no ventricle drawn. ratio_to_real beside it."),
    "ventricle_voxels_real": ("Ventricles: CSF-dark voxels in the central box, real", "info",
                              "The same count for the real phantom images of the split."),
    "lesion_count_generated": (
        "Masks: lesions per mask, generated", "match",
        "Mean over generated masks of their lesions: 26-connected components of the mask above 0.5 "
        "(voxdiff.evaluation.lesions). Compare with the real figure: a model that draws one merged blob, or "
        "speckle, misses it."),
    "lesion_count_real": ("Masks: lesions per mask, real", "info", "The same count for the real masks of the split."),
    "lesion_load_generated": (
        "Masks: lesion voxels per mask, generated", "match",
        "Mean over generated masks of their voxels above 0.5 (the lesion load). Compare with the real figure."),
    "lesion_load_real": ("Masks: lesion voxels per mask, real", "info",
                         "The same figure for the real masks of the split."),
    "lesion_size_generated": (
        "Masks: voxels per lesion, generated", "match",
        "The generated masks' lesion voxels over their lesions (both summed over the masks): how large a lesion is "
        "drawn (NaN: no lesion drawn). Compare with the real figure."),
    "lesion_size_real": ("Masks: voxels per lesion, real", "info", "The same figure for the real masks."),
    "lesion_outside_head_generated": (
        "Masks: share of lesion voxels outside the heads", "lower",
        "Lesion voxels (above 0.5) of the generated masks that lie outside the population's head (the voxels inside "
        "at least half of the real images' heads, voxdiff.evaluation.metrics.head_mask), over all their lesion "
        "voxels (NaN: none): lesions drawn where no brain is. Meaningful for aligned volumes (the phantom, a "
        "registered data set); read it against the real masks' own share."),
    "lesion_outside_head_real": ("Masks: share of lesion voxels outside the heads, real", "info",
                                 "The same share for the real masks of the split."),
    **{f"denoised_dice_t{round(f * 100):02d}": (
        f"Masks: Dice of the model's denoising at {round(f * 100)}% noise", "higher",
        f"The real masks of the split noised at {f:g} of the schedule (t/T), each denoised in one step by the model "
        "(its x0 prediction, the mask weight undone as the sampler does, thresholded as a sample is): the mean Dice "
        "against the mask (masks without lesion left out). A model that has learned the lesions returns them "
        "from light noise (near 1 at 5%); one near 0 there does not see a lesion it is shown, so its sampler cannot "
        "draw one: the training is what to change, not the sampler. At 1% (about a 50-step sampler's last step) the "
        "mask is all but shown clean and an exact model returns it whole: a figure no higher there than at 5% says "
        "the model returns a smoothed mask rather than what it is shown, and loses the smallest lesions. The figure falls with the noise for an exact "
        "model too (at 50% on the default schedule a small lesion is mostly lost). lesion_load_ratio beside it: the "
        "voxels it returns as lesion over the real ones (summed over the masks).") for f in DENOISE_ORDER},
    "nearest_training_generated": (
        "Nearest training volume: similarity, generated", "match",
        "Mean over generated volumes of their greatest similarity to any volume of the training split (seg: Dice "
        "of the masks above 0.5, masks without lesion left out: NaN if every one is empty; bravo: Pearson's r of "
        "the images). A model that copies its training data scores above the real figure; one that draws unlike "
        "any subject, below it."),
    "nearest_training_real": (
        "Nearest training volume: similarity, real held out", "info",
        "The same figure for the real volumes of the split, which training never saw: how near an unseen "
        "subject of the data comes to a training subject."),
    "nearest_training_copies": (
        "Nearest training volume: share nearer than any held-out volume", "lower",
        "The share of generated volumes more similar to a training volume than the most similar held-out real "
        "volume is (Akbar et al. 2023, Dar et al. 2023 measure memorisation so): near 0 for a model that does not "
        "copy; the training volume each is nearest to is in metrics.json (nearest_training_generated.subjects)."),
    "mmd_histogram": (
        "MMD² of intensity histograms", "lower",
        "Unbiased MMD² with a linear kernel (MONAI MMDMetric) between 64-bin intensity histograms of generated "
        "and real volumes (first min(N_gen, N_real) of each). 0 for identical sets of volumes."),
    "covariate_age_ventricles_generated": (
        "Age obeyed: r(requested age, generated ventricles)", "higher",
        "Pearson correlation, over the generated volumes, between the age each was sampled at and its ventricle "
        "size (CSF-dark voxels in the phantom's central box, voxdiff.data.phantom.ventricle_voxels). The phantom's "
        "ventricles widen with age: near the real figure = the model learned what age does."),
    "covariate_age_ventricles_real": (
        "Age in the data: r(age, real ventricles)", "info",
        "The same correlation for the real phantom images of the split and their own ages: what a model that "
        "learned age can reach."),
    "covariate_age_ventricles_control": (
        "Negative control: r(requested age, control's ventricles)", "lower",
        "The same figure for control_ckpt (a model trained without covariates, or with shuffled ones), sampled "
        "with the same masks, noise and requested ages: it cannot follow the age, so its r stays near 0."),
    "covariate_sex_head_generated": (
        "Sex obeyed: r(requested sex, generated head size)", "higher",
        "Pearson correlation, over the generated volumes, between the sex each was sampled at (its level's index: F "
        "0, M 1) and its head size (voxels above the background, voxdiff.data.phantom.head_voxels). The phantom's "
        "head is 5% larger for M: near the real figure = the model learned it."),
    "covariate_sex_head_real": (
        "Sex in the data: r(sex, real head size)", "info",
        "The same correlation for the real phantom images of the split and their own sex (0.47 over 60 phantom "
        "subjects at 32×48×48: the head's size varies between subjects of one sex too)."),
    "covariate_sex_head_control": (
        "Negative control: r(requested sex, control's head size)", "lower",
        "The same figure for control_ckpt, sampled with the same masks, noise and requested values: near 0."),
    "covariate_age_ventricles_effect_generated": (
        "Age effect, counterfactual: ventricle voxels per year, generated", "match",
        "With counterfactual=true each mask is drawn at every swept age with the same noise; the figure is the mean "
        "over masks of each mask's least-squares slope of its ventricle size (voxdiff.data.phantom.ventricle_voxels) "
        "on the age, with its standard error over masks (se) and t. Mask and noise are held, so the age alone "
        "varies: more sensitive than the correlation over all samples. ratio_to_real: against the real slope."),
    "covariate_age_ventricles_effect_real": (
        "Age effect in the data: ventricle voxels per year, real", "info",
        "The least-squares slope of the real phantom images' ventricle size on their own ages over the subjects of "
        "the split (se from its residuals): the effect the counterfactuals should reproduce."),
    "covariate_age_ventricles_effect_control": (
        "Negative control, counterfactual: ventricle voxels per year", "lower",
        "The same within-mask slope for control_ckpt, drawn with the same masks, noise and ages: a model that "
        "cannot follow the age stays near 0 (compare with its se, and with its training pairs' chance slope, "
        "covariate_age_ventricles_effect_control_data)."),
    "covariate_age_ventricles_effect_control_data": (
        "Negative control's training pairs: ventricle voxels per year", "info",
        "The least-squares slope of the control's real training images' ventricle size on the ages it trained them "
        "with (data.shuffle_covariates: another subject's), over its training split, with se from the residuals: "
        "the chance slope its pairs hold, which a control that learns its data draws; near 0 on many subjects, "
        "not on few (30 phantom subjects: +0.20 ± 0.53 voxels a year). Read the control's effect against it."),
    "covariate_sex_head_effect_generated": (
        "Sex effect, counterfactual: head voxels M − F, generated", "match",
        "With counterfactual=true each mask is drawn at F and at M with the same noise; the mean over masks of the "
        "difference in head size (voxdiff.data.phantom.head_voxels, the slope on the level's index), with se and "
        "t. ratio_to_real: against the real difference."),
    "covariate_sex_head_effect_real": (
        "Sex effect in the data: head voxels M − F, real", "info",
        "The least-squares slope of the real images' head size on their sex (0 F, 1 M) over the subjects of the "
        "split: the mean difference M − F, with se from its residuals."),
    "covariate_sex_head_effect_control": (
        "Negative control, counterfactual: head voxels M − F", "lower",
        "The same within-mask difference for control_ckpt, drawn with the same masks, noise and levels: near 0 "
        "(read against covariate_sex_head_effect_control_data)."),
    "covariate_sex_head_effect_control_data": (
        "Negative control's training pairs: head voxels M − F", "info",
        "The least-squares slope of the control's real training images' head size on the sex it trained them with "
        "(data.shuffle_covariates: another subject's; 0 F, 1 M), over its training split: the chance difference "
        "its pairs hold, which a control that learns its data draws."),
    # a probe's figures are stored per covariate (covariate_<name>_probe_...), with the covariate in their label
    "covariate_probe_generated": (
        "Covariate obeyed, by a probe: r(requested, probe's reading), generated", "higher",
        "A ridge regression from each volume's features (MedicalNet's where given, else the VQ-VAE encoder's, else "
        "the random ResNet-10's) to the covariate (a categorical one of two levels as 0/1), fitted on the real "
        "volumes of the split with their own values (penalty by leave-one-out error), reads each generated volume; "
        "the figure is Pearson's r between the value it was sampled at and the probe's reading. Any covariate, any "
        "data: no anatomy is assumed. Its ceiling is the real figure; a probe fitted on real volumes can misread "
        "generated ones unlike them."),
    "covariate_probe_real": (
        "Covariate in the data, by the probe: leave-one-out r, real", "info",
        "Pearson's r between the real volumes' own values and the probe's leave-one-out predictions (each volume "
        "read by the probe fitted without it): how much of the covariate the probe can read at all. At or below 0 "
        "it reads nothing, and its figures on generated volumes mean nothing: a probe that reads nothing predicts "
        "about the mean of the other volumes, which falls as a volume's own value rises (r down to -1)."),
    "covariate_probe_control": (
        "Negative control, by the probe: r(requested, probe's reading)", "lower",
        "The same figure for control_ckpt, sampled with the same masks, noise and values: near 0."),
    "reconstruction_ssim": ("Reconstruction SSIM", "higher",
                            "SSIM of each validation image against its VQ-VAE reconstruction (clamped to [0, 1])."),
    "reconstruction_psnr": ("Reconstruction PSNR, dB", "higher",
                            "PSNR of each validation image against its VQ-VAE reconstruction (peak 1)."),
    "reconstruction_ms_ssim": ("Reconstruction MS-SSIM", "higher",
                               "MS-SSIM of each validation image against its reconstruction (settings as above)."),
    "codebook_perplexity": (
        "Codebook perplexity", "higher",
        "exp(entropy) of the code histogram over the validation images and masks: the effective number of codes "
        "in use (1 … codebook size)."),
    "codebook_dead_codes": ("Dead codes", "lower",
                            "Codebook entries no latent of the validation images and masks uses."),
}


def figure(name: str, stats: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """A figure for ``metrics.json``: ``stats`` plus its label, direction and definition."""
    label, direction, definition = DEFINITIONS[name]
    return {**stats, **extra, "label": extra.get("label", label), "direction": direction,
            "definition": extra.get("definition", definition)}


def frechet_figure(extractor: FeatureExtractor, stats: Mapping[str, Any]) -> dict[str, Any]:
    """A Fréchet-distance figure on ``extractor``'s features."""
    kind = "FID" if extractor.comparable else "Fréchet distance"
    definition = (f"Fréchet distance between Gaussians fitted to {extractor.label} features of generated and real "
                  f"volumes ({stats['dim']} features, float64, matrix square root: {stats['sqrtm']}).")
    if not extractor.comparable:
        definition += " Not comparable to published FIDs (another feature extractor)."
    return {**stats, "label": f"{kind}, {extractor.label}", "direction": "lower", "definition": definition,
            "extractor": extractor.name}


class Drawn:
    """The intervals of one evaluation's figures, and the :class:`~voxdiff.evaluation.uncertainty.Resampler` each
    was drawn with (``resamplers``: a guidance sweep compares its evaluations on them,
    :func:`voxdiff.evaluation.guidance_sweep.summarise`).

    Args:
        sizes: ``{"generated": N, "real": R}``, the volumes of each set (and ``"masks"``: the masks of a
            counterfactual sweep, each drawn at every value).
        bootstrap: the intervals' settings; None: the figures have none (their resamplers are still kept).
    """

    def __init__(self, sizes: Mapping[str, int], bootstrap: U.Bootstrap | None) -> None:
        self.sizes, self.bootstrap = dict(sizes), bootstrap
        self.resamplers: dict[str, U.Resampler] = {}

    def with_interval(self, name: str, stats: Mapping[str, Any], resampler: U.Resampler) -> dict[str, Any]:
        """``stats`` of the figure ``name`` with its interval (:func:`~voxdiff.evaluation.uncertainty.interval`; a
        standard error ``stats`` has of its own, an effect's over masks, is kept)."""
        self.resamplers[name] = resampler
        if self.bootstrap is None:
            return dict(stats)
        return {**U.interval(resampler, self.sizes, self.bootstrap), **stats}


@dataclass
class VolumeSet:
    """Volumes ``(N, 1, D, H, W)`` in [0, 1] with their masks, affines ``(N, 4, 4)`` and names."""

    images: torch.Tensor
    masks: torch.Tensor
    affines: torch.Tensor
    subjects: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.images.shape[0])


def load_real(dataset: Dataset, n: int) -> VolumeSet:
    """The first ``n`` subjects of a dataset of contract samples (fewer if it holds fewer)."""
    items = [dataset[i] for i in range(min(n, len(dataset)))]
    if not items:
        raise ValueError("the split holds no subjects")
    return VolumeSet(torch.stack([s["image"] for s in items]).float(), torch.stack([s["mask"] for s in items]).float(),
                     torch.stack([torch.as_tensor(s["affine"]) for s in items]).double(),
                     [str(s["subject"]) for s in items])


def batches(n: int, size: int) -> Iterable[list[int]]:
    """Index lists ``[0..size), [size..2·size), ...`` covering ``range(n)``."""
    it = iter(range(n))
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def noise_batches(n: int, size: int, cycle: int | None = None) -> list[tuple[list[int], int]]:
    """The sampling batches of ``n`` samples, each with the key its noise is seeded by: ``batches(n, size)`` keyed
    by their order; with ``cycle`` (a multiple of it: the masks, each drawn once per cycle), the batches of each cycle
    apart, keyed by their place in the cycle, so that sample ``i`` gets the noise of sample ``i % cycle``: the same
    mask drawn in every cycle with the same noise (counterfactuals, at another covariate value per cycle)."""
    if cycle is None:
        return [(idx, b) for b, idx in enumerate(batches(n, size))]
    if n % cycle:
        raise ValueError(f"noise_batches: n={n} is not a multiple of the cycle {cycle}")
    return [([c * cycle + j for j in idx], b) for c in range(n // cycle) for b, idx in enumerate(batches(cycle, size))]


# ------------------------------------------------------------------------------------------------ diffusion
def diffusion_figures(real: VolumeSet, generated: torch.Tensor, sources: Sequence[int], mode: str,
                      extractors: Sequence[FeatureExtractor], bins: int = 64, device: str = "cpu",
                      ms_ssim: M.SSIMSettings = M.MS_SSIM_SETTINGS,
                      ventricles: Callable[[torch.Tensor], int] | None = None,
                      diversity_pairs: int | None = None, seed: int = 0, drawn: Drawn | None = None,
                      training: Iterable[tuple[torch.Tensor, Sequence[str]]] | None = None,
                      ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """All figures of a generated set against the real one.

    Args:
        real: the real volumes (``R`` subjects) whose masks conditioned the samples.
        generated: ``(N, 1, D, H, W)`` in [0, 1] (bravo: images; seg: masks).
        sources: ``N`` indices into ``real``: the subject whose mask sample ``i`` was conditioned on.
        mode: ``bravo`` or ``seg``.
        extractors: feature extractors for Fréchet distances.
        bins: histogram bins of the MMD.
        ms_ssim: the MS-SSIM settings (diversity and paired MS-SSIM).
        ventricles: where the real volumes are the built-in phantom's, its ventricle measure of one ``(1, D, H, W)``
            image (:func:`voxdiff.data.phantom.ventricle_voxels`, passed in by the command: the data layer is
            not the evaluation's to import): the ventricle figures are added.
        diversity_pairs, seed: the diversity figures over at most this many pairs of each set, drawn with ``seed``
            (:func:`voxdiff.evaluation.metrics.ms_ssim_pairs`); None: every pair.
        drawn: the intervals of the figures, for sets of ``N`` generated and ``R`` real volumes (:class:`Drawn`, which
            keeps each figure's resampler); None: none.
        training: the training split's volumes in chunks with their subjects (:func:`nearest_figures`: masks for
            ``seg``, images for ``bravo``); None: no nearest-training figures.

    Returns:
        ``(figures, absent)``: ``{name: figure}`` and ``{name: why it was not computed}``.
    """
    figures: dict[str, dict[str, Any]] = {}
    absent: dict[str, str] = {}
    drawn = drawn or Drawn({"generated": len(generated), "real": len(real)}, None)
    reference = real.images if mode == "bravo" else real.masks  # what the generated volumes should look like
    paired = reference[list(sources)]
    for of, volumes in (("generated", generated), ("real", reference)):
        if len(volumes) >= 2:
            pairs = M.ms_ssim_pairs(volumes, ms_ssim, diversity_pairs, seed)
            name = f"diversity_ms_ssim_{of}"
            figures[name] = figure(name, drawn.with_interval(name, pairs.summary(), U.diversity_of(pairs, of)))
    if len(real) < 2:
        absent["diversity_ms_ssim_real"] = "the split has 1 subject: no pair of real volumes"
    if mode == "bravo":
        masks = real.masks[list(sources)]
        for name, per_sample in (("ssim", M.ssim(generated, paired)), ("psnr", M.psnr(generated, paired)),
                                 ("ms_ssim", M.ms_ssim(generated, paired, ms_ssim))):
            figures[name] = figure(name, drawn.with_interval(name, M.summary(per_sample), U.mean_of(per_sample)))
        for of, images, where in (("generated", generated, masks), ("real", real.images, real.masks)):
            sums = M.intensity_sums(images, where)
            stats = M.intensity_stats(images, where, sums)
            name = f"lesion_contrast_{of}"
            figures[name] = figure(name, drawn.with_interval(name, {"value": stats["contrast"], "n": len(images),
                                                                    "intensity": stats}, U.contrast_of(sums, of)))
        figures.update(anatomy_figures(generated, real.images, ventricles, drawn))
    else:
        absent["ssim/psnr/ms_ssim"] = "seg mode generates masks without a paired real image"
        absent["anatomy"] = "seg mode generates masks: no anatomy to measure"
        figures.update(mask_figures(generated, real, drawn))
    if training is not None:
        figures.update(nearest_figures(generated, real, mode, training, drawn))
    h_gen, h_real = M.histograms(generated, bins), M.histograms(reference, bins)
    if min(len(generated), len(real)) >= 2:
        figures["mmd_histogram"] = figure("mmd_histogram", M.mmd(h_gen, h_real))
        for extractor in extractors:
            stats = M.frechet_distance(extractor(generated, device=device), extractor(reference, device=device))
            figures[f"frechet_{extractor.name}"] = frechet_figure(extractor, stats)
    else:
        absent["mmd_histogram"] = absent["frechet"] = (
            f"{len(real)} real volume(s): a distribution figure needs at least 2 per set (n=2 or more, and a split "
            "with 2 or more subjects)")
    return figures, absent


def _resampled(drawn: Drawn, name: str, resampler: U.Resampler, **stats: Any) -> dict[str, Any]:
    """The figure ``name`` with its value computed by its ``resampler`` on every volume of its sets, ``stats`` beside
    it and its interval where ``drawn`` has a bootstrap."""
    value = float(resampler({s: torch.arange(drawn.sizes[s]) for s in resampler.sets}))
    return figure(name, drawn.with_interval(name, {"value": value, **stats}, resampler))


def mask_figures(generated: torch.Tensor, real: VolumeSet, drawn: Drawn | None = None) -> dict[str, dict[str, Any]]:
    """What generated masks ``(N, 1, D, H, W)`` in [0, 1] (``mode=seg``) are made of against the real masks of
    ``real``: lesions per mask, lesion voxels per mask, voxels per lesion and the share of lesion voxels outside the
    population's head (:func:`voxdiff.evaluation.lesions.population_head` of the real images); each with its
    interval where ``drawn`` has a bootstrap."""
    drawn = drawn or Drawn({"generated": len(generated), "real": len(real)}, None)
    head = L.population_head(real.images)
    tables = {"generated": L.lesion_table(generated, head), "real": L.lesion_table(real.masks, head)}
    out: dict[str, dict[str, Any]] = {}
    for of, t in tables.items():
        out[f"lesion_count_{of}"] = _resampled(drawn, f"lesion_count_{of}", U.mean_of(t.lesions, of), n=len(t),
                                               per_mask=[int(v) for v in t.lesions.tolist()])
        out[f"lesion_load_{of}"] = _resampled(drawn, f"lesion_load_{of}", U.mean_of(t.voxels, of), n=len(t))
        out[f"lesion_size_{of}"] = _resampled(drawn, f"lesion_size_{of}", U.share_of(t.voxels, t.lesions, of),
                                              n=len(t), lesions=int(t.lesions.sum()),
                                              size_histogram=L.size_histogram(t.sizes))
        out[f"lesion_outside_head_{of}"] = _resampled(
            drawn, f"lesion_outside_head_{of}", U.share_of(t.outside, t.voxels, of), n=len(t),
            head_voxels=int(head.sum()))
    for name in ("lesion_count", "lesion_load", "lesion_size"):
        real_value = out[f"{name}_real"]["value"]
        if real_value:
            out[f"{name}_generated"]["ratio_to_real"] = out[f"{name}_generated"]["value"] / real_value
    return out


def denoising_figures(denoised: Mapping[float, torch.Tensor], real: VolumeSet, drawn: Drawn | None = None
                      ) -> dict[str, dict[str, Any]]:
    """How a mask model denoises the real masks of ``real`` (``mode=seg``): ``denoised`` holds, for each fraction
    of the schedule (:data:`DENOISE_AT`), the model's one-step estimates ``(R, 1, D, H, W)`` in {0, 1} of the
    ``R`` real masks noised there (:meth:`voxdiff.step.TrainStep.denoised`). Each figure is the mean Dice over
    the masks with a lesion, with its interval over the real masks where ``drawn`` has a bootstrap, and
    ``lesion_load_ratio``: the voxels returned as lesion over the real lesion voxels."""
    drawn = drawn or Drawn({"generated": 0, "real": len(real)}, None)
    truth = real.masks > L.MASK_THRESHOLD  # (R, 1, D, H, W)
    out: dict[str, dict[str, Any]] = {}
    for fraction, masks in denoised.items():
        if tuple(masks.shape) != tuple(real.masks.shape):
            raise ValueError(f"denoised masks {tuple(masks.shape)} are not the real ones {tuple(real.masks.shape)}")
        # (R,): one mask at a time, never an (R, V) copy; the real mask is the query, so an empty real mask gives
        # NaN (left out) and an empty estimate of a real lesion gives 0
        dice = torch.stack([L.similarity(r[None].float(), m[None].float(), "dice")[0, 0]
                            for m, r in zip(masks, truth)])
        name = f"denoised_dice_t{round(fraction * 100):02d}"
        real_voxels = float(truth.sum())
        out[name] = _resampled(drawn, name, U.present_mean_of(dice, "real"), n=int((~dice.isnan()).sum()),
                               fraction=fraction, per_mask=[round(v, 6) for v in dice.tolist()],
                               lesion_load_ratio=float((masks > L.MASK_THRESHOLD).sum()) / real_voxels
                               if real_voxels else None)
    return out


def nearest_figures(generated: torch.Tensor, real: VolumeSet, mode: str,
                    training: Iterable[tuple[torch.Tensor, Sequence[str]]], drawn: Drawn | None = None
                    ) -> dict[str, dict[str, Any]]:
    """How near the generated volumes ``(N, 1, D, H, W)`` and the held-out real ones of ``real`` come to the training
    split, streamed as chunks ``(volumes (m, 1, D, H, W), their subjects)`` (masks for ``seg``, images for
    ``bravo``): :func:`voxdiff.evaluation.lesions.nearest_similarity` of each set (Dice of masks, Pearson's r of
    images), and the share of generated volumes nearer than any held-out one (memorisation)."""
    drawn = drawn or Drawn({"generated": len(generated), "real": len(real)}, None)
    measure = "dice" if mode == "seg" else "pearson"
    held_out = real.masks if mode == "seg" else real.images
    names: list[str] = []

    def volumes() -> Iterable[torch.Tensor]:
        for chunk, subjects in training:
            names.extend(subjects)
            yield chunk

    nearest, index, seen = L.nearest_similarity(torch.cat([generated, held_out]), volumes(), measure)
    n = len(generated)
    out: dict[str, dict[str, Any]] = {}
    for of, values, at in (("generated", nearest[:n], index[:n]), ("real", nearest[n:], index[n:])):
        out[f"nearest_training_{of}"] = _resampled(
            drawn, f"nearest_training_{of}", U.present_mean_of(values, of), n=int((~values.isnan()).sum()),
            measure=measure, training_volumes=seen, per_volume=[round(v, 6) for v in values.tolist()],
            subjects=[names[i] if i >= 0 else None for i in at.tolist()])
    out["nearest_training_copies"] = _resampled(drawn, "nearest_training_copies", U.beyond_of(nearest[:n], nearest[n:]),
                                                n=int((~nearest[:n].isnan()).sum()), measure=measure)
    return out


def anatomy_figures(generated: torch.Tensor, real: torch.Tensor,
                    ventricles: Callable[[torch.Tensor], int] | None = None, drawn: Drawn | None = None
                    ) -> dict[str, dict[str, Any]]:
    """Is the anatomy drawn? Sharpness and tissue mix of generated ``(N, 1, D, H, W)`` against real
    ``(R, 1, D, H, W)`` images in [0, 1] (:func:`voxdiff.evaluation.metrics.anatomy_comparison`); with
    ``ventricles`` (the phantom's :func:`voxdiff.data.phantom.ventricle_voxels`), the ventricle counts too; each with
    its interval where ``drawn`` has a bootstrap."""
    drawn = drawn or Drawn({}, None)
    gen, ref = M.anatomy_stats(generated), M.anatomy_stats(real)
    c = M.anatomy_comparison(generated, real, (gen, ref))
    classes = {"fractions_generated": c["fractions_generated"], "fractions_real": c["fractions_real"]}
    out = {
        "anatomy_sharpness": figure("anatomy_sharpness", drawn.with_interval("anatomy_sharpness", {
            "value": c["sharpness_ratio"], "n": len(generated), "generated": c["sharpness_generated"],
            "real": c["sharpness_real"], "head_voxels_generated": c["head_voxels_generated"],
            "head_voxels_real": c["head_voxels_real"]}, U.ratio_of(gen["sharpness"], ref["sharpness"]))),
        "anatomy_tissue_distance": figure("anatomy_tissue_distance", drawn.with_interval("anatomy_tissue_distance", {
            "value": c["tissue_distance"], "n": len(generated), "dark_ratio": c["dark_ratio"], **classes},
            U.tissue_distance_of(gen["fractions"], ref["fractions"]))),
    }
    if ventricles is not None:
        counts = {name: torch.tensor([ventricles(v) for v in volumes], dtype=torch.float64)
                  for name, volumes in (("generated", generated), ("real", real))}
        ratio = float(counts["generated"].mean() / counts["real"].mean()) if counts["real"].sum() > 0 else math.nan
        for of, values in counts.items():
            name = f"ventricle_voxels_{of}"
            out[name] = figure(name, drawn.with_interval(name, {
                **M.summary(values), "per_volume": values.tolist(),
                **({"ratio_to_real": ratio} if of == "generated" else {})}, U.mean_of(values, of)))
    return out


def histogram_section(real: VolumeSet, generated: torch.Tensor, sources: Sequence[int], bins: int,
                      label: str = "generated") -> tuple[str, str, list[tuple[str, str]]]:
    """The report's histogram section (real vs generated, inside and outside the masks)."""
    png = histogram_png(real.images, generated, real.masks, real.masks[list(sources)], bins=bins, label=label)
    note = ("Voxel intensities pooled over all volumes of each set; generated volumes are masked with the mask "
            "they were conditioned on. Log density.")
    return "Intensity histograms: real vs " + label, note, [(data_uri(png), f"{bins} bins over [0, 1]")]


def lesion_section(figures: Mapping[str, Mapping[str, Any]]) -> tuple[str, str, list[tuple[str, str]]]:
    """The report's lesion section of a mask model (``mode=seg``): how the lesions are spread over the masks and
    over sizes, generated against real (:func:`voxdiff.evaluation.report.lesion_distribution_png`), from the
    figures of :func:`mask_figures` (each set's ``per_mask`` counts and ``size_histogram``). A mean hides what this
    shows: masks that are all empty but one, or one real-sized lesion beside a cloud of single voxels."""
    counts = {of: figures[f"lesion_count_{of}"]["per_mask"] for of in ("real", "generated")}
    sizes = {of: figures[f"lesion_size_{of}"]["size_histogram"] for of in ("real", "generated")}
    png = lesion_distribution_png(counts, sizes)
    note = ("Left: the share of masks with each number of lesions (26-connected components above 0.5). Right: the "
            "share of lesions in each size band, from 2^k up to 2^(k+1) voxels. Generated masks against "
            "the real masks of the split.")
    return "Lesions: real vs generated masks", note, [(data_uri(png), "lesions per mask and voxels per lesion")]


def montage_section(pngs: Sequence[Path], k: int, what: str) -> tuple[str, str, list[tuple[str, str]]]:
    """The report's montage section: the first ``k`` montage PNGs, embedded."""
    note = (f"{what} on the axial, coronal and sagittal mid-planes (grey scale fixed to [0, 1]); the NIfTI files "
            "beside this report carry the source affine.")
    return "Montages", note, [(data_uri(p), p.stem) for p in pngs[:k]]


# ------------------------------------------------------------------------------------------------ VQ-VAE
@torch.no_grad()
def vqvae_reconstructions(system: Any, real: VolumeSet, batch_size: int, device: torch.device
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reconstruct the real images with a :class:`~voxdiff.lightning.vqvae.VQVAESystem`.

    Returns:
        ``(reconstructions (N, 1, D, H, W) clamped to [0, 1], code indices of images and masks (2N, d, h, w))``.
    """
    recons, codes = [], []
    ae = system.vqvae
    for idx in batches(len(real), batch_size):  # on the device one chunk at a time (its memory:
        x = real.images[idx].to(device)         # voxdiff.preflight.stage1.trace_reconstruction)
        recons.append(system(x)[0].float().clamp(0, 1).cpu())  # the latents are let go with the forward's tuple
        codes += [ae.index_quantize(x).cpu(), ae.index_quantize(real.masks[idx].to(device)).cpu()]
        del x
    return torch.cat(recons), torch.cat(codes)


def vqvae_figures(real: VolumeSet, recon: torch.Tensor, codes: torch.Tensor, num_embeddings: int,
                  ms_ssim: M.SSIMSettings = M.MS_SSIM_SETTINGS, bootstrap: U.Bootstrap | None = None
                  ) -> dict[str, dict[str, Any]]:
    """Reconstruction figures (each with its interval where ``bootstrap`` is given) and codebook usage of a VQ-VAE
    on the real set."""
    usage = M.codebook_usage(codes, num_embeddings)
    per_volume = {"reconstruction_ssim": M.ssim(recon, real.images), "reconstruction_psnr": M.psnr(recon, real.images),
                  "reconstruction_ms_ssim": M.ms_ssim(recon, real.images, ms_ssim)}
    drawn = Drawn({"generated": len(recon)}, bootstrap)  # the reconstructions, each paired with its image
    return {
        **{name: figure(name, drawn.with_interval(name, M.summary(v), U.mean_of(v))) for name, v in per_volume.items()},
        "codebook_perplexity": figure("codebook_perplexity", {"value": usage["perplexity"], "n": len(real),
                                                              **usage}),
        "codebook_dead_codes": figure("codebook_dead_codes", {"value": usage["dead"], "n": len(real), **usage}),
    }
