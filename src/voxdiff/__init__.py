"""voxdiff: train 3D diffusion UNets on medical volumes, with a GPU-free preflight.

The path of one volume: data -> encoding -> diffusion (UNet) -> Lightning system.
See README.md for the map of modules.
"""

__version__ = "0.1.0"
