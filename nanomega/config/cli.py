"""The command line: `--config=NAME` picks configs/NAME.py (or a file of one's own), every other `--a.b=v`
overrides a field of the schema (schema.py); a run's config to and from JSON (checkpoints store it).

parse_args also resolves what the command line leaves to the disk: the tokenizer a prepared data folder or an
--train.init_from folder carries, the vocabulary size it implies, and a Hugging Face folder's architecture.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import typing
from pathlib import Path

from nanomega.config.hf_folder import model_from_hf
from nanomega.config.schema import Config, ModelConfig, OptimConfig
from nanomega.data.formats import prepared_meta
from nanomega.data.tokenizer import RUN_FOLDER, separator_of, vocab_size_of


def _config_dir() -> Path:
    """The named configs: the package's `nanomega.configs` (an install maps the checkout's configs/ there:
    pyproject.toml), or configs/ next to the package in a checkout that is not installed."""
    spec = importlib.util.find_spec("nanomega.configs")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "configs"


def available_configs() -> list[str]:
    return sorted(p.stem for p in _config_dir().glob("*.py") if not p.stem.startswith("_"))


def named_config(name: str) -> Config:
    """configs/NAME.py's config(), or, for a path ending in .py, that file's (a user's own config)."""
    if name.endswith(".py"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ValueError(f"--config={name}: no such file (a config file defines config() -> "
                             "nanomega.config.Config; named ones: " + ", ".join(available_configs()) + ")")
        spec = importlib.util.spec_from_file_location(f"nanomega_user_config_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not callable(getattr(module, "config", None)):
            raise ValueError(f"--config={name} defines no config() function returning a nanomega.config.Config")
        return module.config()
    if name not in available_configs():
        raise ValueError(f"unknown config {name!r}; available: {', '.join(available_configs())}, "
                         "or a path to a .py file defining config()")
    package = "nanomega.configs" if importlib.util.find_spec("nanomega.configs") is not None else "configs"
    return importlib.import_module(f"{package}.{name}").config()


_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def _parse_value(text: str, typ, key: str):
    """`text` as a value of the field's type: bool, int, float, str, or a tuple of one of them (comma-separated)."""
    if typing.get_origin(typ) is tuple:
        inner = typing.get_args(typ)[0]
        return tuple(_parse_value(part, inner, key) for part in text.split(",") if part)
    if typ not in (bool, int, float, str):
        raise TypeError(f"--{key}: unsupported field type {typ}")
    try:
        return _BOOLS[text.lower()] if typ is bool else typ(text)
    except (KeyError, ValueError):
        raise ValueError(f"--{key}={text!r} is not a valid {typ.__name__}") from None


def override(cfg, key: str, text: str, prefix: str = ""):
    """Return a copy of the dataclass `cfg` with the dotted `key` set from the string `text`."""
    head, _, rest = key.partition(".")
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    if head not in fields and isinstance(cfg, OptimConfig):    # the optimizer's own setting: optim.check types it
        try:     # a Python literal where it is one (0.9, 5, 1e-8), else true, false or the text
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = {"true": True, "false": False}.get(text.lower(), text)
        return dataclasses.replace(cfg, settings=cfg.settings + ((key, value),))
    if head not in fields:
        raise ValueError(f"unknown config key {prefix + head!r}; valid keys here: "
                         + ", ".join(prefix + k for k in fields))
    hints = typing.get_type_hints(type(cfg))
    current = getattr(cfg, head)
    if dataclasses.is_dataclass(current):
        if not rest:
            raise ValueError(f"{prefix + head!r} is a section; set one of its keys, e.g. --{prefix}{head}."
                             f"{dataclasses.fields(current)[0].name}=...")
        return dataclasses.replace(cfg, **{head: override(current, rest, text, prefix + head + ".")})
    if rest:
        raise ValueError(f"{prefix + head!r} is not a section; did you mean --{prefix + head}=...?")
    return dataclasses.replace(cfg, **{head: _parse_value(text, hints[head], prefix + head)})


def parse_args(argv: list[str], default: str = "default") -> Config:
    """`--config=NAME` picks configs/NAME.py (`--config=path/to/file.py` a file of one's own); every other
    `--a.b=v` overrides a field."""
    name, overrides = default, []
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ValueError(f"arguments look like --config=NAME or --section.key=value, got {arg!r}")
        key, _, value = arg[2:].partition("=")
        if key == "config":
            name = value
        else:
            overrides.append((key, value))
    cfg = named_config(name)
    for key, value in overrides:
        section, _, leaf = key.partition(".")
        if (home := home_section(section, leaf)) is not None:
            raise ValueError(f"unknown config key {key!r}: {leaf} is a setting of {home}; use --{home}.{leaf}={value}")
        cfg = override(cfg, key, value)
    given = {key for key, _ in overrides}
    if "data.tokenizer" not in given:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=default_tokenizer(cfg)))
    if cfg.train.init_from:
        model = model_from_hf(cfg.train.init_from, cfg.model, [k[6:] for k, _ in overrides if k.startswith("model.")])
        cfg = dataclasses.replace(cfg, model=model)
    elif (cfg.data.tokenizer != "bytes" and "model.vocab_size" not in given
          and cfg.model.vocab_size == ModelConfig.vocab_size):
        # A config that names its vocabulary (gpt2_124m's 50257) keeps it (preflight checks the tokenizer fits);
        # the default one, the bytes', becomes the tokenizer's.
        vocab = vocab_size_of(cfg.data.tokenizer)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    cfg = with_document_mask(cfg, given)
    cfg.validate()
    return cfg


def with_document_mask(cfg: Config, given: set[str]) -> Config:
    """cfg with model.document_separator as data.mask says: the tokenizer's separator (the token that opens each
    document: data.tokenizer.separator_of) for "document", -1 for "causal". Refused when the tokenizer has no
    separator, or when the setting was given by hand (`given`) against data.mask."""
    if cfg.data.mask == "causal":
        if "model.document_separator" in given and cfg.model.document_separator >= 0:
            raise ValueError(f"model.document_separator={cfg.model.document_separator} is set by --data.mask=document "
                             "from the tokenizer; give --data.mask=document instead")
        return cfg
    separator = separator_of(cfg.data.tokenizer)
    if separator is None:
        raise ValueError(f"data.mask=document needs the token that separates documents, and tokenizer "
                         f"{cfg.data.tokenizer} has neither an EOS nor a BOS token; give its tokenizer_config.json an "
                         "eos_token, or use --data.mask=causal")
    if cfg.model.document_separator not in (-1, separator):
        raise ValueError(f"model.document_separator={cfg.model.document_separator}, but the tokenizer separates "
                         f"documents with token {separator}; leave model.document_separator out")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, document_separator=separator))


