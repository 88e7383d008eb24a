"""vidtune.config_file.read_config_file, the one reader of both CLIs' --config: keys as the flags or
the fields' paths, tables, one negation rule, floats as YAML 1.2 reads them, errors naming the
file and key."""
from __future__ import annotations

import json

import pytest

from vidtune.config_file import read_config_file
from vidtune.flags import ConfigError
from vidtune.trainer.commands import train
from vidtune.trainer.ray_setup.launch import TRAIN_FLAGS
from vidtune.trainer.training.config import TrainConfig
from vidtune.tune.config.options import load_config_file, parse_options


def _read(path, **kw):
    return read_config_file(path, TRAIN_FLAGS, known="known: the flags", **kw)


def test_yaml_and_json_floats_without_a_dot_are_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads `1e-5` as a string; the reader reads it as YAML 1.2 and JSON do."""
    yaml_file = tmp_path / "s.yaml"
    yaml_file.write_text("lr-min: 1e-5\nlr_max: 2E-3\nweight-decay-max: 1.5e+1\n")
    values = load_config_file(str(yaml_file)).values
    assert values == {"space.lr_min": 1e-5, "space.lr_max": 2e-3, "space.weight_decay_max": 15.0}
    best = tmp_path / "best_config.json"
    best.write_text(json.dumps({"train_config": TrainConfig(weight_decay=1e-5, lr=3e-5).to_dict()}))
    cfg = train.config_from_args(train.parse_args(["--config", str(best)]))
    assert (cfg.weight_decay, cfg.lr) == (1e-5, 3e-5)


def test_flag_keys_paths_and_tables_read_alike(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('grad-accum = 2\nprecision = "bf16"\n[data]\nroot = "/v"\ncache_dir = "/idx"\n'
                    'cache-dir = "/clips"\n')
    loaded = _read(toml)
    assert loaded.values == {"grad_accum_steps": 2, "precision": "bf16", "data.root": "/v",
                             "data.cache_dir": "/idx", "data.clip_cache_dir": "/clips"}
    assert loaded.keys["data.cache_dir"] == "data.cache_dir"
    assert loaded.keys["grad_accum_steps"] == "grad-accum"


@pytest.mark.parametrize("text, clip_cache", [("no-cache = true", False), ("no_cache = false", True),
                                               ("cache = false", False),
                                               ("[data]\nclip_cache = false", False)])
def test_one_negation_rule(tmp_path, text, clip_cache):
    toml = tmp_path / "n.toml"
    toml.write_text(text + "\n")
    assert _read(toml).values == {"data.clip_cache": clip_cache}


def test_search_table_beside_top_level_keys_and_part_tables(tmp_path):
    toml = tmp_path / "search.toml"
    toml.write_text('epochs = 4\n[search]\nnum-samples = 3\n[space]\nlr_min = 1e-5\n'
                    '[train.data]\nheight = 64\n')
    opts = parse_options(["--config", str(toml)])
    assert (opts.train.epochs, opts.num_samples, opts.space.lr_min, opts.train.data.height) == \
        (4, 3, 1e-5, 64)


def test_a_key_given_twice_across_tables_names_both(tmp_path):
    toml = tmp_path / "twice.toml"
    toml.write_text("epochs = 4\n[search]\nepochs = 5\n")
    with pytest.raises(ConfigError) as e:
        load_config_file(str(toml))
    assert e.value.flag == "--config"
    assert str(e.value) == f"--config: {toml}: epochs and search.epochs both set --epochs; keep one"


def test_document_table_keeps_the_rest_as_about(tmp_path):
    best = tmp_path / "best_config.json"
    best.write_text(json.dumps({"trial_id": "t1", "batch_size": 99, "train_config": {"batch_size": 4}}))
    loaded = _read(best, document="train_config", suffixes=(".json",))
    assert loaded.values == {"batch_size": 4} and loaded.about == {"trial_id": "t1", "batch_size": 99}
    assert loaded.keys == {"batch_size": "train_config.batch_size"}


def test_null_and_wrong_types_name_the_key_and_the_flag(tmp_path):
    yaml_file = tmp_path / "bad.yaml"
    yaml_file.write_text("epochs:\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: epochs \(in the file, for --epochs\): got null"):
        _read(yaml_file)
    yaml_file.write_text("model: [tiny]\n")
    with pytest.raises(ConfigError,
                       match=r"model \(in the file, for --model\): got \['tiny'\]; give a string"):
        _read(yaml_file)


def test_train_config_file_sets_where_it_runs_and_its_bound_is_blamed(tmp_path, capsys):
    """--workers is declared with its bound like every other option: from the file, a bad value
    names the key and the file; as a flag, the flag."""
    toml = tmp_path / "run.toml"
    toml.write_text(f'data = "{tmp_path}"\nworkers = 0\n')
    assert train.main(["--config", str(toml)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vidtune train: error: --workers: got 0; it must be an integer >= 1"), err
    assert f"workers in {toml}" in err, err
    assert train.main(["--data", str(tmp_path), "--cpus-per-worker", "0"]) == 2
    assert "--cpus-per-worker: got 0.0; it must be a number > 0" in capsys.readouterr().err
    toml.write_text('workers = 3\nname = "again"\n')
    args = train.parse_args(["--config", str(toml), "--name", "other"])
    where = train.run_options(args, train.load_config_file(str(toml)))
    assert (where.workers, where.name, where.config) == (3, "other", str(toml))


def test_search_blames_the_file_for_a_value_it_set(tmp_path, capsys):
    toml = tmp_path / "s.toml"
    toml.write_text("[search]\nnum-samples = 0\n")
    with pytest.raises(ConfigError) as e:
        parse_options(["--config", str(toml)])
    assert e.value.flag == "--num-samples" and f"set by search.num-samples in {toml}" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_options(["--config", str(toml), "--num-samples", "-1"])
    assert str(toml) not in str(e.value)
