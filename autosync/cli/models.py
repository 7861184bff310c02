"""``autosync models`` (the zoo) and ``autosync inspect`` (one model's variables and profile)."""
from __future__ import annotations

import argparse

from autosync.formatting import human_bytes, human_count, table
from autosync.sources import MODEL_FORMS
from strategy_space import ModelSpec
from strategy_space.errors import ConfigError


def variables_table(spec: ModelSpec) -> str:
    """The variables of ``spec`` with a totals line."""
    rows = []
    for v in spec.variables:
        rows.append((v.name, "x".join(map(str, v.shape)) or "scalar", v.dtype, human_count(v.size),
                     human_bytes(v.bytes), "yes" if v.sparse else "", v.rows_per_step if v.sparse else ""))
    sparse = [v for v in spec.variables if v.sparse]
    rows.append(("TOTAL", f"{len(spec.variables)} variables", "", human_count(spec.total_params),
                 human_bytes(spec.total_bytes), f"{len(sparse)} ({spec.sparse_share:.1%} of params)",
                 sum(v.rows_per_step or 0 for v in sparse) or ""))
    return table(("variable", "shape", "dtype", "size", "bytes", "sparse", "rows/step"), rows, right=(3, 4, 6))


def cmd_models(args) -> int:
    from autosync.models import ingest, zoo

    rows = []
    for info in zoo.list_models():
        size = args.size or info.default
        if size not in info.sizes:
            raise ConfigError(f"--size {size!r} is not a size of {info.name}; sizes: {', '.join(info.sizes)}")
        line = [info.name, size, info.description]
        if not args.no_build:
            model_def = zoo.get_model_def(f"{info.name}?size={size}")
            spec = ingest.model_spec_from_def(model_def)
            line[2:2] = [human_count(spec.total_params), f"{spec.sparse_share:.1%}", model_def.batch_size]
        rows.append(line)
    headers = ["model", "size"] + ([] if args.no_build else ["params", "sparse", "batch"]) + ["description"]
    print(table(headers, rows, right=() if args.no_build else (2, 3, 4)))
    print("\nuse as --model zoo:NAME (small, the default) or zoo:NAME?size=full; full sizes:")
    for info in zoo.list_models():
        print(f"  {info.name}: {info.full_size_note}")
    return 0


def cmd_inspect(args) -> int:
    import sys

    from autosync.sources import is_trainable_source, load_model_def, load_model_spec
    from autosync.cli.paths import check_output_file
    from strategy_space.yaml_io import save

    check_output_file(args.out, "--out")
    model = args.model
    if is_trainable_source(model):
        from autosync.runtime.optimizers import check_model_optimizer

        model = load_model_def(model)
        try:
            check_model_optimizer(model)
        except ConfigError as e:   # inspecting is fine; tune, run and baselines will refuse it
            print(f"autosync inspect: warning: {e}; `autosync tune`, `run` and `baselines` will refuse this model "
                  f"until it is changed", file=sys.stderr)
    spec = load_model_spec(model, profile=args.profile)
    print(f"model {spec.name}: batch size {spec.batch_size} per worker, fingerprint {spec.fingerprint}")
    print(variables_table(spec))
    if spec.optimizer_slots:   # what the memory check counts (strategy_space.memory)
        print(f"optimizer state: {spec.optimizer_slots} array(s) of each variable's size, held with its parameter-server "
              f"shard or by each worker that all-reduces it ({human_bytes(spec.optimizer_slots * spec.total_bytes)} "
              f"for the whole model)")
    if spec.global_clipnorm:   # held steps (ModelSpec.global_clipnorm): what the cost model counts
        print("held steps: the optimizer clips by the global norm or scales the loss dynamically (a LossScaleOptimizer, "
              "as a mixed_float16 model gets): outside the graph every synchronizer holds a step's update until the "
              "norm of all its gradients is known (a round trip; its pushes and pulls do not overlap)")
    if any(v.sparse for v in spec.variables) and is_trainable_source(args.model):
        print_row_reads(args.model, [v.name for v in spec.variables])
    if spec.profile is not None:
        p = spec.profile
        print(f"\ncompute: {p.step_time_s * 1e3:.2f} ms per step (forward+backward, median) on {p.device}")
        if p.ready_order:
            head = ", ".join(p.ready_order[:3])
            print(f"gradients ready first: {head}{' ...' if len(p.ready_order) > 3 else ''}")
    elif args.profile:
        print("\n(no profile: a model-spec YAML without a profile section cannot be measured)")
    if args.out:
        save(spec, args.out)
        print(f"\nwrote {args.out}")
    return 0


