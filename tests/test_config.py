"""The config reader refuses what the drafter does not implement, naming the field, the value and the rule."""
from __future__ import annotations

import json

import pytest

from dspark_ray.config import ConfigError, from_dict, load_config, tiny


@pytest.mark.parametrize("field, value", [("scoring_func", "sigmoid"), ("scoring_func", "softmax"),
                                          ("topk_method", "group_limited_greedy"), ("topk_method", "greedy")])
def test_a_router_the_drafter_does_not_implement_is_refused(field, value):
    raw = tiny().to_json_dict()
    raw[field] = value
    with pytest.raises(ConfigError, match=rf"config field {field} = '{value}': the drafter's router implements only"):
        from_dict(raw)
    nested = {"architectures": raw["architectures"], "text_config": raw}     # the V4.1 layout, too
    with pytest.raises(ConfigError, match=field):
        from_dict(nested)


def test_the_router_fields_are_read_and_default_to_deepseek_v4s():
    raw = tiny().to_json_dict()
    assert (raw["scoring_func"], raw["topk_method"]) == ("sqrtsoftplus", "noaux_tc")   # a checkpoint says so
    del raw["scoring_func"], raw["topk_method"]
    cfg = from_dict(raw)                 # a config without them: DeepSeek-V4's router
    assert (cfg.scoring_func, cfg.topk_method) == ("sqrtsoftplus", "noaux_tc")


def test_a_checkpoint_declaring_another_scoring_function_is_not_served(tiny_ckpt, tmp_path):
    raw = json.loads((tiny_ckpt / "config.json").read_text())
    raw["scoring_func"] = "sigmoid"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="scoring_func = 'sigmoid'"):
        load_config(tmp_path)


def test_the_router_fields_leave_the_config_digest_as_it_was():
    """A checkpoint synthesized before these fields were read (its config.json without them, its manifest's digest
    made without them) still loads: the digest does not see them."""
    raw = tiny().to_json_dict()
    del raw["scoring_func"], raw["topk_method"]
    assert from_dict(raw).digest() == tiny().digest() == "fc67861bc151ad65"     # the tiny preset's digest before
