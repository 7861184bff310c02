"""Measuring every baseline builder once (``autosync baselines``).

Builders that produce the same strategy share one trial, as in ``tune``: measuring it twice would
report the noise between two runs of one strategy as a difference between builders. A baseline
whose trial fails is measured once more before it is dropped from the comparison (a failure can
be a passing fault, a killed actor, a busy node); one that timed out is not (a strategy too slow for
the trial limit would spend another whole limit on the same answer).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from strategy_space import ConfigError, Strategy
from strategy_space.builders import BUILDERS, get_builder

from tuner.records.trial import Runner, Trial


@dataclass
class BaselineRun:
    """One builder's result.

    Attributes:
        builder: the builder's name.
        strategy: what it built.
        trial: its measurement (shared with ``same_as``'s), None when not supported.
        same_as: the builder whose identical strategy was measured for this one (None: itself).
        attempts: how many times the strategy was run (2: the first run failed; a time-out is not rerun).
        first_error: the first run's error when it was retried.
        unsupported: why the runtime cannot run the strategy (then nothing was run).
    """

    builder: str
    strategy: Strategy
    trial: Trial | None = None
    same_as: str | None = None
    attempts: int = 0
    first_error: str = ""
    unsupported: str = ""
    aliases: list[str] = field(default_factory=list)


def strategy_key(strategy: Strategy) -> str:
    """Builders whose strategies have equal keys share a trial: the canonical strategy's fingerprint
    (fusion-group numbering and the origin do not count)."""
    return strategy.canonical().fingerprint


def measure_baselines(runner: Runner, names: Sequence[str] | None = None, *,
                      check: Callable[[Strategy], None] | None = None, retries: int = 1,
                      on_result: Callable[[BaselineRun], None] | None = None) -> list[BaselineRun]:
    """Build and measure each baseline (every registered builder by default).

    Args:
        runner: runs the strategies.
        names: builders, in order.
        check: raises ConfigError for a strategy the runtime cannot run (it is then reported, not run).
        retries: extra runs of a failed strategy (not of one that timed out).
        on_result: called after each builder (progress).
    """
    out: list[BaselineRun] = []
    first: dict[str, BaselineRun] = {}
    for name in names or list(BUILDERS):
        strategy = get_builder(name).build(runner.model, runner.cluster)
        run = BaselineRun(name, strategy)
        key = strategy_key(strategy)
        if key in first:
            owner = first[key]
            run.same_as, run.trial, run.unsupported = owner.builder, owner.trial, owner.unsupported
            owner.aliases.append(name)
        else:
            first[key] = run
            try:
                if check is not None:
                    check(strategy)
            except ConfigError as e:
                run.unsupported = str(e)
            else:
                for attempt in range(1 + retries):
                    [run.trial] = runner.run([strategy], [name])
                    run.attempts = attempt + 1
                    if not run.trial.worth_another_run:
                        break
                    run.first_error = run.first_error or run.trial.error
                if run.trial.ok:
                    run.first_error = run.first_error if run.attempts > 1 else ""
        out.append(run)
        if on_result:
            on_result(run)
    return out
