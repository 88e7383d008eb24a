"""The training layer's commands (`vidtune.trainer.commands`): `vidtune train` (its options and
its run on Ray), `vidtune batch-probe`, `vidtune cache`. Each `main(argv)` checks its flags before
it imports torch or Ray.

Imports every other room of the layer. Nothing is imported here.
"""
