"""A checkpoint's optimizer state re-cut for another strategy: train under one strategy, restore
under another (a tuned one, or one that fits the nodes left), and go on as if never stopped.

Every holder of optimizer state (a parameter server's numpy rules or Keras optimizer, the numpy
all-reduce channel, the ``graph`` channel's Keras optimizer) names its arrays its own way: by
shard key (``"<var>.<shard>/<slot>"``) or by position among a Keras optimizer's variables
(``"keras/<i>"``). Each also says what every array is in words any holder reads, its *canonical*
name: ``"<var>.<shard>/<slot>"`` (the shard's region of that slot, Keras' slot name: the numpy
rules' ``m``/``v`` are Keras' ``momentum``/``velocity``), ``"<var>/<slot>"`` (the whole variable's)
or ``"@<name>"`` for the optimizer's own state (``@iteration``: its count of updates). A save
resolves those names against the session's plan into the checkpoint's ``state_index`` (array ->
``[var, axis, start, stop, slot]`` or ``"@name"``). A restore under another plan cuts, for every
shard the new plan places, each slot's region out of the old shards that overlap it (one old
shard read at a time), and hands each holder the canonical arrays of its keys
(``canonical=True``), which it renames to its own.

Not re-cut, refused with the reason: state that is not the shape of its variable's shard
(Adafactor's row and column factors), a checkpoint written before the index was kept, and one
whose parameter servers' counters differ from its step (an asynchronous PS). The number of
workers may differ (``session_state.load``: data positions).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from strategy_space.errors import ConfigError

ITERATION = "@iteration"
# the numpy rules' slot names (``optimizers``) as Keras names the same state
KERAS_SLOTS = {"m": "momentum", "v": "velocity", "v_hat": "velocity_hat"}


def key_text(key) -> str:
    """A shard key ``(var, shard)`` (or any key) as text for an array name: ``"var.shard"``."""
    return ".".join(str(k) for k in key) if isinstance(key, tuple) else str(key)


# ---- the holders' side ----------------------------------------------------------------------
def numpy_names(slots: dict) -> dict:
    """Canonical names of the numpy rules' slots (key -> {slot: array}), by ``save``'s names."""
    return {f"{key_text(k)}/{n}": f"{key_text(k)}/{KERAS_SLOTS.get(n, n)}" for k, s in slots.items() for n in s}


def _variables_held(arrays: dict) -> set:
    """The variables (as text) ``arrays`` holds any slot of: not one whose old holder had taken
    no update yet (a Keras optimizer builds its slots at its first), whose slots are then as a new
    holder starts them."""
    return {_variable(k) for k in arrays if not k.startswith("@")}


def _variable(canon: str) -> str:
    return canon.split("/", 1)[0].split(".", 1)[0]


def from_numpy_names(slots: dict, arrays: dict) -> dict:
    """``arrays`` (canonical names) renamed as the numpy rules' ``save`` names them, for the keys
    of ``slots``; a variable the checkpoint holds no slot of keeps its slots as they are
    (``_variables_held``), and all do where it holds none at all (saved before any update: empty)."""
    held = _variables_held(arrays)
    if not held:
        return {}
    out = {}
    for key, own_slots in slots.items():
        for name, current in own_slots.items():
            canon = f"{key_text(key)}/{KERAS_SLOTS.get(name, name)}"
            if canon in arrays:
                out[f"{key_text(key)}/{name}"] = arrays[canon]
            elif _variable(canon) not in held:   # its old holder had taken no update: as a new one starts
                out[f"{key_text(key)}/{name}"] = current
    return out


def keras_names(variables, prefixes: dict, iterations) -> dict:
    """Canonical names of a Keras optimizer's ``variables`` by ``"keras/<i>"``. A slot is named
    after its variable (``<prefix>_<slot>``, Keras' ``add_variable_from_reference``): ``prefixes``
    maps each reference variable's name prefix to its canonical key text; ``iterations`` is the
    optimizer's counter. A name that matches no prefix is the optimizer's own (``@name``); one
    that two variables share cannot be told apart (None)."""
    out = {}
    for i, v in enumerate(variables):
        name = str(v.name).split(":")[0]
        if v is iterations:
            out[f"keras/{i}"] = ITERATION
            continue
        best = max((p for p in prefixes if name.startswith(p + "_")), key=len, default=None)
        out[f"keras/{i}"] = f"{prefixes[best]}/{name[len(best) + 1:]}" if best is not None else f"@{name}"
    seen: dict = {}
    for own, canon in out.items():
        seen.setdefault(canon, []).append(own)
    return {own: (None if len(seen[canon]) > 1 else canon) for own, canon in out.items()}


def from_keras_names(names: dict, arrays: dict) -> tuple[dict, list]:
    """``arrays`` (canonical names) renamed by ``keras_names``' ``names`` (``"keras/<i>"`` ->
    canonical), and the problems. A learning rate the checkpoint does not hold (the numpy rules
    keep none) stays as the optimizer has it, so do the slots of a variable it holds none of
    (``_variables_held``), and everything when it holds no slot at all (saved before any update)."""
    held = _variables_held(arrays)
    if not held:
        return {}, []
    out, missing = {}, []
    for own, canon in names.items():
        if canon in arrays:
            out[own] = arrays[canon]
        elif canon is None or (canon != "@learning_rate" and (canon.startswith("@") or _variable(canon) in held)):
            missing.append(canon or own)
    return out, ([f"optimizer state missing from the checkpoint: {', '.join(missing[:6])}"] if missing else [])


def whole_slots(arrays: dict, members: list, names: dict) -> dict:
    """For a holder of whole variables whose state ``names`` calls ``"<var>/<slot>"``: those
    arrays from the canonical arrays of the variables' shards (``members``: each with ``key``,
    ``axis``, ``num_shards``), joined along their axis."""
    by_var: dict = {}
    for m in sorted(members, key=lambda m: m.key):
        by_var.setdefault(m.key[0], []).append(m)
    out = dict(arrays)
    for canon in names.values():
        if canon is None or canon.startswith("@"):
            continue
        var, slot = canon.split("/", 1)
        parts = [arrays.get(f"{key_text(m.key)}/{slot}") for m in by_var.get(int(var), ())]
        if parts and all(p is not None for p in parts):
            out[canon] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=by_var[int(var)][0].axis)
    return out


# ---- the driver's side ----------------------------------------------------------------------
def state_index(canonical: dict, plan, shapes: list) -> dict:
    """The checkpoint's ``state_index``: array name -> ``[var, axis, start, stop, slot]`` (the
    region of the variable it holds; axis -1: the whole of a scalar) or ``"@name"``, from the
    holders' ``canonical`` names (array name -> canonical name or None) and ``plan`` (its
    shards' regions); a name the holder could not give is left out (that state is not re-cut)."""
    regions = {key_text(r.key): (r.axis, r.start, r.stop) for p in plan.ps_actors for r in p.shards}
    regions.update((key_text(m.key), (m.axis, m.start, m.stop)) for g in plan.ar_groups for m in g.members)
    out = {}
    for name, canon in canonical.items():
        if canon is None:
            continue
        if canon.startswith("@"):
            out[name] = canon
            continue
        where, slot = canon.split("/", 1)
        var = int(where.split(".")[0])
        shape = shapes[var]
        if not shape:
            out[name] = [var, -1, 0, 1, slot]
        elif "." in where:
            if where in regions:
                out[name] = [var, *regions[where], slot]
        else:
            out[name] = [var, 0, 0, int(shape[0]), slot]
    return out


