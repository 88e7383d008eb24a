"""The data layer: find videos and labels, probe them once, cache decoded clips, and read
clips for training (`vidtune.datasets`). It imports nothing of `vidtune.trainer` or `vidtune.tune`.
"""
if __name__ != "vidtune.datasets":   # a bare `import datasets` from the clone's root: see vidtune.bare_names
    from vidtune.bare_names import hand_over

    hand_over(__name__)
