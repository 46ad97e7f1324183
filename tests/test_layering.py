"""hetpipe's layers are its folders, and the rule that keeps them layers: a module
imports only its own folder's layer and the layers that layer may import
(docs/architecture.md, "Layers").

    ground floor  hetpipe/errors/, process/, devices/, pipeline/, hetpipe/__init__.py (the version)
                  and configs/ (the presets)
    libraries     hetpipe/parallel/, hetpipe/data/, comm/: the ground floor only
                  models/: the ground floor and parallel (its TP plan)
                  partitioner/: the ground floor and models (a family's arithmetic)
    runtime       hetpipe/checkpoint/, schema/, observe/, launch/, training/, each importing
                  only those listed below it; the commands (hetpipe/*.py, cli/, doctor/) anything

So no folder imports one above it, and no two folders import each other. The
imports are read from the code as tests/test_import_loops.py reads them
(deferred imports count; ``if TYPE_CHECKING:`` ones do not, as they never run).
"""
from __future__ import annotations

from pathlib import Path

from test_import_loops import REPO, import_graph, module_files, package_roots

GROUND = "ground floor"
COMMANDS = "commands"
# Folder (from the repo root) -> its layer. hetpipe/'s own files are the commands, but for its
# __init__ (the version, read everywhere); every other folder of hetpipe/ must be listed.
LAYER_OF = {
    "hetpipe/__init__.py": GROUND,
    "hetpipe": COMMANDS,
    "hetpipe/errors": GROUND,  # HetpipeError and its kinds, their wording, the odd values refused
    "hetpipe/process": GROUND,  # this process: its torch, torch's warnings, its rank, injected faults
    "hetpipe/devices": GROUND,  # the device catalog, a rank's device, the cluster's vendor groups
    "hetpipe/pipeline": GROUND,  # actions, placements, the schedule registry and orders, the simulator
    "configs": GROUND,  # hetpipe.configs: the YAML presets, no code
    "hetpipe/parallel": "parallel",
    "hetpipe/data": "data",
    "comm": "comm",
    "models": "models",
    "partitioner": "partitioner",
    "hetpipe/checkpoint": "checkpoint",
    "hetpipe/schema": "schema",
    "hetpipe/observe": "observe",
    "hetpipe/launch": "launch",
    "hetpipe/training": "training",
    "hetpipe/cli": COMMANDS,
    "hetpipe/doctor": COMMANDS,
}
LIBRARIES = {"parallel", "data", "comm", "models", "partitioner"}
# Layer -> the layers it may import besides its own (the ground floor is open to all).
MAY_IMPORT = {
    GROUND: set(),
    "parallel": set(),
    "data": set(),
    "comm": set(),
    "models": {"parallel"},
    "partitioner": {"models"},
    "checkpoint": LIBRARIES,
    "schema": LIBRARIES | {"checkpoint"},
    "observe": LIBRARIES | {"schema"},
    "launch": LIBRARIES | {"checkpoint", "observe"},
    "training": LIBRARIES | {"checkpoint", "schema", "observe", "launch"},
}
# Top-level modules of hetpipe/ (issue 46: the commands, the version, nothing else).
MAX_TOP_LEVEL = 12


def folder_of(path: Path, repo: Path) -> str:
    """The key of LAYER_OF that holds ``path``: hetpipe/__init__.py itself, hetpipe/'s own
    files, or a folder's first two parts (hetpipe/x) or first part (comm, models...)."""
    relative = path.relative_to(repo)
    if relative.as_posix() == "hetpipe/__init__.py" or len(relative.parts) == 2 and relative.parts[0] == "hetpipe":
        return relative.as_posix() if relative.name == "__init__.py" else "hetpipe"
    return "/".join(relative.parts[:2] if relative.parts[0] == "hetpipe" else relative.parts[:1])


def layers(repo: Path) -> dict[str, str]:
    """Every module -> its layer (KeyError: a folder with no layer)."""
    return {module: LAYER_OF[folder_of(path, repo)] for module, path in module_files(package_roots(repo)).items()}


def violations(repo: Path) -> list[str]:
    layer_of = layers(repo)
    graph = import_graph(module_files(package_roots(repo)), repo)
    found = []
    for module, edges in sorted(graph.items()):
        layer = layer_of[module]
        if layer == COMMANDS:
            continue
        allowed = {layer, GROUND} | MAY_IMPORT[layer]
        for edge in edges:
            target_layer = layer_of[edge.target]
            line = f"{edge.where}: {module} ({layer}) imports {edge.target} ({target_layer})"
            if target_layer not in allowed and line not in found:  # `from a import b, c`: one line
                found.append(line)
    return found


def test_every_folder_has_a_layer_and_every_layer_a_rule():
    files = module_files(package_roots(REPO)).values()
    unplaced = sorted({folder_of(p, REPO) for p in files} - set(LAYER_OF))
    assert not unplaced, f"folder(s) with no layer: give each its place in LAYER_OF: {unplaced}"
    used = set(layers(REPO).values())
    assert used <= set(MAY_IMPORT) | {COMMANDS}, used
    assert set(MAY_IMPORT) | {COMMANDS} <= used, "a layer with no module: drop it from the rule"


def test_no_module_imports_a_layer_above_or_beside_it():
    found = violations(REPO)
    assert not found, f"{len(found)} import(s) against the layering rule:\n" + "\n".join(found)


def test_no_two_layers_import_each_other():
    may = {layer: allowed | {GROUND} for layer, allowed in MAY_IMPORT.items()}
    both = sorted(f"{a} <-> {b}" for a in may for b in may[a] if a < b and a in may.get(b, set()))
    assert not both, both


def test_the_top_level_holds_the_commands_only():
    top = sorted(p.name for p in (REPO / "hetpipe").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules at hetpipe/'s top level: {top}"


def test_an_import_against_the_rule_is_found_and_named(tmp_path):
    # The check itself: comm importing the runtime, and models importing the partitioner, fail.
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\nhetpipe = "hetpipe"\n'
                                             '"hetpipe.comm" = "comm"\n"hetpipe.models" = "models"\n'
                                             '"hetpipe.partitioner" = "partitioner"\n')
    files = {"hetpipe/__init__.py": "", "hetpipe/errors/__init__.py": "",
             "hetpipe/training/__init__.py": "", "hetpipe/training/trainer.py": "import hetpipe.comm.c\n",
             "comm/__init__.py": "", "comm/c.py": "from hetpipe.errors import x\n",
             "models/__init__.py": "", "models/m.py": "def f():\n    import hetpipe.partitioner.p\n",
             "partitioner/__init__.py": "", "partitioner/p.py": "import hetpipe.models.m\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations(tmp_path) == ["models/m.py:2: hetpipe.models.m (models) imports hetpipe.partitioner.p "
                                    "(partitioner)"]
    (tmp_path / "comm/c.py").write_text("from hetpipe.training.trainer import y\n")
    assert violations(tmp_path)[0] == ("comm/c.py:1: hetpipe.comm.c (comm) imports hetpipe.training.trainer "
                                       "(training)")
