"""The built-in model zoo: ``zoo:NAME[?size=small|full][&batch_size=N]``.

Every model exists as a full-size variant (the published architecture, for export and for real
clusters) and a small CPU-friendly variant (the default) that keeps what matters for
synchronization: embedding-heavy models stay embedding-heavy, dense-heavy ones stay dense-heavy.
Data is synthetic and generated in-process. The registry names factories by module path, so
listing the zoo imports no TensorFlow, and every factory of a ModelDef is a
``functools.partial`` of a module-level function (picklable for Ray workers).
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field

from strategy_space.errors import ConfigError

from . import batches

SIZES = ("small", "full")
QUERY_KEYS = ("size", "batch_size")


@dataclass(frozen=True)
class Variant:
    """One size of a zoo model.

    Attributes:
        model, loss, optimizer: ``module:function`` under ``autosync.models`` building each part.
        model_kwargs: keyword arguments of the model function.
        data: name of the batch generator in ``autosync.models.batches``.
        data_kwargs: its keyword arguments (``batch_size`` and ``seed`` are added).
        batch_size: default per-worker batch size.
        optimizer_kwargs: keyword arguments of the optimizer function (e.g. a learning rate that
            suits this size).
    """

    model: str
    model_kwargs: dict
    loss: str
    optimizer: str
    data: str
    data_kwargs: dict
    batch_size: int
    optimizer_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ZooModel:
    """A zoo entry as ``list_models`` reports it."""

    name: str
    description: str
    default: str
    sizes: tuple[str, ...]
    full_size_note: str


_VISION = {"loss": "_vision:classification_loss", "optimizer": "_vision:momentum_sgd", "data": "image_batches"}
# VGG (no normalization layers) diverges at the ResNets' 0.1; 0.01 is VGG's published rate
_VGG_SGD = {"learning_rate": 0.01}
# and without them its loss sits at chance until the class patterns' signal has built up through
# the plain ReLU stack: at the ResNets' pattern strength (batches.PATTERN_SCALE, 0.08) for 90-220
# steps depending on the seed, at 0.12 for about two thirds of that
_VGG_IMAGES = {"pattern_scale": 0.12}
_SMALL_TABLES = tuple(min(n, 20_000) for n in batches.CRITEO_KAGGLE_TABLES)

_ENTRIES: dict[str, tuple[str, str, dict[str, Variant]]] = {
    "resnet50": (
        "ResNet-50 image classifier (dense convolutions, no embeddings)",
        "keras.applications.ResNet50, 224x224, 1000 classes, 25.6M parameters",
        {
            "full": Variant(model="_vision:resnet50_full", model_kwargs={"classes": 1000},
                            data_kwargs={"image_size": 224, "classes": 1000}, batch_size=32, **_VISION),
            "small": Variant(model="_vision:resnet_small", model_kwargs={"classes": 10},
                             data_kwargs={"image_size": 32, "classes": 10}, batch_size=32, **_VISION),
        },
    ),
    "vgg16": (
        "VGG-16 image classifier (most parameters in two wide dense layers)",
        "keras.applications.VGG16, 224x224, 1000 classes, 138M parameters",
        {
            "full": Variant(model="_vision:vgg16_full", model_kwargs={"classes": 1000},
                            data_kwargs={"image_size": 224, "classes": 1000, **_VGG_IMAGES}, batch_size=32,
                            optimizer_kwargs=_VGG_SGD, **_VISION),
            "small": Variant(model="_vision:vgg_small", model_kwargs={"classes": 10, "dense_units": 1024},
                             data_kwargs={"image_size": 32, "classes": 10, **_VGG_IMAGES}, batch_size=32,
                             optimizer_kwargs=_VGG_SGD, **_VISION),
        },
    ),
    "bert": (
        "BERT encoder with masked-LM head tied to the token embedding (dense-heavy)",
        "BERT-base: 12 layers x 768, 12 heads, vocab 30522, sequence 128, 110M parameters",
        {
            "full": Variant(model="_text:bert", model_kwargs={"vocab": 30522, "hidden": 768, "layers": 12, "heads": 12,
                                                             "intermediate": 3072, "seq_len": 128},
                            loss="_text:masked_lm_loss", optimizer="_text:adamw", data="masked_lm_batches",
                            data_kwargs={"vocab": 30522, "seq_len": 128}, batch_size=32),
            "small": Variant(model="_text:bert", model_kwargs={"vocab": 8192, "hidden": 128, "layers": 2, "heads": 2,
                                                              "intermediate": 512, "seq_len": 32},
                             loss="_text:masked_lm_loss", optimizer="_text:adamw", data="masked_lm_batches",
                             data_kwargs={"vocab": 8192, "seq_len": 32}, batch_size=16,
                             optimizer_kwargs={"learning_rate": 1e-3}),   # a small BERT takes a larger rate
        },
    ),
    "lm1b": (
        "LSTM language model with sampled softmax: sparse input embedding and softmax weights",
        "LM1B vocabulary (793471 words), embedding 512, LSTM 2048, 8192 sampled classes, 835M parameters",
        {
            "full": Variant(model="_text:lstm_lm", model_kwargs={"vocab": 793471, "embedding_dim": 512, "hidden": 2048,
                                                                "seq_len": 20, "num_sampled": 8192},
                            loss="_text:mean_of_outputs", optimizer="_recsys:adagrad", data="language_model_batches",
                            data_kwargs={"vocab": 793471, "seq_len": 20}, batch_size=128),
            "small": Variant(model="_text:lstm_lm", model_kwargs={"vocab": 50000, "embedding_dim": 64, "hidden": 128,
                                                                 "seq_len": 20, "num_sampled": 512},
                             loss="_text:mean_of_outputs", optimizer="_recsys:adagrad", data="language_model_batches",
                             data_kwargs={"vocab": 50000, "seq_len": 20}, batch_size=32,
                             optimizer_kwargs={"learning_rate": 0.5}),
        },
    ),
    "ncf": (
        "Neural collaborative filtering (NeuMF): large user and item embeddings, small MLP",
        "MovieLens-20M: 138493 users, 26744 items, 64 factors, MLP 256-256-128-64 (MLPerf NCF)",
        {
            "full": Variant(model="_recsys:ncf", model_kwargs={"users": 138493, "items": 26744, "factors": 64,
                                                              "mlp_layers": (256, 256, 128, 64)},
                            loss="_recsys:click_loss", optimizer="_recsys:adam", data="interaction_batches",
                            data_kwargs={"users": 138493, "items": 26744}, batch_size=2048),
            "small": Variant(model="_recsys:ncf", model_kwargs={"users": 6040, "items": 3706, "factors": 16,
                                                               "mlp_layers": (64, 32, 16)},
                             loss="_recsys:click_loss", optimizer="_recsys:adam", data="interaction_batches",
                             data_kwargs={"users": 6040, "items": 3706}, batch_size=256),
        },
    ),
    "dlrm": (
        "DLRM click-through model: 26 embedding tables, bottom/top MLPs, dot interactions",
        "Criteo Kaggle tables (33.8M rows) x 16, bottom MLP 13-512-256-64-16, top 512-256-1, 540M parameters",
        {
            "full": Variant(model="_recsys:dlrm", model_kwargs={"table_sizes": batches.CRITEO_KAGGLE_TABLES, "dim": 16,
                                                               "bottom": (512, 256, 64), "top": (512, 256)},
                            loss="_recsys:click_loss", optimizer="_recsys:adagrad", data="click_log_batches",
                            data_kwargs={"dense_features": batches.CRITEO_DENSE_FEATURES,
                                         "table_sizes": batches.CRITEO_KAGGLE_TABLES}, batch_size=128),
            "small": Variant(model="_recsys:dlrm", model_kwargs={"table_sizes": _SMALL_TABLES, "dim": 8,
                                                                "bottom": (32,), "top": (32,)},
                             loss="_recsys:click_loss", optimizer="_recsys:adagrad", data="click_log_batches",
                             data_kwargs={"dense_features": batches.CRITEO_DENSE_FEATURES,
                                          "table_sizes": _SMALL_TABLES}, batch_size=128),
        },
    ),
}


def list_models() -> list[ZooModel]:
    """Every zoo model with its description, default size and available sizes."""
    return [ZooModel(name=name, description=desc, default="small", sizes=tuple(variants), full_size_note=note)
            for name, (desc, note, variants) in _ENTRIES.items()]


def model_names() -> list[str]:
    return list(_ENTRIES)


def parse_name(name_with_query: str) -> tuple[str, str, int | None]:
    """Split ``NAME?size=S&batch_size=N`` into (name, size, batch size or None).

    Raises:
        ConfigError: unknown name, size or query key, or a malformed query.
    """
    name, _, query = name_with_query.partition("?")
    if name not in _ENTRIES:
        raise ConfigError(f"unknown zoo model {name!r}; valid models: {', '.join(_ENTRIES)} "
                          f"(run 'autosync models' to list them)")
    options: dict[str, str] = {}
    for part in filter(None, query.split("&")):
        key, eq, value = part.partition("=")
        if not eq or not value:
            raise ConfigError(f"zoo:{name_with_query}: query item {part!r} must look like key=value "
                              f"(e.g. zoo:{name}?size=small)")
        if key not in QUERY_KEYS:
            raise ConfigError(f"zoo:{name_with_query}: unknown option {key!r}; allowed options: {', '.join(QUERY_KEYS)}")
        if key in options:
            raise ConfigError(f"zoo:{name_with_query}: option {key!r} is given twice")
        options[key] = value
    size = options.get("size", "small")
    if size not in _ENTRIES[name][2]:
        raise ConfigError(f"zoo:{name_with_query}: unknown size {size!r}; valid sizes of {name}: "
                          f"{', '.join(_ENTRIES[name][2])}")
    batch_size = None
    if "batch_size" in options:
        text = options["batch_size"]
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"zoo:{name_with_query}: batch_size must be a positive integer, got {text!r}")
        batch_size = int(text)
    return name, size, batch_size


def get_model_def(name_with_query: str):
    """The ModelDef of a zoo model, e.g. ``ncf``, ``ncf?size=small``, ``bert?size=full&batch_size=8``.

    Returns:
        autosync.model_def.ModelDef named ``NAME-SIZE`` whose metadata records the zoo source.

    Raises:
        ConfigError: unknown name, size or option (the message lists the valid ones).
    """
    from autosync.model_def import ModelDef

    name, size, batch_size = parse_name(name_with_query)
    description, note, variants = _ENTRIES[name]
    v: Variant = variants[size]
    batch_size = batch_size or v.batch_size
    source = f"zoo:{name}?size={size}" + (f"&batch_size={batch_size}" if batch_size != v.batch_size else "")
    return ModelDef(
        name=f"{name}-{size}",
        model_fn=functools.partial(build_part, v.model, **v.model_kwargs),
        loss_fn=functools.partial(build_part, v.loss),
        optimizer_fn=functools.partial(build_part, v.optimizer, **v.optimizer_kwargs),
        dataset_fn=functools.partial(getattr(batches, v.data), batch_size=batch_size, **v.data_kwargs),
        batch_size=batch_size,
        metadata={"source": source, "zoo": name, "size": size, "description": description,
                  "full_size": note},
    )


def build_part(target: str, **kwargs):
    """Call ``autosync.models.<module>.<function>(**kwargs)`` named by ``module:function``;
    importing on call keeps TensorFlow out of the parent until a model is really built."""
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(f"autosync.models.{module}"), function)(**kwargs)
