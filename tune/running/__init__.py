"""The search while it runs on Ray (`vidtune.tune.running`): the trial driver, which trials run
again, the release of a stopped trial's resources, what the cluster offers, the time budget,
interruptions (Ctrl-C, SIGTERM, a full disk), and vidtune's uses of Ray's private APIs.

Imports the config room. Nothing is imported here.
"""
