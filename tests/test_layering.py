"""hetpipe's layers, and the rule that keeps them layers: a module imports only
its own layer and the layers below it (docs/architecture.md, "Layers").

    ground floor  errors, value_checks, cluster, torch_compat, known_warnings, devices, the pipeline's vocabulary
    libraries     parallel (collective primitives), data, comm: the ground floor only
                  models: the ground floor and parallel (its TP plan)
                  partitioner: the ground floor and models (a family's arithmetic)
    runtime       everything else (trainer, engine, checkpoint, launch, doctor, CLIs)

So comm, models and partitioner never import the runtime above them, and
nothing below the runtime imports a sibling it does not name. The imports are
read from the code as tests/test_import_loops.py reads them (deferred imports
count; ``if TYPE_CHECKING:`` ones do not, as they never run).
"""
from __future__ import annotations

from pathlib import Path

from test_import_loops import REPO, import_graph, module_files, package_roots

GROUND = "ground floor"
RUNTIME = "runtime"
# Module-name prefix -> its layer; the longest matching prefix decides.
LAYER_OF = {
    "hetpipe": RUNTIME,
    "hetpipe.errors": GROUND,
    "hetpipe.devices.cluster": GROUND,
    "hetpipe.process.torch_compat": GROUND,
    "hetpipe.process.known_warnings": GROUND,
    "hetpipe.errors.value_checks": GROUND,
    "hetpipe.errors.suggest": GROUND,  # "did you mean", for errors.py's one-line hydra errors
    "hetpipe.errors.foreign_flags": GROUND,  # Megatron-LM's and torchtitan's flags, answered by errors.py
    "hetpipe.devices": GROUND,
    "hetpipe.pipeline": GROUND,  # actions, placements, the schedule registry and orders, the simulator
    "hetpipe.training.engine": RUNTIME,  # runs the vocabulary on models and channels
    "hetpipe.parallel": "parallel",
    "hetpipe.data": "data",
    "hetpipe.comm": "comm",
    "hetpipe.models": "models",
    "hetpipe.partitioner": "partitioner",
}
# Layer -> the layers it may import besides its own (the ground floor is open to all).
MAY_IMPORT = {
    GROUND: set(),
    "parallel": set(),
    "data": set(),
    "comm": set(),
    "models": {"parallel"},
    "partitioner": {"models"},
}


def layer_of(module: str) -> str:
    prefixes = [p for p in LAYER_OF if module == p or module.startswith(p + ".")]
    return LAYER_OF[max(prefixes, key=len)]


def violations(repo: Path) -> list[str]:
    graph = import_graph(module_files(package_roots(repo)), repo)
    found = []
    for module, edges in sorted(graph.items()):
        layer = layer_of(module)
        if layer == RUNTIME:
            continue
        allowed = {layer, GROUND} | MAY_IMPORT[layer]
        for edge in edges:
            target_layer = layer_of(edge.target)
            line = f"{edge.where}: {module} ({layer}) imports {edge.target} ({target_layer})"
            if target_layer not in allowed and line not in found:  # `from a import b, c`: one line
                found.append(line)
    return found


def test_every_module_has_a_layer_and_every_layer_a_rule():
    modules = module_files(package_roots(REPO))
    layers = {layer_of(m) for m in modules}
    assert layers <= set(MAY_IMPORT) | {RUNTIME}, layers
    assert set(MAY_IMPORT) | {RUNTIME} <= layers, "a layer with no module: drop it from the rule"


def test_no_module_imports_a_layer_above_or_beside_it():
    found = violations(REPO)
    assert not found, f"{len(found)} import(s) against the layering rule:\n" + "\n".join(found)


def test_an_import_against_the_rule_is_found_and_named(tmp_path):
    # The check itself: comm importing the runtime, and models importing the partitioner, fail.
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\nhetpipe = "hetpipe"\n'
                                             '"hetpipe.comm" = "comm"\n"hetpipe.models" = "models"\n'
                                             '"hetpipe.partitioner" = "partitioner"\n')
    files = {"hetpipe/__init__.py": "", "hetpipe/errors/__init__.py": "", "hetpipe/training/trainer.py": "import hetpipe.comm.c\n",
             "comm/__init__.py": "", "comm/c.py": "from hetpipe.errors import x\n",
             "models/__init__.py": "", "models/m.py": "def f():\n    import hetpipe.partitioner.p\n",
             "partitioner/__init__.py": "", "partitioner/p.py": "import hetpipe.models.m\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations(tmp_path) == ["models/m.py:2: hetpipe.models.m (models) imports hetpipe.partitioner.p "
                                    "(partitioner)"]
    (tmp_path / "comm/c.py").write_text("from hetpipe.training.trainer import y\n")
    assert violations(tmp_path)[0] == "comm/c.py:1: hetpipe.comm.c (comm) imports hetpipe.training.trainer (runtime)"
