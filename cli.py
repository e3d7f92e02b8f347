"""Run kvrescue-local from a checkout: `python3 cli.py ...` is `kvrescue-local ...`."""

from kvrescue_local.entry import main

if __name__ == "__main__":
    main()
