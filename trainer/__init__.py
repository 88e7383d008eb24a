"""The training layer: models, precision, the training loop and one Ray Train run
(`vidtune.trainer`). It imports `vidtune.datasets`, never `vidtune.tune`.
"""
if __name__ != "vidtune.trainer":   # a bare `import trainer` from the clone's root: see vidtune.bare_names
    from vidtune.bare_names import hand_over

    hand_over(__name__)
