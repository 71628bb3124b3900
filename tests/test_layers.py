"""Layers point down: every module of nanomega imports only from layers below its own (read from the
source with `ast`; nothing is imported or executed).

    ground    tree, hints, hf_config, formats,      import nothing from nanomega
              tokenizer, devices
              config, prepare                       the ground's first floor only (hf_config: --train.init_from;
                                                    prepare: tokenizer and formats, below data, which runs it)
    model     models/, optim/, data, checkpoint,    the ground; none of them imports another
              recompute
    parallel  parallel/                             the ground and the model layer
    top       step, metrics, generate, evaluate,    anything (as train.py, sample.py and bench/ do)
              estimate, memory_tracker, preflight,
              contracts, hf, lm_eval_adapter,
              step_time, plan

A package's modules import each other freely (models/moe.py from models/layers.py). Lazy imports
inside functions count, and so does importlib.import_module("nanomega...") with a literal name.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nanomega"
GROUND, CONFIG, MODEL, PARALLEL, TOP = 0, 1, 2, 3, 4
LAYERS = {"tree": GROUND, "hints": GROUND, "hf_config": GROUND, "formats": GROUND, "tokenizer": GROUND, "config": CONFIG,
          "prepare": CONFIG,
          "models": MODEL, "optim": MODEL, "data": MODEL, "checkpoint": MODEL, "recompute": MODEL,
          "parallel": PARALLEL,
          "step": TOP, "metrics": TOP, "generate": TOP, "estimate": TOP, "memory_tracker": TOP, "preflight": TOP,
          "contracts": TOP, "evaluate": TOP, "tracking": TOP, "lm_eval_adapter": TOP,
          "hf": TOP, "sampler": TOP, "step_time": TOP, "plan": TOP, "devices": GROUND}
NAMES = {GROUND: "ground", CONFIG: "ground (config)", MODEL: "model", PARALLEL: "parallel", TOP: "top"}


def unit(module: str) -> str:
    """nanomega.optim.adamw -> "optim"; the package itself ("nanomega") -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imported_modules(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The nanomega modules an import statement (or an importlib.import_module call) names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:   # relative: resolve against this module's package
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        # `from nanomega import optim` imports the module nanomega.optim
        return [f"{base}.{alias.name}" for alias in node.names] if base == "nanomega" else [base]
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
        arg = node.args[0] if node.args else None
        if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
            arg = arg.values[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return [arg.value.rstrip(".")]
    return []


def violations(root: Path = PACKAGE) -> list[str]:
    """'path:line: message' for every import in the package under `root` that points up or sideways."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        source = unit(module)
        if source and source not in LAYERS:
            found.append(f"{rel}:1: {source!r} has no layer; give it one in tests/test_layers.py LAYERS")
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in imported_modules(node, module, path.name == "__init__.py"):
                if target.split(".")[0] != "nanomega":
                    continue
                dest = unit(target)
                if not source or not dest or dest == source or LAYERS[source] == TOP:
                    continue
                if dest not in LAYERS:
                    found.append(f"{rel}:{node.lineno}: imports {target}, whose {dest!r} has no layer")
                elif LAYERS[dest] >= LAYERS[source]:
                    way = "up" if LAYERS[dest] > LAYERS[source] else "sideways"
                    found.append(f"{rel}:{node.lineno}: {source} ({NAMES[LAYERS[source]]} layer) imports {target} "
                                 f"({NAMES[LAYERS[dest]]} layer): {way}")
    return found


def test_layers_point_down():
    assert violations() == []


# The four upward imports the package had before the layers were enforced, each put back into a copy.
BEFORE = [
    ("models/transformer.py", "from nanomega.parallel.constrain import constrain\n"),
    ("models/transformer.py", "from nanomega.parallel.experts import experts_on_mesh\n"),
    ("optim/muon.py", "def orthogonalize(x):\n    from nanomega.parallel.newton_schulz import sharded_newton_schulz\n"),
    ("config.py", "def validate(self):\n    from nanomega.parallel.mesh import validate_layout\n"),
    ("optim/base.py", "from nanomega.models import init\n"),                           # sideways
    ("hints.py", "import nanomega.tree\n"),                                              # the ground imports nothing
    ("checkpoint/loading.py", "import importlib\nstep = importlib.import_module(f'nanomega.step.{x}')\n"),   # dynamic, up
]


@pytest.mark.parametrize("file, code", BEFORE, ids=["constrain", "experts", "newton_schulz", "validate_layout",
                                                     "optim->models", "hints->tree", "import_module"])
def test_the_check_catches_an_upward_or_sideways_import(tmp_path, file, code):
    copy = tmp_path / "nanomega"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / file
    lines = target.read_text().count("\n")
    target.write_text(target.read_text() + code)
    found = violations(copy)
    assert len(found) == 1, found
    line = lines + code.count("\n")        # the import is the last line added
    assert found[0].startswith(f"nanomega/{file}:{line}: "), found[0]


def test_the_wheel_ships_every_package():
    """pyproject.toml lists packages by hand (configs/ is mapped into the package): a new subpackage left out
    of that list imports from a checkout but is missing from the installed wheel."""
    tomllib = pytest.importorskip("tomllib")     # Python 3.11+
    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