def print_row_reads(source: str, names: list[str]) -> None:
    """Which sparse variables parameter servers can serve by rows (lookups known before the
    step) and which are pulled whole every step, with the reason; and in what form their
    gradients are pushed under the model's optimizer (``optimizers.sparse_form``). ``names``: the
    variables' names in the table above (``ModelSpec`` order), which the lines use."""
    import numpy as np
    import tensorflow as tf

    from autosync.models.ingest import user_code, variable_names
    from autosync.runtime.optimizer_config import keras_optimizer_config
    from autosync.runtime.optimizers import sparse_form
    from autosync.runtime.rows import first_gradient, row_reads_of
    from autosync.sources import load_model_def

    model_def = load_model_def(source)
    with user_code(model_def, "building the model a second time to find its row reads"):
        gradient = first_gradient(model_def)
        reads = row_reads_of(model_def, gradient)
    # this second build of the model is named by Keras as a second one (dense_2/kernel where the
    # table, like every worker's only build, says dense/kernel): its variables are named by
    # position as the table names them
    built = variable_names(gradient[1])
    named = dict(zip(built, names)) if len(built) == len(names) else {}
    whole = reads.full_pull
    print(f"\nparameter-server pulls: {len(reads.outputs)} sparse variable(s) by rows (lookups known before the step)"
          + (f", {len(whole)} whole every step:" if whole else ""))
    for path, why in whole.items():
        print(f"  {named.get(path, path)}: whole table, because {why}")
    try:
        config = keras_optimizer_config(model_def.optimizer_fn())
    except Exception:  # noqa: BLE001 - the optimizer check above has already warned
        return
    form = sparse_form(config)
    print(f"parameter-server pushes: {_PUSH_FORMS[form].format(config.get('class'))}")
    if form == "slices":
        for name, g in zip(built, gradient[2]):
            if isinstance(g, tf.IndexedSlices):
                slices, rows = len(g.indices), len(np.unique(g.indices.numpy()))
                print(f"  {named.get(name, name)}: {slices} slices for {rows} rows in the first batch ({slices / max(rows, 1):.2f}x "
                      f"the values of its rows)")


# what a worker pushes of a sparse gradient, by ``optimizers.sparse_form``
_PUSH_FORMS = {
    "rows": "a sparse gradient's repeated rows summed by each worker (the optimizer's rule updates alike)",
    "slices": "every slice of a sparse gradient as the tape made it, repeated rows not summed: the optimizer "
              "({}) transforms each slice before repeated rows add up, as Keras applies IndexedSlices",
    "dense": "a sparse gradient's rows summed over every worker (the optimizer's global_clipnorm or gradient "
             "accumulation hands its rule a dense gradient, as Keras does)",
}


def register(sub) -> None:
    p = sub.add_parser("models", help="list the built-in model zoo with parameter counts and sparse share")
    p.add_argument("--size", choices=("small", "full"), default=None,
                   help="variant to describe (default: each model's default, small); full builds large models")
    p.add_argument("--no-build", action="store_true", help="list names and descriptions only, without building models")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("inspect", help="print a model's variables (sparse or dense, rows per step) and profile",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=f"MODEL is {MODEL_FORMS}.")
    p.add_argument("--model", required=True, metavar="MODEL", help="the model source")
    p.add_argument("--profile", action="store_true", help="also measure forward+backward time per step on this machine")
    p.add_argument("--out", metavar="PATH", help="write the ModelSpec as YAML (load it back with --model PATH)")
    p.set_defaults(func=cmd_inspect)