def restore_problems(index, arrays, shapes: list, step: int, ps_versions: dict) -> list[str]:
    """Why a checkpoint's optimizer state cannot be re-cut for another strategy (empty: it can)."""
    if index is None:
        return ["it was written before checkpoints kept what each optimizer array holds, so its state restores "
                "only onto the strategy it was written with"]
    problems = []
    lacking = sorted(set(index) - set(arrays))
    if lacking:
        problems.append(f"its state index names arrays its state.npz lacks ({', '.join(lacking[:4])}): the "
                        f"checkpoint is damaged")
    unnamed = sorted(n for n in arrays if _optimizer_array(n) and n not in index)
    if unnamed:
        problems.append(f"its optimizer state {', '.join(unnamed[:4])} is not per variable shard (e.g. Adafactor's "
                        f"factored statistics), so it cannot be re-cut for another strategy")
    counters = {(v["version"], *v["chunk_version"]) for v in ps_versions.values()}
    if counters - {(step,) + (step,) * (len(c) - 1) for c in counters}:
        problems.append(f"its parameter servers' update counters ({sorted(counters)[:3]}) are not its step {step} "
                        f"(an asynchronous PS counts each push)")
    return problems


def _optimizer_array(name: str) -> bool:
    return name.startswith(("ps/", "channel"))


