"""The transport registry (hetpipe/pipeline/transports.py): one entry per cross-vendor
channel kind, whose facts every reader takes instead of testing the kind's name."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from hetpipe.devices.cluster import ClusterConfig, TransportConfig
from hetpipe.errors import ConfigError
from hetpipe.partitioner.planner_config import TRANSPORT_MODELS
from hetpipe.pipeline.transports import AUTO, FALLBACK, KINDS, TRANSPORTS, transport

REPO = Path(__file__).resolve().parents[1]
REGISTRY = REPO / "hetpipe" / "pipeline" / "transports.py"
# (file, name) -> why that file's test of the name is not a test of a transport.
NOT_A_TRANSPORT = {
    ("partitioner/cost_context.py", "direct"): "planner.transport's cost model of that name "
                                              "(partitioner/planner_config.py TRANSPORT_MODELS)",
}


def names_tested_in(source: str, names: set[str]) -> set[str]:
    """The names ``source`` tests or looks up: compared (==, in, a tuple of them) or a dict's keys.
    Labels (a channel naming itself in errors) and torch's backend names in calls are not tests."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            found |= {c.value for p in parts for c in ast.walk(p) if isinstance(c, ast.Constant) and c.value in names}
        elif isinstance(node, ast.Dict):
            found |= {k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in names}
    return found


def test_no_module_but_the_registry_tests_a_transport_name():
    names = set(TRANSPORTS)
    for folder in ("hetpipe", "comm", "partitioner", "models"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path != REGISTRY:
                where = path.relative_to(REPO).as_posix()
                spelled = {n for n in names_tested_in(path.read_text(), names) if (where, n) not in NOT_A_TRANSPORT}
                assert not spelled, f"{path.relative_to(REPO)} tests {sorted(spelled)}: read its registry entry"


def test_the_check_finds_a_comparison_and_a_table():
    names = {"tcp", "gloo"}
    assert names_tested_in('if kind == "gloo":\n    pass\n', names) == {"gloo"}
    assert names_tested_in('ok = kind in ("tcp", "x")\n', names) == {"tcp"}
    assert names_tested_in('TABLE = {"tcp": 1}\n', names) == {"tcp"}
    assert names_tested_in('dist.new_group(r, backend="gloo")\nsuper().__init__(transport="tcp")\n', names) == set()


@pytest.mark.parametrize("name", sorted(TRANSPORTS))
def test_every_entry_is_built_by_a_channel_module_and_priced_by_a_cost_model(name):
    entry = TRANSPORTS[name]
    module, _, function = entry.builder.partition(":")
    assert module.startswith("hetpipe.comm."), entry.builder
    assert callable(getattr(importlib.import_module(module), function))
    assert entry.cost_model in set(TRANSPORT_MODELS) - {"auto"}


def test_auto_is_the_fallback_and_an_unknown_kind_is_refused_with_the_kinds():
    assert transport(AUTO) is FALLBACK
    assert KINDS == (*TRANSPORTS, AUTO)
    with pytest.raises(ConfigError, match=r"cluster.transport.kind='udp' is not one of \('tcp', 'direct', 'gloo', "
                                          r"'auto'\)"):
        ClusterConfig(transport=TransportConfig(kind="udp"))


@pytest.mark.parametrize("name", sorted(TRANSPORTS))
def test_message_mac_is_taken_where_the_entry_says(name):
    make = lambda: ClusterConfig(transport=TransportConfig(kind=name, message_mac=True))  # noqa: E731
    if TRANSPORTS[name].message_mac:
        make()
    else:
        with pytest.raises(ConfigError, match=f"message_mac covers the tcp channel's frames only, not kind={name}"):
            make()
