"""--gradient-checkpointing and --attn-implementation for hf: models, on tiny random checkpoints
written offline (`tests.test_hf_models.save_tiny`): the model trains with what was asked where its
class has it, says so in one line where it has not (TimeSformer: eager attention only), and the
worker's settings (MLflow tags) record what it trained with; other models refuse the flag."""
from __future__ import annotations

import pytest
import torch

from tests.test_hf_models import save_tiny
from vidtune.flags import ConfigError
from vidtune.trainer.commands.train import parse_args
from vidtune.trainer.models.registry import build_model
from vidtune.trainer.training import settings
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.model_checks import check_model
from vidtune.trainer.training.precision import choose_precision
from vidtune.trainer.training.run import use_training_options

pytest.importorskip("transformers")
CPU = torch.device("cpu")


def _settings(model) -> tuple[str, str]:
    got = settings.worker_settings(CPU, choose_precision("fp32", CPU), model)
    return got["attn_implementation"], got["gradient_checkpointing"]


def _layer_calls_in_a_step(model, layer) -> int:
    """How often the attention of encoder `layer` runs in one forward and backward pass of
    `model` (2 with checkpointing: again in the backward pass, inside the layer's checkpoint)."""
    calls = []
    handle = layer.attention.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        x = torch.randn(2, 3, 8, 32, 32)
        torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1])).backward()
    finally:
        handle.remove()
    return len(calls)


def test_videomae_trains_with_the_attention_asked_and_recomputes_activations(tmp_path):
    model = build_model(f"hf:{save_tiny('videomae', tmp_path / 'videomae')}")
    layer = model.hf.videomae.encoder.layer[0]
    assert use_training_options(model, attn_implementation="eager", gradient_checkpointing=True) is None
    assert _settings(model) == ("eager", "on") and model.hf.config._attn_implementation == "eager"
    assert _layer_calls_in_a_step(model.train(), layer) == 2          # recomputed in the backward pass
    assert use_training_options(model, attn_implementation="sdpa", gradient_checkpointing=False) is None
    assert _settings(model) == ("sdpa", "off")
    assert _layer_calls_in_a_step(model, layer) == 1


def test_timesformer_has_no_sdpa_and_says_it_trains_with_eager(tmp_path):
    model = build_model(f"hf:{save_tiny('timesformer', tmp_path / 'timesformer')}")
    note = use_training_options(model, attn_implementation="sdpa", gradient_checkpointing=True)
    assert note is not None and "\n" not in note
    assert "TimesformerForVideoClassification has no sdpa attention" in note and "trains with eager" in note
    assert "--attn-implementation" in note
    assert _settings(model) == ("eager", "on")
    assert _layer_calls_in_a_step(model.train(), model.hf.timesformer.encoder.layer[0]) == 2


def test_other_models_record_no_attention_and_refuse_gradient_checkpointing(tmp_path):
    tiny = build_model("tiny")
    assert use_training_options(tiny, attn_implementation="eager", gradient_checkpointing=False) is None
    assert _settings(tiny) == ("", "off")
    with pytest.raises(ConfigError, match=r"--gradient-checkpointing.*'tiny' has no gradient checkpointing"):
        check_model(TrainConfig(model="tiny", gradient_checkpointing=True))


def test_the_flags_reach_the_training_config():
    args = parse_args(["--gradient-checkpointing", "--attn-implementation", "eager"])
    assert args.gradient_checkpointing is True and args.attn_implementation == "eager"
    assert TrainConfig().attn_implementation == "sdpa" and TrainConfig().gradient_checkpointing is False
    with pytest.raises(SystemExit):
        parse_args(["--attn-implementation", "flash"])
