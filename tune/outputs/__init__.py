"""What a person reads of a search (`vidtune.tune.outputs`): the trials' results and outcomes,
the accuracy's uncertainty, the answer, the tables, the plots, the parameters' importance, the
console and the log file, and the `Summary` value handed to MLflow.

Imports the config, running and state rooms. Nothing is imported here.
"""
