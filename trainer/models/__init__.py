"""The models (`vidtune.trainer.models`): what a run can fine-tune, and nothing of how it trains.

- `registry`: the model names (torchvision's video transformers, `tiny`, `hf:...`, your own),
  their input specs, building one with its weights.
- `hf_models`: Hugging Face's video classifiers as vidtune models.
- `own_models`: a researcher's own factory (`--model package.module:function`).

Imports only the floor (`vidtune`) and the data layer. Nothing is imported here.
"""
