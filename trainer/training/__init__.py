"""One training run without Ray (`vidtune.trainer.training`): its config, the precision policy, the
epoch loop, the metrics, checkpoints and their history, the batch probe, what the device did.

Imports the models room; never Ray's launch code (`vidtune.trainer.cluster`) or serving.
Nothing is imported here.
"""