def home_section(section: str, key: str) -> str | None:
    """The Config section that has `key` when `section` does not (fp8 and loss_chunk moved from train to model
    on 2026-12-04); None when `section` has it, is no section, or no other section does."""
    fields = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in typing.get_type_hints(Config).items()}
    if section not in fields or key in fields[section]:
        return None
    return next((name for name, keys in fields.items() if key in keys), None)


def default_tokenizer(cfg: Config) -> str:
    """data.tokenizer when the command line leaves it out: the --train.init_from folder's tokenizer (if it has a
    tokenizer.json), else a prepared data.path's own (its tokenizer/ folder), else bytes."""
    if cfg.train.init_from and (Path(cfg.train.init_from).expanduser() / "tokenizer.json").is_file():
        return cfg.train.init_from
    folder = Path(cfg.data.path).expanduser() if cfg.data.path else None
    if folder is not None and folder.is_dir() and (meta := prepared_meta(folder)) is not None:
        return str(folder / meta.get("tokenizer_folder", RUN_FOLDER))
    return "bytes"


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> Config:
    """A stored config (a checkpoint's meta) as the schema reads it today. A key its section no longer has but
    another section does (fp8 and loss_chunk moved from train to model, 2026-12-04) is read where it lives now,
    so a checkpoint keeps the numerics it was trained with; any other unknown key is dropped."""
    d = {section: dict(values) if isinstance(values, dict) else values for section, values in d.items()}
    for section, values in list(d.items()):
        for key in list(values):
            if (home := home_section(section, key)) is not None:
                d.setdefault(home, {})[key] = values.pop(key)

    def build(cls, values: dict):
        hints = typing.get_type_hints(cls)
        kwargs = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}
        for name, v in kwargs.items():     # a section becomes its dataclass, a JSON list the schema's tuple
            if dataclasses.is_dataclass(hints[name]):
                kwargs[name] = build(hints[name], v)
            elif typing.get_origin(hints[name]) is tuple:
                kwargs[name] = tuple(v)
        return cls(**kwargs)
    return build(Config, d)
