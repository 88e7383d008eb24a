"""A search's saved state and its resume (`vidtune.tune.state`): one driver per search (the
lock), signed state, the last whole copy of Tune's state, the saved options, a finished search
left as it is, and `search.json`.

Imports the config and running rooms. Nothing is imported here.
"""
