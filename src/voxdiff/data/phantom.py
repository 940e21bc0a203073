"""A procedural brain-like T1 phantom with contrast-enhancing lesions: the built-in demo data (no download).

Axis convention: a volume ``(D, H, W)`` is in RAS voxel order, the same as real data after
``Orientationd(axcodes="RAS")`` and consistent with the identity affine that :class:`PhantomDataset` returns:

* axis 0 (``D``): left → right,
* axis 1 (``H``): posterior → anterior,
* axis 2 (``W``): inferior → superior.

Everything is generated on a voxel-centre grid in normalised "anatomical units" (the head spans about
``[-1, 1]``), so it scales with ``volume_shape`` (16³ up to 160×256×256; the axes need not be equal) and costs a
few vectorised numpy passes over the volume. Each axis is scaled so that the head fills it, but no axis is
stretched more than 1.25× relative to the tightest one, so a 160×256×256 volume keeps a head-like aspect.

Anatomy, outside in: background, scalp (skin and bright subcutaneous fat), skull (dark cortical tables with
brighter diploë), a CSF rim, the folded grey-matter cortex (sulci from zero crossings of smooth random noise),
white matter (brighter than grey matter, as in T1), the interhemispheric fissure, deep grey nuclei, two lateral
ventricles and a third ventricle, the cerebellum with folia under the tentorium, the brainstem and the neck.
Then 1–4 blobby lesions (mostly in white matter) that enhance like metastases on post-contrast T1 (bright rim,
solid or necrotic core, T1-dark oedema around them), a mild smooth bias field, Rician noise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from voxdiff.errors import ConfigError

#: tissue label values of the label map returned by ``make_phantom(..., return_labels=True)``
LABELS: dict[str, int] = {
    "background": 0,
    "scalp": 1,
    "skull": 2,
    "csf": 3,
    "grey_matter": 4,
    "white_matter": 5,
    "ventricle": 6,
    "deep_grey": 7,
    "lesion": 8,
    "oedema": 9,
}

_BG, _SCALP, _SKULL, _CSF, _GM, _WM, _VENT, _DGM, _LES, _OED = range(10)
_PARENCHYMA = (_GM, _WM, _DGM)

# brain-normalised radius of the shells outside the brain (the brain surface is at 1)
_CSF_OUT = 1.05
_SKULL_OUT = 1.16
_HEAD_OUT = 1.28
# cortex in anatomical units (the head spans about [-1, 1]; 0.01 is about 1.1 mm of a real head)
_GM_THICKNESS = 0.034
_SULCUS_DEPTH = 0.12
# half-extent of the anatomy per axis (left-right, posterior-anterior, inferior-superior), its centre offset,
# and how much more one axis may be stretched than the tightest one to fill the volume
_EXTENT = (0.86, 0.97, 0.9)
_OFFSET = (0.0, 0.0, 0.03)
_MAX_STRETCH = 1.25
# point-spread (standard deviation, anatomical units) of the partial-volume smoothing: about 0.7 mm
_PSF_SIGMA = 0.0065


#: the phantom's covariates, its participants table's columns: ``name: (kind, levels or range)``. Drawn per subject
#: by :func:`phantom_covariates`; with ``data.covariates`` they shape the anatomy (:func:`make_phantom`)
PHANTOM_COVARIATES: dict[str, tuple[str, tuple[Any, ...]]] = {
    "age": ("numeric", (20, 90)),  # years: the ventricles and the sulci widen with it
    "sex": ("categorical", ("F", "M")),  # the head is 5% larger for M
    "lesion_load": ("numeric", (1, 4)),  # the number of lesions
}


def phantom_covariates(seed: int) -> dict[str, Any]:
    """The covariates of phantom subject ``seed`` (its own random stream: the anatomy's draws are untouched)."""
    rng = np.random.default_rng([int(seed), 28])
    return {"age": int(rng.integers(20, 91)), "sex": "FM"[int(rng.integers(0, 2))],
            "lesion_load": int(rng.integers(1, 5))}


#: the central box (anatomical units, per axis) that holds the phantom's ventricles, and the intensity below which a
#: voxel counts as CSF there (CSF and ventricles are 0.07-0.10, grey matter 0.42, deep grey 0.56, white matter 0.70)
_VENTRICLE_BOX = ((-0.25, 0.25), (-0.4, 0.25), (-0.12, 0.3))
_CSF_BELOW = 0.25


def _volume(image: Any) -> np.ndarray:
    """An image ``(D, H, W)`` or ``(1, D, H, W)`` (array or tensor, on any device) as a float32 ``(D, H, W)`` array."""
    array = np.asarray(image.detach().cpu() if isinstance(image, torch.Tensor) else image, dtype=np.float32)
    return array.reshape(array.shape[-3:])


def ventricle_voxels(image: Any) -> int:
    """How many voxels of a phantom-like image ``(D, H, W)`` (or ``(1, D, H, W)``) in [0, 1] are CSF-dark inside the
    central box that holds the ventricles: the evaluation's measure of ventricle size, for real and generated
    images alike. On 40 phantom subjects at 32×48×48 it correlates with the drawn ventricle volume at r = 0.95 and,
    with covariates, with age at r = 0.89 (0.01 without them)."""
    array = _volume(image)
    axes, _ = _grid(array.shape)  # type: ignore[arg-type]
    inside = [(a >= lo) & (a <= hi) for a, (lo, hi) in zip(axes, _VENTRICLE_BOX, strict=True)]
    box = inside[0][:, None, None] & inside[1][None, :, None] & inside[2][None, None, :]
    return int(((array < _CSF_BELOW) & box).sum())


_HEAD_ABOVE = 0.05


def head_voxels(image: Any) -> int:
    """How many voxels of a phantom-like image ``(D, H, W)`` (or ``(1, D, H, W)``) in [0, 1] are above the background
    (0.05): the evaluation's measure of head size, for real and generated images alike. The phantom's head is 5%
    larger for ``sex=M``: on 60 phantom subjects at 32×48×48 this count is 10% larger for M (31,804 against 28,904
    voxels, SD 2,998) and correlates with sex (M = 1) at r = 0.47."""
    return int((_volume(image) > _HEAD_ABOVE).sum())


#: what each phantom covariate changes and the measure of it that the evaluation correlates with the covariate:
#: covariate -> (measure's name, measure of one image, axis label)
COVARIATE_EFFECTS: dict[str, tuple[str, Any, str]] = {
    "age": ("ventricles", ventricle_voxels, "ventricle voxels (CSF-dark, central box)"),
    "sex": ("head", head_voxels, "head voxels (above the background)"),
}


def check_volume_shape(volume_shape: Any, key: str = "data.volume_shape") -> tuple[int, int, int]:
    """Validate a ``(D, H, W)`` volume shape and return it as a tuple of Python ints.

    Accepts any sequence, including an OmegaConf ``ListConfig``.

    Raises:
        ConfigError: not three positive integers; the message names ``key``, the value and the fix.
    """
    fix = f"set {key} to three positive integers [D, H, W], e.g. {key}=[64,64,64]"
    if isinstance(volume_shape, (str, bytes)) or not isinstance(volume_shape, Iterable):
        raise ConfigError(key, volume_shape, "a volume shape is a list of three sizes (D, H, W)", fix)
    values = list(volume_shape)
    if len(values) != 3:
        raise ConfigError(key, values, f"a volume shape is three sizes (D, H, W), got {len(values)}", fix)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ConfigError(key, values, f"{v!r} is not an integer", fix)
        if v <= 0:
            raise ConfigError(key, values, f"{v} is not a positive size", fix)
    return (int(values[0]), int(values[1]), int(values[2]))


def _grid(shape: tuple[int, int, int]) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """Voxel-centre coordinates of the three axes in anatomical units, and the voxel size per axis.

    The head spans about ``[-1, 1]`` anatomical units. Each axis is scaled so that the head fills it, but no
    axis is stretched more than ``_MAX_STRETCH`` relative to the tightest one, so an anisotropic
    ``volume_shape`` (e.g. 160×256×256) keeps a head-like aspect ratio instead of a squashed one.

    Returns:
        ``((x (D,), y (H,), z (W,)), voxel (3,))``, float32 coordinates and float64 voxel sizes.
    """
    fill = [e / (n / 2.0) for e, n in zip(_EXTENT, shape, strict=True)]
    tight = max(fill)
    voxel = np.array([max(f, tight / _MAX_STRETCH) for f in fill])
    axes = tuple(
        (((np.arange(n) + 0.5) - n / 2.0) * v + o).astype(np.float32)
        for n, v, o in zip(shape, voxel, _OFFSET, strict=True)
    )
    return axes, voxel  # type: ignore[return-value]


def _rbf_basis(coords: np.ndarray, n_ctrl: int, lo: float = -1.2, hi: float = 1.2) -> np.ndarray:
    """Gaussian bumps at ``n_ctrl`` centres, rows L2-normalised: ``(len(coords), n_ctrl)`` float32.

    With i.i.d. unit-normal coefficients, the field ``basis @ coeffs`` then has unit variance everywhere.
    """
    centres = np.linspace(lo, hi, n_ctrl, dtype=np.float32)
    width = (hi - lo) / (n_ctrl - 1) * 0.85
    phi = np.exp(-0.5 * ((coords[:, None] - centres[None, :]) / width) ** 2)
    phi /= np.sqrt((phi**2).sum(axis=1, keepdims=True))
    return phi.astype(np.float32)


def _smooth_field(coeffs: np.ndarray, axes: tuple[np.ndarray, np.ndarray, np.ndarray], span: float = 1.2) -> np.ndarray:
    """Band-limited unit-variance random field on the grid ``axes``: ``(len(a0), len(a1), len(a2))`` float32.

    Args:
        coeffs: ``(K, K, K)`` i.i.d. unit-normal coefficients; ``K`` sets the frequency (about K/2 bumps per unit).
        axes: the coordinates of the three axes (anatomical units).
        span: the control points cover ``[-span, span]``.
    """
    k = coeffs.shape[0]
    b0, b1, b2 = (_rbf_basis(a, k, -span, span) for a in axes)
    t = np.einsum("ai,ijk->ajk", b0, coeffs.astype(np.float32))  # (D, K, K)
    t = np.einsum("bj,ajk->abk", b1, t)  # (D, H, K)
    return np.ascontiguousarray(t @ b2.T, dtype=np.float32)  # (D, H, W)


def _rbf_gradient_rms(n_ctrl: int, span: float = 1.2) -> float:
    """Root-mean-square gradient magnitude of a :func:`_smooth_field` with ``n_ctrl`` control points per axis.

    ``|field| / gradient`` then approximates the distance to the field's zero sheet.
    """
    t = np.linspace(-1.0, 1.0, 2001, dtype=np.float64)
    b = _rbf_basis(t.astype(np.float32), n_ctrl, -span, span).astype(np.float64)
    db = np.gradient(b, t, axis=0)
    return float(np.sqrt(3.0 * np.mean((db**2).sum(axis=1))))


class _Lattice:
    """A :func:`_smooth_field` tabulated on a fine lattice over ``[-1.2, 1.2]³``, sampled trilinearly at any points.

    Used where the field is needed at scattered points (a voxel's projection onto a surface) rather than on the
    voxel grid.
    """

    def __init__(self, coeffs: np.ndarray, n: int = 121, span: float = 1.2) -> None:
        t = np.linspace(-span, span, n, dtype=np.float32)
        self.values = _smooth_field(coeffs, (t, t, t), span=span).ravel()
        self.n = n
        self.lo = -span
        self.step = 2.0 * span / (n - 1)
        self.gradient_rms = _rbf_gradient_rms(coeffs.shape[0], span)

    def __call__(self, px: np.ndarray, py: np.ndarray, pz: np.ndarray, *, linear: bool = True) -> np.ndarray:
        """Field values at the points ``(px, py, pz)`` (same-shape arrays) → float32 array of that shape.

        ``linear=False`` takes the nearest lattice value (one gather instead of eight; fine for slow fields).
        """
        n = self.n
        scale = np.float32(1.0 / self.step)
        lo = np.float32(self.lo)
        if not linear:
            ijk = [
                np.clip(np.rint((np.asarray(q, np.float32) - lo) * scale), 0, n - 1).astype(np.intp)
                for q in (px, py, pz)
            ]
            return self.values[(ijk[0] * n + ijk[1]) * n + ijk[2]]
        idx = []
        frac = []
        for q in (px, py, pz):
            f = (np.asarray(q, dtype=np.float32) - lo) * scale
            i = np.clip(np.floor(f), 0, n - 2).astype(np.intp)
            idx.append(i)
            frac.append(np.clip(f - i, 0.0, 1.0).astype(np.float32))
        base = (idx[0] * n + idx[1]) * n + idx[2]
        v = self.values
        tx, ty, tz = frac

        def along_z(offset: int) -> np.ndarray:
            a = v[base + offset]
            return a + tz * (v[base + offset + 1] - a)

        def along_y(offset: int) -> np.ndarray:
            a = along_z(offset)
            return a + ty * (along_z(offset + n) - a)

        a = along_y(0)
        return a + tx * (along_y(n * n) - a)


def _partial_volume(x: np.ndarray, voxel: np.ndarray, sigma: float = _PSF_SIGMA) -> np.ndarray:
    """Separable 3-tap ``[a, 1 - 2a, a]`` smoothing (edge-replicated): soft, partial-volume tissue edges.

    The point-spread is ``sigma`` anatomical units, but at least about half a voxel (anti-aliasing at coarse
    sizes) and at most ``[1, 2, 1] / 4``. ``(D, H, W)`` → ``(D, H, W)`` float32.
    """
    out = x
    for axis in range(3):
        # variance of the 3-tap kernel is 2a voxels²: at least ~0.5 voxel of blur (anti-aliasing) at any size
        a = float(min(0.25, max(0.15, 0.5 * (sigma / voxel[axis]) ** 2)))
        if out.shape[axis] < 3 or a < 1e-3:
            continue
        src = out
        out = np.float32(1.0 - 2.0 * a) * src
        lo = [slice(None)] * 3
        hi = [slice(None)] * 3
        lo[axis] = slice(1, None)
        hi[axis] = slice(None, -1)
        out[tuple(lo)] += np.float32(a) * src[tuple(hi)]
        out[tuple(hi)] += np.float32(a) * src[tuple(lo)]
        first = [slice(None)] * 3
        last = [slice(None)] * 3
        first[axis] = slice(0, 1)
        last[axis] = slice(-1, None)
        out[tuple(first)] += np.float32(a) * src[tuple(first)]
        out[tuple(last)] += np.float32(a) * src[tuple(last)]
    return out.astype(np.float32, copy=False)


def _rotation(angles: np.ndarray) -> np.ndarray:
    """3×3 rotation from three small angles (radians) about the three axes."""
    ax, ay, az = (float(a) for a in angles)
    rx = np.array([[1, 0, 0], [0, np.cos(ax), -np.sin(ax)], [0, np.sin(ax), np.cos(ax)]])
    ry = np.array([[np.cos(ay), 0, np.sin(ay)], [0, 1, 0], [-np.sin(ay), 0, np.cos(ay)]])
    rz = np.array([[np.cos(az), -np.sin(az), 0], [np.sin(az), np.cos(az), 0], [0, 0, 1]])
    return (rz @ ry @ rx).astype(np.float32)


def _box(
    axes: tuple[np.ndarray, np.ndarray, np.ndarray], lo: Sequence[float], hi: Sequence[float]
) -> tuple[slice, ...]:
    """The voxel box whose grid coordinates lie in ``[lo, hi]`` per axis (a tuple of three slices, maybe empty)."""
    box = []
    for a, low, high in zip(axes, lo, hi, strict=True):
        idx = np.flatnonzero((a >= low) & (a <= high))
        box.append(slice(int(idx[0]), int(idx[-1]) + 1) if idx.size else slice(0, 0))
    return tuple(box)


def _ellipsoid(x: Any, y: Any, z: Any, centre: Sequence[float], semi: Sequence[float]) -> np.ndarray:
    """Squared ellipsoidal radius (< 1 inside); ``x, y, z`` are broadcastable arrays or scalars."""
    return ((x - centre[0]) / semi[0]) ** 2 + ((y - centre[1]) / semi[1]) ** 2 + ((z - centre[2]) / semi[2]) ** 2


def make_phantom(
    volume_shape: Sequence[int], seed: int, *, return_labels: bool = False, covariates: bool = False
) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Generate one phantom subject: a T1-like post-contrast head volume and its lesion mask.

    Deterministic: the same ``(volume_shape, seed)`` gives bit-identical arrays (on one numpy build). Each seed
    gets its own smooth deformation, size, position and pose, folding pattern, ventricle size, tissue contrast,
    bias field, noise and lesions.

    Args:
        volume_shape: ``(D, H, W)`` = (left→right, posterior→anterior, inferior→superior) sizes, any
            positive ints.
        seed: the subject's random seed.
        return_labels: also return the tissue label map (values in :data:`LABELS`).
        covariates: let the subject's covariates (:func:`phantom_covariates`) shape it: age sets the ventricle
            size (0.8 at 20 years to 1.7 at 90, where the drawn size is 0.85-1.5 otherwise) and widens the sulci
            (their clefts 1x to 2x as wide), sex scales the head (F 0.975, M 1.025), lesion_load is the number of
            lesions. False: the phantom as it always was (bit-identical), covariates or not in its table.

    Returns:
        ``(image, mask)`` or ``(image, mask, labels)``: image ``(D, H, W)`` float32 in [0, 1]; mask
        ``(D, H, W)`` float32, 1 exactly on lesion voxels, else 0; labels ``(D, H, W)`` uint8.
    """
    shape = check_volume_shape(volume_shape, key="volume_shape")
    rng = np.random.default_rng(int(seed))

    # ---- per-subject parameters (all drawn up front, in a fixed order) ----
    scale = rng.uniform(0.94, 1.04) * rng.uniform(0.97, 1.03, size=3)
    shift = rng.uniform(-0.03, 0.03, size=3)
    rot = _rotation(rng.normal(0.0, np.deg2rad(3.0), size=3))
    warp_coeffs = rng.standard_normal((3, 5, 5, 5))
    fold_coeffs = rng.standard_normal((48, 48, 48))
    slow_coeffs = rng.standard_normal((10, 10, 10))
    fissure_coeffs = rng.standard_normal((5, 5, 5))
    shell_coeffs = rng.standard_normal((4, 4, 4))
    bias_coeffs = rng.standard_normal((3, 3, 3))
    texture_coeffs = rng.standard_normal((8, 8, 8))
    ventricle_size = rng.uniform(0.85, 1.5)
    ventricle_asym = rng.uniform(-0.1, 0.1)
    contrast = rng.uniform(0.96, 1.04, size=10)
    noise_sigma = rng.uniform(0.012, 0.022)
    n_lesions = int(rng.integers(1, 5))
    # per lesion: position (quantile of the white-matter voxels), radius, axis stretch, kind, shape noise
    if covariates:  # the draws above are made all the same: every other property of the subject stays as it was
        known = phantom_covariates(seed)
        age = (known["age"] - 20) / 70.0
        ventricle_size = 0.8 + 0.9 * age
        scale = scale * (1.025 if known["sex"] == "M" else 0.975)
        n_lesions = int(known["lesion_load"])
    cleft_half_width = 0.008 * (1.0 + age) if covariates else 0.008
    lesion_draws = [
        (
            rng.random(),
            rng.uniform(0.035, 0.10),
            rng.uniform(0.75, 1.3, size=3),
            rng.random(),
            rng.standard_normal((4, 4, 4)),
        )
        for _ in range(n_lesions)
    ]

    (ax0, ax1, ax2), voxel = _grid(shape)
    axes = (ax0, ax1, ax2)
    # ---- deformed anatomical coordinates p = R^T (g - shift) / scale + warp(g) ----
    g = (ax0[:, None, None], ax1[None, :, None], ax2[None, None, :])
    c = [(g[i] - np.float32(shift[i])) for i in range(3)]
    p = [sum(rot[j, i] * c[j] for j in range(3)) / np.float32(scale[i]) for i in range(3)]
    for i in range(3):
        p[i] = (p[i] + 0.03 * _smooth_field(warp_coeffs[i], axes)).astype(np.float32)
    x, y, z = p  # x: left→right, y: posterior→anterior, z: inferior→superior
    del c, p

    # ---- intracranial (brain-normalised) radius: an egg, wider at the back, flatter below ----
    a_x = 0.63 * (1.0 - 0.08 * y)
    a_y = np.float32(0.74)
    zc = z - 0.06
    a_z = np.where(zc > 0, np.float32(0.64), np.float32(0.50))
    rho = np.sqrt((x / a_x) ** 2 + (y / a_y) ** 2 + (zc / a_z) ** 2).astype(np.float32)
    del a_x, a_z
    shell = 0.025 * _smooth_field(shell_coeffs, axes)  # skull/scalp thickness variation

    labels = np.zeros(shape, dtype=np.uint8)
    neck = (((x / 0.40) ** 2 + ((y + 0.10) / 0.46) ** 2) < 1.0) & (z < -0.3)
    head = (rho < _HEAD_OUT + shell) | neck
    labels[head] = _SCALP
    labels[(rho < _SKULL_OUT + shell) & (rho >= _CSF_OUT)] = _SKULL
    intracranial = rho < _CSF_OUT
    labels[intracranial] = _CSF

    # ---- compartments: cerebellum below the tentorium, brainstem, cerebrum elsewhere ----
    z_tent = -0.17 + 0.32 * (y + 0.15)  # the tentorium slopes down towards the back
    cerebellum = intracranial & (rho < 1.0) & (z < z_tent) & (y < -0.06)
    stem = np.zeros(shape, dtype=bool)
    b = _box(axes, (-0.4, -0.5, -1.5), (0.4, 0.35, 0.2))
    pons = np.exp(-(((z[b] + 0.26) / 0.13) ** 2))
    stem_r = 0.075 + 0.045 * pons
    stem[b] = ((x[b] / stem_r) ** 2 + ((y[b] + 0.04 - 0.05 * pons) / stem_r) ** 2 < 1.0) & (z[b] < 0.0)
    cerebrum = intracranial & ~cerebellum & ~stem
    del pons, stem_r
    # the central box that holds the deep structures, whatever the deformation
    cb = _box(axes, (-0.6, -0.7, -0.4), (0.6, 0.6, 0.5))
    xc_, yc_, zc_ = x[cb], y[cb], z[cb]

    # cortex: distance below the nearest pial surface (anatomical units). The pial surfaces are the outer surface,
    # the interhemispheric fissure, the tentorium and the sulci. Sulci are thin clefts along the zero sheets of a
    # smooth random field sampled at the voxel's projection onto its nearest surface, so the sheets run
    # perpendicular to the surface (as real sulci do) and reach a varying depth. Grey matter is the first
    # ``_GM_THICKNESS`` of that distance, white matter lies below.
    depth_out = (1.0 - rho) * 0.62
    x_fis = 0.012 * _smooth_field(fissure_coeffs, axes)  # the midline wanders a little
    depth_fis = np.abs(x - x_fis) - 0.006
    core = ((yc_ + 0.04) / 0.46) ** 2 + ((zc_ - 0.03) / 0.24) ** 2 < 1.0  # corpus callosum and deep structures
    depth_fis[cb][core] = 9.0
    depth_tent = np.where(y < -0.06, (z - z_tent) * 0.9, np.float32(9.0))
    depth = np.minimum(np.minimum(depth_out, depth_fis), depth_tent)
    cortex = cerebrum & (depth < _SULCUS_DEPTH * 1.4 + _GM_THICKNESS * 1.3)
    fold = _Lattice(fold_coeffs)
    slow = _Lattice(slow_coeffs, n=49)
    sx, sy, sz, d_out, d_fis, d_tent = (a[cortex] for a in (x, y, z, depth_out, depth_fis, depth_tent))
    r_c = rho[cortex]
    outer = (d_out <= d_fis) & (d_out <= d_tent)
    medial = ~outer & (d_fis <= d_tent)
    # project onto the nearest surface: radially (outer), onto the midline (medial), onto the tentorium (below)
    px = np.where(outer, sx / r_c, np.where(medial, np.where(sx < 0, -0.6, 0.6), sx))  # hemispheres differ
    py = np.where(outer, sy / r_c, sy)
    pz = np.where(outer, sz / r_c, np.where(medial, sz, -0.17 + 0.32 * (sy + 0.15)))
    d = depth[cortex]
    # sulci bend as they go deeper: shift the sample point by a smooth field scaled by the depth
    bend = 0.8 * np.clip(d, 0.0, None)
    f = fold(
        px + bend * slow(px, py, pz, linear=False),
        py + bend * slow(py, pz, px, linear=False),
        pz + bend * slow(pz, px, py, linear=False),
    )
    sulcal_depth = _SULCUS_DEPTH * (1.0 + 0.35 * np.tanh(slow(pz, py, px, linear=False)))
    sulcal_depth *= np.where(outer, np.float32(1.0), np.float32(0.5))  # shallower on the medial/tentorial faces
    to_sulcus = np.abs(f) / (fold.gradient_rms * np.sqrt(2.0 / 3.0))  # ≈ distance to the fundus sheet
    # signed distance to the cleft {to_sulcus < half-width, d < sulcal_depth}, with a rounded fundus
    q1 = to_sulcus - cleft_half_width
    q2 = d - sulcal_depth
    cleft = np.sqrt(np.maximum(q1, 0.0) ** 2 + np.maximum(q2, 0.0) ** 2) + np.minimum(np.maximum(q1, q2), 0.0)
    d = np.minimum(d, cleft)
    gm = _GM_THICKNESS * (1.0 + 0.2 * np.tanh(f))
    labels[cortex] = np.where(d < 0, _CSF, np.where(d < gm, _GM, _WM)).astype(np.uint8)
    labels[cerebrum & ~cortex] = _WM
    del depth_out, depth_fis, depth_tent, x_fis, depth, sx, sy, sz, d_out, d_fis, d_tent, r_c, px, py, pz
    del f, sulcal_depth, to_sulcus, d, gm, outer, medial, bend, q1, q2, cleft

    # cerebellum: white-matter core (arbor vitae) inside grey folia separated by thin CSF clefts
    rc = np.sqrt(_ellipsoid(x[cerebellum], y[cerebellum], z[cerebellum], (0.0, -0.42, -0.36), (0.50, 0.30, 0.24)))
    wobble = fold(z[cerebellum], x[cerebellum], y[cerebellum])
    folia = np.cos(2 * np.pi * 9.0 * rc + 2.5 * wobble)
    cbl = np.full(rc.shape, _GM, dtype=np.uint8)
    cbl[rc < 0.36 + 0.2 * (folia > 0.0) * (rc < 0.7) + 0.06 * wobble] = _WM
    cbl[(folia > 0.9) & (rc > 0.5)] = _CSF
    labels[cerebellum] = cbl
    labels[stem & intracranial] = _WM
    del rc, folia, wobble, cbl

    # deep grey nuclei: thalami, lentiform nuclei, caudate heads (all inside the central box)
    lab_c = labels[cb]
    cer_c = cerebrum[cb]
    for cx, cy, cz, sx, sy, sz in (
        (0.10, -0.12, 0.00, 0.085, 0.14, 0.10),
        (0.25, 0.07, 0.02, 0.06, 0.16, 0.10),
        (0.15, 0.19, 0.08, 0.05, 0.08, 0.08),
    ):
        for side in (-1.0, 1.0):
            lab_c[cer_c & (_ellipsoid(xc_, yc_, zc_, (side * cx, cy, cz), (sx, sy, sz)) < 1.0)] = _DGM

    # lateral ventricles: bodies close to the midline, atria curving outwards at the back, arched up
    vs = ventricle_size
    yv = yc_ + 0.05
    for side in (-1.0, 1.0):
        xc = side * (0.055 + 0.015 * vs + 0.3 * np.maximum(-yv - 0.05, 0.0) ** 1.2) * (1 + side * ventricle_asym)
        zc_v = 0.07 - 0.4 * yv**2
        half_width = 0.04 * vs * (1.0 - 0.5 * np.clip(yv / 0.33, 0.0, 1.0))  # frontal horns taper
        vent = ((xc_ - xc) / half_width) ** 2 + (yv / 0.33) ** 2 + ((zc_ - zc_v) / (0.1 * vs)) ** 2 < 1.0
        lab_c[cer_c & vent] = _VENT
    third = (np.abs(xc_) < 0.012 * vs + 0.004) & (
        _ellipsoid(0.0, yc_, zc_, (0.0, -0.05, -0.02), (1.0, 0.13, 0.09)) < 1.0
    )
    lab_c[cer_c & third] = _VENT
    del vent, third, core, yv, lab_c, cer_c, xc_, yc_, zc_

    # ---- lesions: blobby ellipsoids centred in white matter ----
    mask = np.zeros(shape, dtype=bool)
    wm_index = np.flatnonzero((labels == _WM) & cerebrum)
    if wm_index.size == 0:  # degenerate tiny volumes: any brain voxel
        wm_index = np.flatnonzero(np.isin(labels, _PARENCHYMA))
    lesion_parts: list[tuple[tuple[slice, slice, slice], np.ndarray, np.ndarray, bool]] = []
    for u, radius, stretch, kind, blob_coeffs in lesion_draws:
        centre = np.unravel_index(wm_index[min(int(u * wm_index.size), wm_index.size - 1)], shape)
        semi = np.maximum(radius * stretch, 1.3 * voxel)  # at least ~1 voxel across in every axis
        box_l = []
        for i in range(3):
            half = int(np.ceil(1.9 * semi[i] / voxel[i])) + 1
            box_l.append(slice(max(centre[i] - half, 0), min(centre[i] + half + 1, shape[i])))
        box = (box_l[0], box_l[1], box_l[2])
        lx, ly, lz = (axes[i][box[i]] for i in range(3))
        cc = [axes[i][centre[i]] for i in range(3)]
        r = np.sqrt(_ellipsoid(lx[:, None, None], ly[None, :, None], lz[None, None, :], cc, semi))
        blob = _smooth_field(blob_coeffs, (lx - cc[0], ly - cc[1], lz - cc[2]), span=2.0 * float(semi.max()))
        r = (r / (1.0 + 0.22 * np.tanh(blob))).astype(np.float32)
        inside = (r < 1.0) & np.isin(labels[box], (*_PARENCHYMA, _LES, _OED))
        oedema = (r >= 1.0) & (r < 1.9) & np.isin(labels[box], (_WM, _OED))
        labels[box][oedema] = _OED
        mask[box] |= inside
        necrotic = radius > 0.055 and kind < 0.6
        lesion_parts.append((box, r, inside, necrotic))
    labels[mask] = _LES

    # ---- intensities (T1 post-contrast) ----
    tissue = np.array([0.0, 0.80, 0.10, 0.10, 0.42, 0.70, 0.07, 0.56, 0.95, 0.55], dtype=np.float32)
    tissue[1:] *= contrast[1:].astype(np.float32)
    image = tissue[labels]
    texture = _smooth_field(texture_coeffs, axes)
    brain = np.isin(labels, _PARENCHYMA)
    image[brain] *= 1.0 + 0.03 * texture[brain]
    # scalp: thin skin and galea/muscle (darker) around bright subcutaneous fat; skull: dark tables, brighter diploe
    skin = (labels == _SCALP) & ((rho > _HEAD_OUT + shell - 0.022) | (rho < _SKULL_OUT + shell + 0.03))
    image[skin] = 0.40 * contrast[1]
    diploe = (labels == _SKULL) & (np.abs(rho - 0.5 * (_CSF_OUT + _SKULL_OUT) - 0.5 * shell) < 0.022)
    image[diploe] = 0.38 * contrast[2]
    # neck below the skull: muscle, a fat rim, the spinal cord in CSF, a vertebral body in front of it
    b = _box(axes, (-2.0, -2.0, -2.0), (2.0, 2.0, -0.1))
    xb, yb, im = x[b], y[b], image[b]
    low = neck[b] & (rho[b] >= _HEAD_OUT + shell[b])
    neck_r = np.sqrt((xb / 0.40) ** 2 + ((yb + 0.10) / 0.46) ** 2)
    im[low] = 0.36
    im[low & (neck_r > 0.86)] = 0.78
    im[low & (neck_r > 0.96)] = 0.40
    cord_r = np.sqrt(xb**2 + (yb + 0.06) ** 2)
    im[low & (cord_r < 0.095)] = 0.10
    im[low & (cord_r < 0.055)] = 0.62
    im[low & (np.sqrt(xb**2 + (yb - 0.1) ** 2) < 0.08)] = 0.50
    # enhancing dura / superior sagittal sinus at the vertex, bright after contrast
    b = _box(axes, (-0.25, -2.0, 0.0), (0.25, 2.0, 2.0))
    sinus = (np.abs(x[b]) < 0.025) & (np.abs(rho[b] - 1.025) < 0.025) & (z[b] > 0.15) & (labels[b] == _CSF)
    image[b][sinus] = 0.85
    del skin, diploe, sinus, texture, shell, neck, low, neck_r, cord_r, xb, yb, im
    for box, r, inside, necrotic in lesion_parts:
        sub = image[box]
        oed = (labels[box] == _OED) & (r >= 1.0) & (r < 1.9)
        sub[oed] *= np.float32(0.80) + np.float32(0.20) * np.clip((r[oed] - 1.0) / 0.9, 0.0, 1.0)
        rim = inside & (r > 0.5)  # thick enhancing rim; a necrotic core is the inner eighth of the volume
        sub[rim] = 0.98
        sub[inside & ~rim] = 0.24 if necrotic else 0.94
    lesion_values = image[mask]

    # ---- partial volume (lesions stay crisp: the mask marks exactly where the image changes), bias, noise ----
    image = _partial_volume(image, voxel)
    image[mask] = lesion_values
    image *= 1.0 + 0.07 * _smooth_field(bias_coeffs, axes)
    n1 = rng.standard_normal(shape, dtype=np.float32)
    n2 = rng.standard_normal(shape, dtype=np.float32)
    image = np.sqrt((image + noise_sigma * n1) ** 2 + (noise_sigma * n2) ** 2)
    image = np.clip(image, 0.0, 1.0).astype(np.float32)
    mask_f = mask.astype(np.float32)
    if return_labels:
        return image, mask_f, labels
    return image, mask_f


class PhantomDataset(Dataset):
    """Phantom subjects as samples of the data contract.

    Subject ``i`` uses seed ``seed_offset + i``. Sample ``i`` is ``{"image": (1, D, H, W) float32 in [0, 1],
    "mask": (1, D, H, W) float32 in {0, 1}, "subject": f"phantom-{seed:04d}", "affine": (4, 4) float64
    identity}`` (1 mm voxels, RAS voxel order; see the module docstring).

    Args:
        volume_shape: ``(D, H, W)``.
        num_subjects: how many subjects.
        seed_offset: seed of subject 0.
        cache: generate every subject once, at construction, and keep it in memory (about 5 bytes per voxel
            per subject); otherwise each access generates it again (deterministically).
        covariates: the subjects' covariates shape their anatomy (:func:`make_phantom`).
    """

    def __init__(
        self, volume_shape: Sequence[int], num_subjects: int, seed_offset: int = 0, *, cache: bool = False,
        covariates: bool = False,
    ) -> None:
        self.volume_shape = check_volume_shape(volume_shape, key="volume_shape")
        if int(num_subjects) < 0:
            raise ValueError(f"num_subjects must be >= 0, got {num_subjects}")
        self.num_subjects = int(num_subjects)
        self.seed_offset = int(seed_offset)
        self.covariates = bool(covariates)
        self._cache: list[tuple[np.ndarray, np.ndarray]] | None = None
        if cache:
            self._cache = []
            for i in range(self.num_subjects):
                image, mask = make_phantom(self.volume_shape, self.seed_offset + i,  # type: ignore[misc]
                                           covariates=self.covariates)
                self._cache.append((image, mask.astype(np.uint8)))

    def __len__(self) -> int:
        return self.num_subjects

    @property
    def subjects(self) -> list[str]:
        """Subject names, in index order."""
        return [subject_name(self.seed_offset + i) for i in range(self.num_subjects)]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor | str]:
        if not -self.num_subjects <= index < self.num_subjects:
            raise IndexError(f"subject index {index} out of range for {self.num_subjects} phantom subjects")
        index %= self.num_subjects
        seed = self.seed_offset + index
        if self._cache is not None:
            image, mask = self._cache[index]
        else:
            image, mask = make_phantom(self.volume_shape, seed, covariates=self.covariates)  # type: ignore[misc]
        return {
            "image": torch.from_numpy(np.ascontiguousarray(image))[None].clone(),
            "mask": torch.from_numpy(mask.astype(np.float32))[None],
            "subject": subject_name(seed),
            "affine": torch.eye(4, dtype=torch.float64),
        }


def subject_name(seed: int) -> str:
    """The subject name of a phantom seed: ``phantom-0007``."""
    return f"phantom-{seed:04d}"
