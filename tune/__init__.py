"""The search layer: Ray Tune + Optuna over batch size and learning rate, one Ray Train
run per trial, MLflow's record and the summary (`vidtune.tune`).
"""
if __name__ != "vidtune.tune":   # a bare `import tune` from the clone's root: see vidtune.bare_names
    from vidtune.bare_names import hand_over

    hand_over(__name__)
