"""Encodings of a volume for the UNet: one interface, four implementations.

=================  ========  =======================================  ========
encoding           factor    channels per volume channel              lossless
=================  ========  =======================================  ========
``Identity``       1         1                                        yes
``SpaceToDepth``   f (2)     f³ (8)                                   yes
``HaarWavelet``    2         8 sub-bands                              yes
``VQVAELatent``    4 or 8    ``latent_channels`` (4)                  no
=================  ========  =======================================  ========

Each is a plug-in (see :mod:`voxdiff.encodings.base`): a config names its class by ``_target_``; a module added
here with its ``configs/encoding/<name>.yaml`` needs no other edit. Learned encodings implement
:class:`LearnedEncoding`.
"""

from voxdiff.encodings.base import Encoding, LearnedEncoding
from voxdiff.encodings.haar import SUBBANDS, HaarWavelet
from voxdiff.encodings.identity import Identity
from voxdiff.encodings.space_to_depth import SpaceToDepth
from voxdiff.encodings.vqvae import VQVAELatent

__all__ = ["Encoding", "LearnedEncoding", "HaarWavelet", "Identity", "SUBBANDS", "SpaceToDepth", "VQVAELatent"]
