"""ZeRO-1 for data parallelism: AdamW with its state sharded over the DP group.

ZeRO stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC 2020), laid out as in Megatron-LM's distributed
optimizer (``megatron/core/optimizer/distrib_optimizer.py``), simplified.
Parameters are packed per (device, dtype) into one flat, padded buffer (each
parameter's storage becomes a view into it); DP rank ``r`` owns the ``r``-th
contiguous 1/DP of that buffer and keeps AdamW's ``exp_avg`` and
``exp_avg_sq`` (and, for bf16/fp16 parameters, an fp32 main copy) for that
slice only. ``step()`` updates the owned slice with torch's own AdamW and
all-gathers the updated slices back into the full parameters.

It needs gradients that are already the DP average: run
:meth:`hetpipe.parallel.grad_reducer.GradReducer.finish` (and anything else
that reads gradients, such as clipping) before :meth:`DistributedOptimizer.step`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from hetpipe.parallel.group_facts import all_gather_single, group_size_rank, is_nccl


def _all_gather_flat(output: torch.Tensor, rank: int, shard: int, group: Optional[dist.ProcessGroup],
                     in_place: bool) -> Any:
    """All-gather ``output[rank*shard:(rank+1)*shard]`` of every rank into ``output`` (async)."""
    mine = output[rank * shard:(rank + 1) * shard]
    if not in_place:  # NCCL gathers in place; for other backends do not alias input and output
        mine = mine.clone()
    return all_gather_single(output, mine, group=group, async_op=True)


@dataclass
class _Space:
    """The parameters of one (device, dtype), packed into one padded flat buffer."""
    device: torch.device
    dtype: torch.dtype
    params: list[int] = field(default_factory=list)   # global parameter indices
    offsets: list[int] = field(default_factory=list)  # start of each in the flat buffer
    numel: int = 0
    padded: int = 0
    shard: int = 0                                    # elements per rank
    flat: Optional[torch.Tensor] = None
    main: Optional[torch.Tensor] = None               # fp32 copy of this rank's slice (non-fp32 only)


@dataclass
class _Shard:
    """This rank's contiguous piece of one param group inside one space."""
    space: int
    group: int
    lo: int                                           # flat-buffer range [lo, hi)
    hi: int
    tensor: torch.Tensor                              # fp32 main values (a view), optimised by AdamW
    # (param index, start, stop in the flattened param, start in ``tensor``)
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)


