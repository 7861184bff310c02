"""Driver run inside host0 to see the testbed's Ray nodes: ``python -m autosync.testbed._probe``.

Connects to ``$RAY_ADDRESS``, waits (bounded) until ``--expect`` nodes are alive, and prints one
JSON line: ``{"alive": [{"address", "resources"}...], "dead": n}``. Exit code 0 when enough nodes
are alive, 3 when the wait timed out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--expect", type=int, default=0, help="wait until this many nodes are alive")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait at most")
    args = ap.parse_args(argv)

    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            nodes = ray.nodes()
            alive = [n for n in nodes if n["Alive"]]
            if len(alive) >= args.expect or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        out = {
            "alive": sorted(({"address": n["NodeManagerAddress"], "resources": n["Resources"]} for n in alive),
                            key=lambda n: [int(x) for x in n["address"].split(".")]),
            "dead": len(nodes) - len(alive),
        }
    finally:
        ray.shutdown()
    print(json.dumps(out))
    return 0 if len(alive) >= args.expect else 3


if __name__ == "__main__":
    sys.exit(main())
