"""The run's configuration: the schema (frozen dataclasses, schema.py), the command line that fills it
(cli.py), and a Hugging Face folder's config.json read as model fields (hf_folder.py)."""
from nanomega.config.cli import available_configs, from_dict, named_config, override, parse_args, to_dict
from nanomega.config.schema import (FP8_RECIPES, TRACKERS, AmaxesAtStepEnd, Config, DataConfig, EvalConfig,
                                    ModelConfig, OptimConfig, ParallelConfig, TrainConfig, check_setting, setting)

__all__ = ["AmaxesAtStepEnd", "Config", "DataConfig", "EvalConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
           "TrainConfig", "check_setting", "setting", "FP8_RECIPES", "TRACKERS", "available_configs", "from_dict",
           "named_config", "override", "parse_args", "to_dict"]
