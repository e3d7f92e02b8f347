"""The toy world: a synthetic stepwise task and tiny trained models that show KV-Rescue's effect on a CPU.

task.py is the task (numpy only); model.py and train.py need torch (`pip install -e .[train]`) and
are imported only for training; table.py runs the reproduction table on the shipped `toy` preset.
"""
