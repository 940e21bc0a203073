"""python preflight.py [experiment=NAME] [overrides]: validity and GPU-memory fit of configs, without a GPU."""

from voxdiff.cli.preflight import main

if __name__ == "__main__":
    main()
