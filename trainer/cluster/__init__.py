"""A run on Ray (`vidtune.trainer.cluster`): starting, joining and reaping Ray, the Ray Train
`TorchTrainer` and its per-worker function, the device lease, whether the workers fit, and what
every node needs before the first trial (Kinetics weights, the clip cache).

Imports the models and training rooms. Nothing is imported here.
"""
