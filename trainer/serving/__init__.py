"""A trained model in use (`vidtune.trainer.serving`): the scoring rule, scoring videos,
`vidtune predict`, the MLflow model flavour, `vidtune serve`, the Hugging Face export.

Imports the models and training rooms; no Ray. Nothing is imported here.
"""
