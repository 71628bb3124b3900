"""Layers point down: every package of nanomega imports only from packages on floors below its own (read from
the source with `ast`; nothing is imported or executed). No floor is exempt, and no package imports a private
name (`_x`) of another.

    ground    tree, hints                 import nothing from nanomega
    data      data/                       the ground (below the config: config/cli.py sizes the vocabulary
                                          from a data folder's tokenizer)
    config    config/                     the run's schema and command line
    model     models/, optim/,            pure maths and files; none of them imports another
              checkpoint/
    parallel  parallel/                   everything that knows about ranks
    step      train/, hf/                 the train step; Hugging Face in and out; neither imports the other
    eval      eval/                       validation, tasks, generation (loads Hugging Face folders)
    sim       sim/                        the real step on fake tensors, the step-time model, the planner
    run       run/                        what a run does around the step (preflight runs the simulator)

A package's modules import each other freely (models/moe.py from models/layers.py). Lazy imports inside
functions count, and so does importlib.import_module("nanomega...") with a literal name.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nanomega"
FLOORS = [("ground", ["tree", "hints"]), ("data", ["data"]), ("config", ["config"]),
          ("model", ["models", "optim", "checkpoint"]), ("parallel", ["parallel"]), ("step", ["train", "hf"]),
          ("eval", ["eval"]), ("sim", ["sim"]), ("run", ["run"])]
LAYERS = {unit: level for level, (_, units) in enumerate(FLOORS) for unit in units}
NAMES = [name for name, _ in FLOORS]


def unit(module: str) -> str:
    """nanomega.optim.adamw -> "optim"; the package itself ("nanomega") -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imported(node: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(nanomega module, names taken from it) for an import statement or importlib.import_module call."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:   # relative: resolve against this module's package
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        if base == "nanomega":        # `from nanomega import optim` imports the module nanomega.optim
            return [(f"{base}.{alias.name}", []) for alias in node.names]
        return [(base, [alias.name for alias in node.names])]
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
        arg = node.args[0] if node.args else None
        if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
            arg = arg.values[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return [(arg.value.rstrip("."), [])]
    return []


def violations(root: Path = PACKAGE) -> list[str]:
    """'path:line: message' for every import in the package under `root` that points up or sideways, or that
    takes a private name from another package."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        source = unit(module)
        if source and source not in LAYERS:
            found.append(f"{rel}:1: {source!r} has no floor; give it one in tests/test_layers.py FLOORS")
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target, names in imported(node, module, path.name == "__init__.py"):
                if target.split(".")[0] != "nanomega":
                    continue
                dest = unit(target)
                if not source or not dest or dest == source:
                    continue
                private = [n for n in names if n.startswith("_")]
                if private:
                    found.append(f"{rel}:{node.lineno}: imports {', '.join(private)} from {target}: a private name "
                                 f"of another package; make it public there, or move the code that needs it")
                if dest not in LAYERS:
                    found.append(f"{rel}:{node.lineno}: imports {target}, whose {dest!r} has no floor")
                elif LAYERS[dest] >= LAYERS[source]:
                    way = "up" if LAYERS[dest] > LAYERS[source] else "sideways"
                    found.append(f"{rel}:{node.lineno}: {source} ({NAMES[LAYERS[source]]} floor) imports {target} "
                                 f"({NAMES[LAYERS[dest]]} floor): {way}")
    return found


def test_layers_point_down():
    assert violations() == []


def test_nothing_is_loose_at_the_top():
    """`ls nanomega/` is the architecture: packages, and the two ground helpers every floor uses."""
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert loose == ["hints", "tree"]
    assert set(LAYERS) == {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} | {"hints", "tree"}


# Imports that point the wrong way (or take a private name), each put into a copy of the package: the check must
# find exactly it.
BEFORE = [
    ("models/transformer.py", "from nanomega.parallel.constrain import constrain\n"),
    ("models/transformer.py", "from nanomega.parallel.experts import experts_on_mesh\n"),
    ("optim/muon.py", "def orthogonalize(x):\n    from nanomega.parallel.newton_schulz import sharded_newton_schulz\n"),
    ("config/schema.py", "def validate(self):\n    from nanomega.parallel.mesh import validate_layout\n"),
    ("optim/base.py", "from nanomega.models import init\n"),                           # sideways
    ("hints.py", "import nanomega.tree\n"),                                              # the ground imports nothing
    ("checkpoint/loading.py", "import importlib\nstep = importlib.import_module(f'nanomega.train.{x}')\n"),  # dynamic
    ("eval/evaluate.py", "def main():\n    from nanomega.run.preflight import pick_device\n"),   # the old cycle
    ("train/step.py", "from nanomega.hf.transfer import whole_model\n"),                 # sideways on one floor
    ("sim/plan.py", "from nanomega.train.step import _private_helper\n"),                # private, though downward
]


@pytest.mark.parametrize("file, code", BEFORE, ids=["constrain", "experts", "newton_schulz", "validate_layout",
                                                     "optim->models", "hints->tree", "import_module", "eval->run",
                                                     "train->hf", "private"])
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
