"""python sample.py ckpt_path=PATH [n=4] [key=value ...] — see voxdiff/cli/sample.py and the README."""

from voxdiff.cli.sample import main

if __name__ == "__main__":
    main()
