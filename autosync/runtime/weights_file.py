"""A checkpoint's ``model.weights.h5`` written and read in Keras' own layout without a Keras model
in the driver.

``keras.Model.save_weights`` needs a built model holding every weight: for a model of a few GB the
driver would hold a second copy of it (more, while its initializers run) beside the workers and
parameter servers. The layout of the file is Keras' to decide, so it is not written down here:
worker 0, which holds the model, walks it as ``save_weights`` does with a store that writes nothing
and records, per entry, the group path, its attributes and which model weight each dataset holds
(``layout``). The driver then writes the weights into that layout as they stream in
(``write``), and reads them back by the same layout (``Weights``); the file is the one
``save_weights`` would write, and ``keras.Model.load_weights`` reads it (tested against Keras' own).

What a compiled model saves besides its weights (its optimizer's counters and slots, its metrics'
totals: ``EXTRA_BYTES`` at most) is written as worker 0's model holds it, as ``save_weights`` on
that model would. Where the walk cannot say (a Keras without this private walk, a layer that saves
a computed value instead of a weight or beside its weights, a dtype h5py stores differently)
``layout`` returns None and the driver uses a model of its own, as before.
"""
from __future__ import annotations

import numpy as np

from autosync.runtime.state_file import MAP_BYTES


class _NotAWeight(Exception):
    """A layer saved something that is not one of the model's weights, or too much beside them."""


# what a walk may record besides the model's weights, as values: the state ``compile`` adds
# (the optimizer's counters, the metrics' totals), written as the walk found it
EXTRA_BYTES = 1 << 20


def layout(model) -> list | None:
    """How ``model.save_weights`` lays out ``model.weights``: ``[(group path, attributes,
    [(dataset name, model weight index), ...]), ...]`` in the order Keras writes them, or None when
    this Keras or this model cannot say (see the module doc). What a compiled model saves besides
    its weights (its optimizer's and metrics' variables, up to ``EXTRA_BYTES`` in all) is listed
    by value, an array in place of the index."""
    try:
        from keras.src.saving import saving_lib
        store_class = saving_lib.H5IOStore
        walk = saving_lib._save_state
    except (ImportError, AttributeError):
        return None
    weights = list(model.weights)
    index = {id(w): i for i, w in enumerate(weights)}
    entries: list = []
    extra = [0]

    class Recorder(store_class):   # the walk insists on a store of Keras' own classes
        def __init__(self):   # no file: nothing is written
            pass

        def __bool__(self):
            return True

        def make(self, path, metadata=None):
            entries.append((path, dict(metadata or {}), []))
            return self

        def __setitem__(self, key, value):
            if id(value) in index:
                entries[-1][2].append((str(key), index[id(value)]))
                return
            array = np.array(value.numpy() if hasattr(value, "numpy") else value)
            extra[0] += array.nbytes
            if extra[0] > EXTRA_BYTES or array.dtype.kind not in "fiub":
                raise _NotAWeight(key)
            entries[-1][2].append((str(key), array))

    try:
        walk(model, weights_store=Recorder(), assets_store=None, inner_path="", visited_saveables=set())
    except (_NotAWeight, TypeError, ValueError):
        return None
    held = {i for _, _, items in entries for _, i in items if isinstance(i, int)}   # a shared one may be twice
    if held != set(range(len(weights))) or any(np.dtype(w.dtype).kind not in "fiub" for w in weights):
        return None   # a weight not saved (a layer saved a computed value), or one h5py stores its own way
    if any(len({isinstance(i, int) for _, i in items}) > 1 for _, _, items in entries):
        return None   # a layer saves a value beside its weights: as of now, not as the walk found it
    return [(path, attrs, items) for path, attrs, items in entries if items or attrs]


def write(path: str, entries: list, specs: list, weights) -> None:
    """Write ``path`` (a ``.weights.h5``) in the layout ``entries`` (``layout``'s): the groups and
    empty datasets first (``specs``: each weight's shape and dtype), then each ``(index, array)``
    of ``weights`` as it comes, in any order. Raises ValueError when one does not fit its spec."""
    import h5py

    datasets = {}
    with h5py.File(path, "w") as f:
        for where, attrs, items in entries:
            group = f.create_group(f"{where}/vars" if where else "vars")
            for k, v in attrs.items():
                group.attrs[k] = v
            for name, i in items:
                if not isinstance(i, int):   # a compiled model's extra state, as the walk found it
                    group[name] = i
                    continue
                shape, dtype = specs[i]
                datasets.setdefault(i, []).append(group.create_dataset(name, shape=tuple(shape), dtype=np.dtype(dtype)))
        written = set()
        for i, value in weights:
            value = np.asarray(value)
            for ds in datasets[i]:
                if value.shape != ds.shape:
                    raise ValueError(f"weight {i} has shape {value.shape}, its layout {ds.shape}")
                if value.size:
                    ds.write_direct(np.ascontiguousarray(value, dtype=ds.dtype))
            written.add(i)
        if written != set(datasets):
            raise ValueError(f"weights {sorted(set(datasets) - written)} were never written")


def _mappable(ds) -> bool:
    """Whether a dataset's values lie in its file as one run of plain bytes: stored contiguous
    (``Keras``' and ``write``'s datasets are), unfiltered, at least ``MAP_BYTES``."""
    return (ds.chunks is None and not ds.dtype.hasobject and ds.dtype.fields is None and ds.nbytes >= MAP_BYTES
            and ds.id.get_offset() is not None)


def _mapped(path: str, ds) -> np.ndarray:
    """A large weight as a read-only memory map of the file's bytes: a restore sends it on from the
    page cache instead of a private copy (as ``state_file`` maps the optimizer state)."""
    return np.memmap(path, ds.dtype, mode="r", offset=ds.id.get_offset(), shape=ds.shape).view(np.ndarray)


class Weights:
    """The weights of a ``.weights.h5`` by model weight index, read through ``layout``'s entries:
    ``weights[i]`` is an array-like with ``shape`` and ``dtype`` read when indexed (``[()]``): a
    read-only memory map of the file for a large contiguous dataset, else the h5py dataset.
    Use as a context manager (closes the file)."""

    def __init__(self, path: str, entries: list, specs: list):
        import h5py

        self._file = h5py.File(path, "r")
        self._datasets, self.problems = {}, []
        for where, _, items in entries:
            for name, i in ((n, i) for n, i in items if isinstance(i, int)):
                at = f"{where}/vars/{name}" if where else f"vars/{name}"
                ds = self._file.get(at)
                shape = tuple(specs[i][0])
                if not isinstance(ds, h5py.Dataset):
                    self.problems.append(f"the weights file has no {at} (model weight {i}, shape {shape})")
                elif tuple(ds.shape) != shape:
                    self.problems.append(f"the weights file's {at} has shape {tuple(ds.shape)}, "
                                         f"model weight {i} {shape}")
                else:
                    self._datasets[i] = ds

    def __len__(self) -> int:
        return len(self._datasets)

    def __getitem__(self, i: int):
        ds = self._datasets[i]
        return _mapped(self._file.filename, ds) if _mappable(ds) else ds

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
