"""python train.py [experiment=NAME] [key=value ...] — see voxdiff/cli/train.py and the README."""

from voxdiff.cli.train import main

if __name__ == "__main__":
    main()
