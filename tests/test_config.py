"""The config's sections: where a setting lives, and a stored config read by the schema of today."""
import pytest

from nanomega.config import from_dict, parse_args, to_dict


def test_a_setting_given_in_the_wrong_section_is_refused_with_where_it_lives():
    """fp8 and loss_chunk are the model's numerics (model.*): --train.fp8 names where to set it."""
    with pytest.raises(ValueError, match=r"fp8 is a setting of model; use --model.fp8=delayed"):
        parse_args(["--train.fp8=delayed"])


def test_a_stored_config_with_numerics_under_train_keeps_them():
    """A checkpoint written while fp8 and loss_chunk lived under train (before 2026-12-04) is read with them on
    the model, so sampling or exporting it rebuilds the model it trained (its fp8 histories included)."""
    cfg = parse_args(["--model.fp8=delayed", "--model.loss_chunk=7"])
    stored = to_dict(cfg)
    stored["train"].update(fp8=stored["model"].pop("fp8"), loss_chunk=stored["model"].pop("loss_chunk"))
    assert from_dict(stored) == cfg


def test_the_amax_reduction_mode_is_the_step_s_not_a_setting():
    """Delayed fp8's amax reduction is switched by the train step (AmaxesAtStepEnd), never set: the command
    line refuses it as no key, a stored config holds no such field, and the step's config keeps every field."""
    import dataclasses
    from nanomega.config import AmaxesAtStepEnd
    with pytest.raises(ValueError, match="unknown config key 'model.fp8_amax_reduction'"):
        parse_args(["--model.fp8_amax_reduction=step"])
    cfg = parse_args(["--model.fp8=delayed"])
    assert "fp8_amax_reduction" not in to_dict(cfg)["model"]
    step = AmaxesAtStepEnd(**{f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(cfg.model)})
    assert (cfg.model.fp8_amax_reduction, step.fp8_amax_reduction) == ("linear", "step")
    assert dataclasses.asdict(step) == dataclasses.asdict(cfg.model) and step.block_config(0).fp8_amax_reduction == "step"
