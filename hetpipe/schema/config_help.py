"""``--help``'s config: the composed config as YAML, each field followed by its
one-line description from the config dataclasses (hetpipe.schema.field_docs).

Hydra prints ``--help`` from the template in ``hydra.help.template``
(configs/pretrain.yaml, configs/plan.yaml); the template names the resolver
``${hetpipe.config_help:}``, which renders the config hydra composed for that
command line (overrides and presets included), so ``--help`` shows the values
the run would get beside what each one means.
"""
from __future__ import annotations

from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from hetpipe.schema.field_docs import field_docs

RESOLVER = "hetpipe.config_help"
# Descriptions start at this column where the key and value leave room.
COMMENT_COLUMN = 36


def register_help_resolver() -> None:
    """Make ``${hetpipe.config_help:}`` available to hydra's help template (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, _config_help)


def _config_help(*, _root_: DictConfig) -> str:
    # string.Template reads the help text after this: "$" stands for itself only doubled.
    return annotated_config(_root_).replace("$", "$$")


def annotated_config(root: DictConfig) -> str:
    """The config (without hydra's own node) as YAML with each field's description."""
    raw = OmegaConf.to_container(root, resolve=False)
    raw.pop("hydra", None)
    return "\n".join(_lines(root, raw, 0))


def _docs(node: Any) -> dict[str, str]:
    """The descriptions of a config node's fields, where a dataclass is its schema."""
    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    return field_docs(schema) if isinstance(schema, type) and hasattr(schema, "__dataclass_fields__") else {}


def _lines(node: Any, raw: dict[str, Any], depth: int) -> list[str]:
    docs, pad, out = _docs(node), "  " * depth, []
    for key, value in raw.items():
        child = node[key] if isinstance(value, (dict, list)) else None  # a container: nothing resolves
        if isinstance(value, dict) and value:
            out += [_described(f"{pad}{key}:", docs.get(key)), *_lines(child, value, depth + 1)]
        elif isinstance(value, list) and any(isinstance(v, dict) for v in value):
            out.append(_described(f"{pad}{key}:", docs.get(key)))
            for item_node, item in zip(child, value):
                item_lines = _lines(item_node, item, depth + 2)
                out += [f"{pad}  - {item_lines[0].lstrip()}", *item_lines[1:]]
        else:
            out.append(_described(f"{pad}{key}: {_scalar(value)}", docs.get(key)))
    return out


def _described(line: str, doc: str | None) -> str:
    return f"{line.ljust(COMMENT_COLUMN)}  # {doc}" if doc else line


def _scalar(value: Any) -> str:
    """``value`` as YAML on one line (interpolations and ??? as written)."""
    if isinstance(value, str) and (value == "???" or "${" in value):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).removesuffix("\n...\n").strip()

