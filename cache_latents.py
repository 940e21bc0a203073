"""python cache_latents.py stage1_ckpt=CKPT out=DIR [data.* ...] — see voxdiff/cli/cache_latents.py and the README."""

from voxdiff.cli.cache_latents import main

if __name__ == "__main__":
    main()
