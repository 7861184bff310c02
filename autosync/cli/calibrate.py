"""``autosync calibrate``: measure a cluster's all-reduce time per message size and a PS round
trip, and write the cluster spec with them (its ``calibration:`` section).

    autosync calibrate --cluster C [--out FILE] [--reps N] [--backend B]

The tuner's analytic model then reads all-reduce costs off the measured curve for that cluster.
"""
from __future__ import annotations

import sys

from autosync.sources import CLUSTER_FORMS
from strategy_space.errors import ConfigError
from strategy_space.strategy import BACKENDS, IN_GRAPH_BACKENDS

# calibration calls the collectives from numpy: every backend but those run inside a training step
CALIBRATION_BACKENDS = tuple(b for b in BACKENDS if b not in IN_GRAPH_BACKENDS)


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="measure a cluster's collective and PS costs; write them into its spec",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True, help=f"cluster: {CLUSTER_FORMS}")
    p.add_argument("--out", help="write the calibrated cluster spec here (default: print it)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per message size (default %(default)s)")
    p.add_argument("--backend", default="auto", help=f"collective backend: {', '.join(CALIBRATION_BACKENDS)} "
                                                     "(default %(default)s: as training resolves it)")
    p.set_defaults(func=run)


def run(args) -> int:
    from autosync.calibrate import calibrate, summary
    from autosync.cli.paths import check_output_file
    from autosync.cli.raylog import ray_output_to_log
    from autosync.sources import load_cluster
    from strategy_space import dumps, save

    if args.backend not in CALIBRATION_BACKENDS:
        raise ConfigError(f"--backend {args.backend!r} is not one of {', '.join(CALIBRATION_BACKENDS)}")
    check_output_file(args.out, "--out")
    cluster = load_cluster(args.cluster)
    with ray_output_to_log("calibrate"):
        cluster = calibrate(cluster, reps=args.reps, backend=args.backend)
    print(summary(cluster.name, cluster.calibration), file=sys.stderr)
    if args.out:
        save(cluster, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(dumps(cluster), end="")
    return 0
