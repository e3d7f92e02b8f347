"""The toy world: a synthetic stepwise task and tiny trained models that show KV-Rescue's effect on a CPU.

task.py is the task (numpy only); model.py and train.py need torch (`pip install -e .[train]`) and
are imported only for training; calibrate.py fits the `toy` preset's detector thresholds. The toy
table is `bench run --dataset toy` + `report` (docs/toy-world.md); dataset.py registers the toy dataset with
bench/ when this package is imported.
"""

from . import dataset  # noqa: F401  (registers the toy dataset: --dataset toy)