class _ShardedState(dict):
    """Stands in for ``Optimizer.state``, which a sharded optimizer cannot fill
    per parameter: any read fails loudly instead of quietly finding nothing."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("DistributedOptimizer keeps its state sharded over the data-parallel group; use "
                        "full_state_dict()/load_full_state_dict() or sharded_state_dict()/"
                        "load_sharded_state_dict() instead of .state")

    __getitem__ = get = items = keys = values = __iter__ = setdefault = _refuse  # type: ignore


ParamsLike = Union[Iterable[torch.Tensor], Iterable[tuple[str, torch.Tensor]], Iterable[dict]]


class DistributedOptimizer(torch.optim.Optimizer):
    """AdamW whose state is sharded over the data-parallel group (ZeRO-1).

    ``params`` is what :class:`torch.optim.AdamW` accepts: tensors,
    ``(name, tensor)`` pairs, or a list of param-group dicts (for instance
    ``build_optimizer``'s two groups, decayed matrices and undecayed vectors)
    whose entries may be either. Names key the checkpoint functions; unnamed
    parameters are called ``param<i>`` (their position in ``param_groups``
    order). Hyper-parameters per group, as in AdamW: ``lr``, ``betas``,
    ``eps``, ``weight_decay``; change ``param_groups[i]["lr"]`` between steps
    as with any optimizer.

    Construction moves every trainable parameter's storage into a flat buffer
    per (device, dtype) (``p.data`` becomes a view; values are unchanged), so
    build it after the model is on its device. All DP replicas must start from
    the same parameter values; they stay identical afterwards.

    ``step()`` expects every parameter's ``.grad`` to already be the DP
    average (run :meth:`GradReducer.finish` first); it does not communicate
    gradients itself. A parameter whose ``.grad`` is None is updated as if its
    gradient were zero (weight decay and momentum still apply), where
    ``torch.optim.AdamW`` would skip it - the same as Megatron, and never the
    case after ``GradReducer.finish()``. ``step()`` is a collective (one
    all-gather per space); every rank of ``group`` must call it.

    ``fused``/``foreach`` are passed to the inner ``torch.optim.AdamW`` that
    updates the owned slices; with ``fused=False`` (and fp32 parameters) the
    update is elementwise the same arithmetic as ``torch.optim.AdamW``.
    """

    def __init__(self, params: ParamsLike, group: Optional[dist.ProcessGroup] = None, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 fused: Optional[bool] = None, foreach: Optional[bool] = None) -> None:
        groups = self._split_names(params)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(groups, defaults)
        self.state = _ShardedState()  # type: ignore[assignment]
        self.group = group
        self.dp_size, self.dp_rank = group_size_rank(group)
        self._in_place_gather = is_nccl(group)
        self._step = 0

        # Trainable parameters in param_groups order, with their names and groups.
        self._params: list[torch.Tensor] = []
        self._names: list[str] = []
        self._group_of: list[int] = []
        seen: set[int] = set()
        position = 0
        for g, pg in enumerate(self.param_groups):
            names = pg.get("param_names")
            for j, p in enumerate(pg["params"]):
                name = names[j] if names is not None else f"param{position}"
                position += 1
                if id(p) in seen:
                    raise ValueError(f"parameter {name} appears twice in the optimizer's param groups")
                seen.add(id(p))
                if not p.requires_grad:
                    continue
                self._params.append(p)
                self._names.append(name)
                self._group_of.append(g)
        if len(set(self._names)) != len(self._names):
            raise ValueError("parameter names given to DistributedOptimizer are not unique")
        self._index_of_name = {n: i for i, n in enumerate(self._names)}

        # Spaces: one flat padded buffer per (device, dtype), params in group order.
        self._spaces: list[_Space] = []
        space_of: dict[tuple[torch.device, torch.dtype], int] = {}
        for i, p in enumerate(self._params):
            key = (p.device, p.dtype)
            if key not in space_of:
                space_of[key] = len(self._spaces)
                self._spaces.append(_Space(device=p.device, dtype=p.dtype))
            s = self._spaces[space_of[key]]
            s.params.append(i)
            s.offsets.append(s.numel)
            s.numel += p.numel()
        self._shards: list[_Shard] = []
        with torch.no_grad():
            for si, s in enumerate(self._spaces):
                s.shard = max(1, math.ceil(s.numel / self.dp_size))
                s.padded = s.shard * self.dp_size
                s.flat = torch.zeros(s.padded, dtype=s.dtype, device=s.device)
                for i, off in zip(s.params, s.offsets):
                    p = self._params[i]
                    n = p.numel()
                    s.flat[off:off + n].copy_(p.detach().reshape(-1))
                    p.data = s.flat[off:off + n].view_as(p)
                lo, hi = self.dp_rank * s.shard, (self.dp_rank + 1) * s.shard
                if s.dtype != torch.float32:
                    s.main = s.flat[lo:hi].float()
                # This rank's slice of each param group (contiguous: groups are packed in order).
                for g in range(len(self.param_groups)):
                    members = [(i, off) for i, off in zip(s.params, s.offsets) if self._group_of[i] == g]
                    if not members:
                        continue
                    g_lo = max(lo, members[0][1])
                    g_hi = min(hi, members[-1][1] + self._params[members[-1][0]].numel())
                    if g_lo >= g_hi:
                        continue
                    tensor = s.flat[g_lo:g_hi] if s.main is None else s.main[g_lo - lo:g_hi - lo]
                    shard = _Shard(space=si, group=g, lo=g_lo, hi=g_hi, tensor=tensor)
                    for i, off in members:
                        a, b = max(g_lo, off), min(g_hi, off + self._params[i].numel())
                        if a < b:
                            shard.pieces.append((i, a - off, b - off, a - g_lo))
                    self._shards.append(shard)

        # The inner AdamW sees one tensor per owned (group, space) slice.
        self._inner: Optional[torch.optim.AdamW] = None
        self._inner_group_of: list[int] = []
        inner_groups = []
        for g in range(len(self.param_groups)):
            tensors = [sh.tensor for sh in self._shards if sh.group == g]
            if tensors:
                inner_groups.append({"params": tensors})
                self._inner_group_of.append(g)
        if inner_groups:
            self._inner = torch.optim.AdamW(inner_groups, lr=lr, betas=betas, eps=eps,
                                            weight_decay=weight_decay, fused=fused, foreach=foreach)

    @staticmethod
    def _split_names(params: ParamsLike) -> list[dict]:
        """Param groups with tensors in "params" and names (if any) in "param_names"."""
        items = list(params)
        if not items:
            raise ValueError("DistributedOptimizer got an empty parameter list")
        groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
        for g in groups:
            entries = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            named = [isinstance(e, tuple) for e in entries]
            if any(named):
                if not all(named):
                    raise ValueError("give names for all parameters of a group or for none")
                g["param_names"] = [n for n, _ in entries]
                g["params"] = [p for _, p in entries]
            else:
                g["params"] = entries
        return groups

    # -- the step ----------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._inner is not None:
            for inner_group, g in zip(self._inner.param_groups, self._inner_group_of):
                outer = self.param_groups[g]
                for key in ("lr", "betas", "eps", "weight_decay"):
                    inner_group[key] = outer[key]
            for sh in self._shards:
                sh.tensor.grad = self._shard_grad(sh)
            self._inner.step()
            for sh in self._shards:
                sh.tensor.grad = None
        works = []
        for s in self._spaces:
            lo, hi = self.dp_rank * s.shard, (self.dp_rank + 1) * s.shard
            if s.main is not None:
                s.flat[lo:hi].copy_(s.main)
            if self.dp_size > 1:
                works.append(_all_gather_flat(s.flat, self.dp_rank, s.shard, self.group, self._in_place_gather))
        for w in works:
            w.wait()
        self._step += 1
        return loss

    def _shard_grad(self, sh: _Shard) -> torch.Tensor:
        """The fp32 gradient of a shard: a view when one fp32 gradient covers it, else a copy."""
        if len(sh.pieces) == 1:
            i, a, b, _ = sh.pieces[0]
            grad = self._params[i].grad
            if grad is not None and grad.dtype == torch.float32 and grad.is_contiguous():
                return grad.view(-1)[a:b]
        out = torch.zeros(sh.hi - sh.lo, dtype=torch.float32, device=sh.tensor.device)
        for i, a, b, at in sh.pieces:
            grad = self._params[i].grad
            if grad is not None:
                out[at:at + b - a].copy_(grad.reshape(-1)[a:b])
        return out

    # -- memory ------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank: AdamW's moments and step
        counters of the owned slices, plus the fp32 main copies of non-fp32
        parameters. Zero before the first step (AdamW creates state lazily)."""
        total = sum(s.main.numel() * s.main.element_size() for s in self._spaces if s.main is not None)
        if self._inner is not None:
            for st in self._inner.state.values():
                total += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
        return total

    # -- checkpoints -------------------------------------------------------

    def _inner_state(self, sh: _Shard) -> Optional[dict[str, torch.Tensor]]:
        if self._inner is None:
            return None
        st = self._inner.state.get(sh.tensor)
        return st if st else None

    def _has_state(self) -> bool:
        return self._step > 0 or any(self._inner_state(sh) is not None for sh in self._shards)

    def _step_tensor(self) -> torch.Tensor:
        return torch.tensor(float(self._step), dtype=torch.float32)

    def owned_ranges(self) -> dict[str, tuple[int, int]]:
        """``{name: (start, stop)}``: the elements of each flattened parameter
        whose state this rank keeps (what :meth:`load_sharded_state_dict` must cover)."""
        return {self._names[i]: (a, b) for sh in self._shards for i, a, b, _ in sh.pieces}

    def state_step(self) -> Optional[int]:
        """The optimizer steps the state has taken, or None before it has any state."""
        return self._step if self._has_state() else None

    def sharded_state_dict(self) -> dict[str, dict[str, Any]]:
        """This rank's part of the state, by parameter name (not a collective).

        ``{name: {"exp_avg": t, "exp_avg_sq": t, "step": scalar, "range": (start, stop),
        "shape": param shape}}`` for every parameter of which this rank owns
        elements ``[start, stop)`` of the flattened parameter (``t`` are 1-D
        copies of those elements). Empty before the first step.
        """
        out: dict[str, dict[str, Any]] = {}
        if not self._has_state():
            return out
        step = self._step_tensor()
        for sh in self._shards:
            st = self._inner_state(sh)
            for i, a, b, at in sh.pieces:
                entry: dict[str, Any] = {"step": step.clone(), "range": (a, b),
                                         "shape": tuple(self._params[i].shape)}
                for key in ("exp_avg", "exp_avg_sq"):
                    entry[key] = (st[key][at:at + b - a].clone() if st is not None
                                  else torch.zeros(b - a, dtype=torch.float32, device=sh.tensor.device))
                out[self._names[i]] = entry
        return out

    def load_sharded_state_dict(self, shards: Union[Mapping[str, Mapping[str, Any]],
                                                    Sequence[Mapping[str, Mapping[str, Any]]]]) -> None:
        """Load state from one or more :meth:`sharded_state_dict` results (not a collective).

        Pass this rank's own dict to resume at the same DP size, or any set of
        dicts whose ranges cover what this rank owns (e.g. all old ranks'
        dicts) to resume at a different DP size. Empty dicts reset the state.
        """
        pieces_by_name: dict[str, list[tuple[int, int, Mapping[str, Any]]]] = {}
        for sd in ([shards] if isinstance(shards, Mapping) else list(shards)):
            for name, entry in sd.items():
                start, stop = entry["range"]
                pieces_by_name.setdefault(name, []).append((int(start), int(stop), entry))
        if not pieces_by_name:
            self._reset_state()
            return
        steps = {float(e["step"]) for ps in pieces_by_name.values() for _, _, e in ps}
        step = self._check_step(steps)

        def fill(i: int, a: int, b: int, key: str, out: torch.Tensor) -> None:
            name = self._names[i]
            covered = 0
            for start, stop, entry in pieces_by_name.get(name, []):
                x, y = max(a, start), min(b, stop)
                if x < y:
                    out[x - a:y - a].copy_(torch.as_tensor(entry[key]).reshape(-1)[x - start:y - start])
                    covered += y - x
            if covered != b - a:
                raise ValueError(f"sharded optimizer state for {name} does not cover elements [{a}, {b})")

        self._install(step, fill)

    def full_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole AdamW state by parameter name; a collective over the DP group.

        ``{name: {"step": scalar fp32 tensor, "exp_avg": t, "exp_avg_sq": t}}``
        with ``t`` shaped like the parameter (fp32, on its device), on every
        rank - the per-parameter layout of ``torch.optim.AdamW.state``, so a
        checkpoint writer on DP rank 0 can store ``exp_avg/<name>`` etc. as
        for a plain AdamW. Empty before the first step.
        """
        if not self._has_state():
            return {}
        out: dict[str, dict[str, torch.Tensor]] = {n: {"step": self._step_tensor()} for n in self._names}
        for key in ("exp_avg", "exp_avg_sq"):
            fulls, works = [], []
            for si, s in enumerate(self._spaces):
                full = torch.zeros(s.padded, dtype=torch.float32, device=s.device)
                for sh in self._shards:
                    st = self._inner_state(sh)
                    if sh.space == si and st is not None:
                        full[sh.lo:sh.hi].copy_(st[key])
                if self.dp_size > 1:
                    works.append(_all_gather_flat(full, self.dp_rank, s.shard, self.group, self._in_place_gather))
                fulls.append(full)
            for w in works:
                w.wait()
            for s, full in zip(self._spaces, fulls):
                for i, off in zip(s.params, s.offsets):
                    p = self._params[i]
                    out[self._names[i]][key] = full[off:off + p.numel()].view(p.shape).clone()
        return out

    def load_full_state_dict(self, full: Mapping[str, Any]) -> None:
        """Keep this rank's slice of a whole per-name AdamW state (not a collective).

        Accepts :meth:`full_state_dict`'s layout ``{name: {"step", "exp_avg",
        "exp_avg_sq"}}`` or flat checkpoint keys ``{"exp_avg/<name>": t, ...}``.
        Every parameter needs an entry; an empty mapping resets the state.
        """
        nested: dict[str, dict[str, Any]] = {}
        for k, v in full.items():
            if isinstance(v, Mapping):
                nested.setdefault(k, {}).update(v)
            else:
                key, sep, name = k.partition("/")
                if not sep:
                    raise ValueError(f"unexpected optimizer state key {k!r}")
                nested.setdefault(name, {})[key] = v
        if not nested:
            self._reset_state()
            return
        missing = [n for n in self._names if n not in nested]
        if missing:
            raise ValueError(f"optimizer state has no entry for {', '.join(missing[:5])}")
        step = self._check_step({float(nested[n]["step"]) for n in self._names})
        for n in self._names:
            p = self._params[self._index_of_name[n]]
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(torch.as_tensor(nested[n][key]).shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {key}/{n} has shape {tuple(nested[n][key].shape)}, "
                                     f"the parameter {tuple(p.shape)}")

        def fill(i: int, a: int, b: int, key: str, out: torch.Tensor) -> None:
            out.copy_(torch.as_tensor(nested[self._names[i]][key]).reshape(-1)[a:b])

        self._install(step, fill)

    @staticmethod
    def _check_step(steps: set[float]) -> int:
        if len(steps) != 1:
            raise ValueError(f"optimizer state has different step counts {sorted(steps)}; "
                             "DistributedOptimizer keeps one step count for all parameters")
        return int(steps.pop())

    def _install(self, step: int, fill: Callable[[int, int, int, str, torch.Tensor], None]) -> None:
        with torch.no_grad():
            self._step = step
            if self._inner is not None:
                fused = any(g.get("fused") or g.get("capturable") for g in self._inner.param_groups)
                for sh in self._shards:
                    st: dict[str, torch.Tensor] = {}
                    for key in ("exp_avg", "exp_avg_sq"):
                        t = torch.zeros(sh.hi - sh.lo, dtype=torch.float32, device=sh.tensor.device)
                        for i, a, b, at in sh.pieces:
                            fill(i, a, b, key, t[at:at + b - a])
                        st[key] = t
                    st["step"] = torch.tensor(float(step), dtype=torch.float32,
                                              device=sh.tensor.device if fused else "cpu")
                    self._inner.state[sh.tensor] = st
            self.sync_main_params()

    def _reset_state(self) -> None:
        self._step = 0
        if self._inner is not None:
            self._inner.state.clear()
        self.sync_main_params()

    @torch.no_grad()
    def sync_main_params(self) -> None:
        """Refresh the fp32 main copies of non-fp32 parameters from the
        parameters (call after loading weights into the model; the loaders
        above do it themselves). A no-op for fp32 parameters, whose main copy
        is the parameter itself."""
        for s in self._spaces:
            if s.main is not None:
                lo = self.dp_rank * s.shard
                s.main.copy_(s.flat[lo:lo + s.shard])

    # -- torch.optim.Optimizer's per-parameter state API ---------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        raise TypeError("DistributedOptimizer state is sharded: use full_state_dict() (collective) or "
                        "sharded_state_dict()")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        raise TypeError("DistributedOptimizer state is sharded: use load_full_state_dict() or "
                        "load_sharded_state_dict()")
