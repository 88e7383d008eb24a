"""vidtune from Python, the top layer: `calls` (search, train, predict: the commands' twins),
`result` (SearchResult, TrainResult, load: what they give back, read from the run's files) and
`keywords` (options as keywords, read through the flags' declarations). `import vidtune` offers
these names lazily (`vidtune/__init__.py`), so the command's `--help` stays light.
"""
