"""The search's Optuna study (`vidtune.tune.study`): the parameter space with the TPE searcher and
ASHA (`space`), the study as optuna-dashboard shows it (`dashboard`), seeding it from an earlier
search (`warm_start`).

Imports every room before it, MLflow's (`vidtune.tune.tracking`) included: a trial's note in the
dashboard names its MLflow run. Nothing is imported here.
"""