class Recut(Mapping):
    """The canonical arrays a new plan's holders take, cut from a checkpoint's on access: for
    every PS actor ``"ps/<actor>/<var>.<shard>/<slot>"`` and ``"ps/<actor>/@<name>"``; for
    the channels ``channel_state()`` (every all-reduced shard, which each worker's channels
    pick their own from); the rest of the checkpoint (random-layer generators, loss scaling)
    as it is. Raises ConfigError where a piece's shape is not its region's."""

    def __init__(self, index: dict, arrays, plan, shapes: list, step: int, skipped: int = 0):
        self.arrays, self.shapes = arrays, shapes
        self.pieces: dict = {}   # (var, slot) -> [(array name, axis, start, stop)]
        self.globals: dict = {}
        for name, entry in index.items():
            if isinstance(entry, str):
                self.globals.setdefault(entry, name)
            else:
                var, axis, start, stop, slot = entry
                self.pieces.setdefault((int(var), slot), []).append((name, int(axis), int(start), int(stop)))
        self.slots: dict = {}   # var -> its slot names
        for var, slot in self.pieces:
            self.slots.setdefault(var, []).append(slot)
        self.iteration = np.array(step - skipped, np.int64)
        if ITERATION in self.globals:
            self.iteration = np.asarray(arrays[self.globals[ITERATION]])
        # what is not optimizer state (random-layer generators, loss scaling) passes as it is
        self.keys = {n: n for n in arrays if not _optimizer_array(n)}
        for p in plan.ps_actors:
            for r in p.shards:
                for slot in self.slots.get(r.var_index, ()):
                    self.keys[f"ps/{p.name}/{key_text(r.key)}/{slot}"] = (r.var_index, r.axis, r.start, r.stop, slot)
            self.keys.update((f"ps/{p.name}/{g}", (g,)) for g in self._global_names())
        self.ar_keys = {f"{key_text(m.key)}/{slot}": (m.key[0], m.axis, m.start, m.stop, slot)
                        for g in plan.ar_groups for m in g.members for slot in self.slots.get(m.key[0], ())}

    def _global_names(self) -> list:
        return [ITERATION] + [g for g in self.globals if g != ITERATION]

    def __getitem__(self, name: str) -> np.ndarray:
        return self._value(self.keys[name])

    def __iter__(self):
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def channel_state(self) -> dict:
        """Every all-reduced shard's slots and the optimizer's own state (canonical names)."""
        out = {g: self._value((g,)) for g in self._global_names()}
        out.update((name, self._value(entry)) for name, entry in self.ar_keys.items())
        return out

    def _value(self, entry) -> np.ndarray:
        if isinstance(entry, str):   # passed through
            return self.arrays[entry]
        if len(entry) == 1:   # the optimizer's own
            return self.iteration if entry[0] == ITERATION else np.asarray(self.arrays[self.globals[entry[0]]])
        var, axis, start, stop, slot = entry
        return self._cut(var, slot, axis, start, stop)

    def _cut(self, var: int, slot: str, axis: int, start: int, stop: int) -> np.ndarray:
        shape = tuple(self.shapes[var])
        want = _bounds(shape, axis, start, stop)
        out, filled = None, 0
        for name, p_axis, p_start, p_stop in self.pieces[(var, slot)]:
            have = _bounds(shape, p_axis, p_start, p_stop)
            inter = [(max(a[0], b[0]), min(a[1], b[1])) for a, b in zip(want, have)]
            if any(lo >= hi for lo, hi in inter):
                continue
            piece = np.asarray(self.arrays[name])
            if piece.shape != tuple(hi - lo for lo, hi in have):
                raise ConfigError(f"optimizer state {name} has shape {piece.shape}, not its shard's "
                                 f"{tuple(hi - lo for lo, hi in have)}: it cannot be re-cut for another strategy")
            if out is None:
                out = np.empty(tuple(hi - lo for lo, hi in want), piece.dtype)
            dst = tuple(slice(lo - w[0], hi - w[0]) for (lo, hi), w in zip(inter, want))
            src = tuple(slice(lo - h[0], hi - h[0]) for (lo, hi), h in zip(inter, have))
            out[dst] = piece[src]
            filled += math.prod(hi - lo for lo, hi in inter)
        if out is None or filled != out.size:
            raise ConfigError(f"the checkpoint's {slot} of variable {var} does not cover its region "
                             f"[{start}, {stop}) along axis {axis}")
        return out


def recut(manifest, arrays, plan, where: str) -> tuple[Recut, dict]:
    """The checkpoint state ``arrays`` (of ``manifest``) re-cut for ``plan``, and its parameter
    servers' counters (every chunk at the checkpoint's step).

    Raises:
        ConfigError: the state cannot be re-cut (``restore_problems``), naming ``where``.
    """
    shapes = [tuple(s) for _, s, _ in manifest.variables]
    problems = restore_problems(manifest.state_index, arrays, shapes, manifest.step, manifest.ps_versions)
    if problems:
        raise ConfigError([f"the checkpoint was written under another strategy, and {p}" for p in problems],
                          source=where)
    skipped = int(np.asarray(arrays["loss_scale"])[2]) if "loss_scale" in arrays else 0
    versions = {p.name: {"version": manifest.step, "chunk_version": None} for p in plan.ps_actors}
    return Recut(manifest.state_index, arrays, plan, shapes, manifest.step, skipped), versions


def _bounds(shape: tuple, axis: int, start: int, stop: int) -> list:
    """Per dimension, ``[lo, hi)`` of a region that restricts one ``axis`` (-1 or a scalar: whole)."""
    return [(start, stop) if d == axis else (0, n) for d, n in enumerate(shape)]
