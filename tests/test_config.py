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
