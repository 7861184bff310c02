"""Commands that need no Ray: ``builders``, ``build``, ``validate``, ``show``."""
from __future__ import annotations

import argparse
import sys
from collections import Counter

from autosync.cli.paths import check_output_file
from autosync.formatting import describe_strategy, human_bytes, table
from autosync.sources import CLUSTER_FORMS, MODEL_FORMS, load_cluster, load_model_spec
from strategy_space import AllReduce, validate
from strategy_space.builders import BUILDERS, builder_options, get_builder
from strategy_space.errors import ConfigError
from strategy_space.memory import memory_floor
from strategy_space.yaml_io import dumps, load_strategy, save


def add_model_cluster(p: argparse.ArgumentParser, model_required: bool = True, cluster_required: bool = True) -> None:
    """The ``--model`` and ``--cluster`` flags every command shares."""
    p.add_argument("--model", required=model_required, metavar="M", help=f"model: {MODEL_FORMS}")
    p.add_argument("--cluster", required=cluster_required, metavar="C", help=f"cluster: {CLUSTER_FORMS}")


def _parse_options(items: list[str]) -> dict:
    """``key=value`` pairs; values are read as YAML scalars (ints, bools, strings), through the
    same bounded loader as every YAML file."""
    from strategy_space.errors import short_repr
    from strategy_space.yaml_io import parse_text

    opts = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option {short_repr(item)} must look like key=value, e.g. chunk_bytes=4194304")
        opts[key] = parse_text(value, f"--option {short_repr(key)}")
    return opts


def cmd_builders(args) -> int:
    rows = [(name, cls.description, ", ".join(builder_options(name))) for name, cls in BUILDERS.items()]
    print(table(["builder", "what it does", "options (--option key=value)"], rows))
    return 0


def cmd_build(args) -> int:
    check_output_file(args.out, "--out")
    # the builder, its options and the cluster are checked before the model is built (seconds)
    builder = get_builder(args.builder, **_parse_options(args.option))
    cluster = load_cluster(args.cluster)
    model = load_model_spec(args.model)
    strategy = builder.build(model, cluster)
    validate(strategy, model, cluster)
    if args.out:
        save(strategy, args.out)
        print(f"wrote {args.builder} strategy for {model.name} on {cluster.name} to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(dumps(strategy))
    return 0


def _strategy_file(args) -> str:
    """The strategy YAML of ``validate`` and ``show``: given as FILE, or as ``--strategy FILE`` as
    ``run`` and ``probe`` take it.

    Raises:
        ConfigError: neither, or both.
    """
    if (args.file is None) == (args.strategy_file is None):
        raise ConfigError(f"give the strategy YAML file once: autosync {args.command} FILE (or --strategy FILE)"
                          + (f", not both {args.file} and --strategy {args.strategy_file}" if args.file else ""))
    return args.strategy_file if args.file is None else args.file


def cmd_validate(args) -> int:
    path = _strategy_file(args)
    strategy = load_strategy(path)
    model = load_model_spec(args.model)
    cluster = load_cluster(args.cluster)
    try:
        validate(strategy, model, cluster)
    except ConfigError as e:
        raise e.with_source(path) from None
    nodes, replicas = len(cluster.nodes), len(strategy.resolved_replicas(cluster))
    print(f"{path}: valid for model {model.name} ({len(model.variables)} variables) on cluster "
          f"{cluster.name} ({nodes} node{'s' * (nodes != 1)}, {replicas} replica{'s' * (replicas != 1)})")
    return 0


def cmd_show(args) -> int:
    path = _strategy_file(args)
    strategy = load_strategy(path)
    model = load_model_spec(args.model) if args.model else None
    cluster = load_cluster(args.cluster) if args.cluster else None
    if model is not None and cluster is not None:
        validate(strategy, model, cluster)
    rows, ps_bytes, group_bytes = describe_strategy(strategy, model)
    print(f"strategy {path}" + (f" ({strategy.origin})" if strategy.origin else "")
          + (f" for model {model.name}" if model else ""))
    print(table(["variable", "size", "grad", "sync", "shards", "destination/group", "compressor", "ps options"],
                rows, right=(1, 4)))
    n_ps = sum(1 for r in rows if "PS" in r[3])
    print(f"\n{len(rows)} variables: {n_ps} on parameter servers, {len(rows) - n_ps} all-reduced")
    if model is None:
        print("(give --model for sizes and the bytes per node)")
        return 0
    if ps_bytes:
        print("\nbytes per parameter-server node per worker step (push; pull is the same):")
        print(table(["node", "bytes", "share"], [(n, human_bytes(b), f"{b / sum(ps_bytes.values()):.0%}")
                                                 for n, b in sorted(ps_bytes.items())], right=(1, 2)))
    if group_bytes:
        print("\nall-reduce fusion groups:")
        members = Counter(g for c in strategy.variables
                          for g in {s.group for s in c.synchronizers if isinstance(s, AllReduce)})
        print(table(["group", "bytes", "variables"],
                    [(f"g{g}", human_bytes(b), members[g]) for g, b in sorted(group_bytes.items())], right=(1, 2)))
    if cluster is not None:
        print("\nmemory per node, at least (every worker holds the whole model; strategy_space/memory.py):")
        print(table(["node", "host", "node's memory", "each GPU", "GPU's memory"],
                    [(f.node, human_bytes(f.host_bytes), _gib(n.memory_gib),
                      human_bytes(f.gpu_bytes) if f.gpu_workers else "-", _gib(n.gpu_memory_gib))
                     for f, n in zip(memory_floor(strategy, model, cluster), cluster.nodes)], right=(1, 2, 3, 4)))
    return 0


def _gib(value: float | None) -> str:
    return "not given" if value is None else f"{value:.3g} GiB"


def _add_file(p) -> None:
    p.add_argument("file", nargs="?", help="strategy YAML file")
    p.add_argument("--strategy", dest="strategy_file", metavar="FILE", help="the strategy YAML file, as run takes it "
                   "(instead of FILE)")


def register(sub) -> None:
    p = sub.add_parser("builders", help="list the baseline strategy builders")
    p.set_defaults(func=cmd_builders)

    p = sub.add_parser("build", help="build a baseline strategy as YAML")
    p.add_argument("--builder", required=True, help=f"one of: {', '.join(BUILDERS)}")
    add_model_cluster(p)
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help="builder option (repeatable)")
    p.add_argument("--out", help="write the YAML here instead of stdout")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("validate", help="check a strategy YAML against a model and a cluster")
    _add_file(p)
    add_model_cluster(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("show", help="print a strategy as a readable table")
    _add_file(p)
    add_model_cluster(p, model_required=False, cluster_required=False)
    p.set_defaults(func=cmd_show)
