"""The schedule registry: one entry per schedule, read by everyone.

Each entry builds lists the simulator proves under its own placement, its
facts agree with what its lists do, the planner lists exactly the entries it
can price, the engine has a handler for every action, and the pipeline
package stays a ground floor: it imports nothing of the partitioner, the
launcher, the doctor, checkpoints or the trainer, and no other module of
hetpipe or the partitioner spells a schedule's name in code.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hetpipe.errors import ConfigError
from hetpipe.partitioner import schedule_model
from hetpipe.pipeline.actions import ACTION_KINDS, BWD, BWD_INPUT, BWD_WEIGHT
from hetpipe.training.engine import PipelineEngine
from hetpipe.pipeline.placement import Placement
from hetpipe.pipeline.registry import CONTIGUOUS, SCHEDULES, V_SPLIT, planned, schedule_spec, several_chunks
from hetpipe.pipeline.schedule_check import simulate
from hetpipe.pipeline.schedules import build_schedule, forward_only

REPO = Path(__file__).resolve().parents[1]


def _chunks(spec) -> int:
    return spec.chunks or 2  # interleaving: two of the user's choice


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("P,M", [(1, 4), (2, 4), (3, 6), (4, 8)])
def test_every_entry_builds_lists_the_simulator_proves(name, P, M):
    spec = SCHEDULES[name]
    C = _chunks(spec)
    placement = Placement(name, P, C)
    lists = build_schedule(name, P, M, C)
    simulate(lists, C, placement=placement)
    simulate(forward_only(P, M, C, name), C, forward_only=True, placement=placement)
    kinds = {a.kind for actions in lists for a in actions}
    assert spec.split_backward == (BWD_INPUT in kinds) == (BWD_WEIGHT in kinds) == (BWD not in kinds)


def test_an_unknown_schedule_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'zb_x'; choose one of gpipe, 1f1b, "
                                          "interleaved_1f1b, zb_h1, zb_v"):
        schedule_spec("zb_x")
    assert several_chunks() == "interleaved_1f1b (or zb_v, for two)"


def test_the_planner_lists_exactly_the_entries_it_prices():
    assert schedule_model.PLANNED_SCHEDULES == tuple(s.name for s in planned()) == ("1f1b", "zb_h1", "zb_v", "gpipe")
    for spec in planned():
        pricing = spec.pricing
        assert pricing.split in (CONTIGUOUS, V_SPLIT)
        # A contiguous split prices in-flight counts; a V split runs the order itself, two chunks per rank.
        assert (pricing.in_flight is not None) == (pricing.split == CONTIGUOUS)
        assert pricing.split == CONTIGUOUS or spec.chunks == 2 == pricing.boundary_messages
    assert [s.name for s in SCHEDULES.values() if s.pricing is None] == ["interleaved_1f1b"]


def test_the_engine_has_a_handler_for_every_action():
    assert set(PipelineEngine._HANDLERS) == set(ACTION_KINDS)
    # Validation runs every schedule's forward-only list through its own handlers.
    kinds = {a.kind for spec in SCHEDULES.values()
             for rank in forward_only(4, 8, spec.chunks or 2, spec.name) for a in rank}
    assert kinds and kinds <= set(PipelineEngine._FORWARD_HANDLERS)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_pipeline_package_is_a_ground_floor():
    above = ("hetpipe.partitioner", "hetpipe.launch", "hetpipe.doctor", "hetpipe.checkpoint", "hetpipe.training.trainer")
    for path in sorted((REPO / "hetpipe" / "pipeline").glob("*.py")):
        bad = [m for m in _imports(path) if m.startswith(above)]
        assert not bad, f"{path.name} imports {bad}"


def test_no_module_but_the_registry_spells_a_schedule_name():
    """A schedule's facts are read off its entry, never by comparing its name."""
    names = set(SCHEDULES)
    registry = REPO / "hetpipe" / "pipeline" / "registry.py"
    for folder in ("hetpipe", "partitioner"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == registry:
                continue
            spelled = {node.value for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, ast.Constant) and node.value in names}
            assert not spelled, f"{path.relative_to(REPO)} spells {sorted(spelled)}"
