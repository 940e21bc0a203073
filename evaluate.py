"""python evaluate.py ckpt_path=PATH [n=8] [key=value ...] — see voxdiff/cli/evaluate.py and the README."""

from voxdiff.cli.evaluate import main

if __name__ == "__main__":
    main()
