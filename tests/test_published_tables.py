"""Issue 27: the published tables load and build, and the leave-one-table-out judgement never lets
a fitted quantity see the table it scores."""
from __future__ import annotations

import glob
import importlib
import json
import os
import shutil
import sys

import numpy as np
import pytest

from strategy_space import ConfigError, validate
from tests.conftest import REPO
from tuner.features.alpha_beta import AlphaBeta

BENCH = os.path.join(REPO, "benchmarks")
TABLES = sorted(glob.glob(os.path.join(BENCH, "published", "*.yaml")))


def _module(name: str):
    """A module of ``benchmarks/`` (not a package: its scripts import each other by name)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return importlib.import_module(name)


P = _module("_published")


@pytest.fixture(scope="module")
def loaded():
    return {os.path.basename(p): P.load_table(p) for p in TABLES}


def test_the_issue_counts_of_tables_and_sources(loaded):
    assert len(loaded) >= 10
    pairs = 0
    for t in loaded.values():
        pairs += P.order_and_errors(t["published"], t["published"], t["names"].index(t["reference"]))[0]
    assert pairs >= 40


@pytest.mark.parametrize("path", TABLES, ids=os.path.basename)
def test_every_table_quotes_its_source_and_every_strategy_builds_and_validates(path, loaded):
    t = loaded[os.path.basename(path)]
    for key in ("citation", "where", "quote", "notes"):
        assert t["source"][key].strip(), f"{path}: empty source.{key}"
    assert t["model"].profile.step_time_s > 0
    assert t["published"][t["names"].index(t["reference"])] == 1.0, "the reference is published as 1.0"
    assert len(t["names"]) >= 2
    for name, strategy in zip(t["names"], t["strategies"]):
        if strategy is not None:
            validate(strategy, t["model"], t["cluster"])


def test_a_table_with_an_empty_quote_or_an_unknown_key_is_refused(tmp_path):
    text = open(os.path.join(BENCH, "published", "parallax_eurosys19_image.yaml")).read()
    model = os.path.join(REPO, "configs", "models", "resnet50.yaml")
    text = text.replace("../../configs/models/resnet50.yaml", model)
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("  quote: >-", "  quote: ''\n  unused: >-"))
    with pytest.raises(ConfigError, match="source must have non-empty"):
        P.load_table(str(bad))
    bad.write_text(text.replace("  published: 1.53", "  published: 1.53\n  extra: 1"))
    with pytest.raises(ConfigError, match="a strategy needs exactly"):
        P.load_table(str(bad))


@pytest.mark.parametrize("change, said", [
    (lambda t: t + "strategies: [1, 2\n", "not valid YAML"),
    (lambda t: t.replace("step_time_s:", "step_time_s: fast\n  was:"), "a field is missing or of the wrong kind "
                                                                       "(ValueError: could not convert string"),
])
def test_the_script_says_what_is_wrong_with_a_table_and_exits_2(tmp_path, capsys, change, said):
    text = open(os.path.join(BENCH, "published", "parallax_eurosys19_image.yaml")).read()
    text = text.replace("../../configs/models/resnet50.yaml", os.path.join(REPO, "configs", "models", "resnet50.yaml"))
    (tmp_path / "bad.yaml").write_text(change(text))
    assert _module("published_tables").main(["--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"published_tables.py: error: {tmp_path / 'bad.yaml'}") and said in err


def test_pairs_closer_than_the_gap_are_excluded_and_a_predicted_tie_is_a_miss():
    published = np.array([1.0, 1.03, 1.5])
    pairs, agree, errors = P.order_and_errors(np.array([1.0, 1.0, 1.2]), published, ref=0)
    assert pairs == 2                      # (1.0, 1.03) is within 5 %
    assert agree == 2
    pairs, agree, _ = P.order_and_errors(np.array([1.0, 1.2, 1.2]), published, ref=0)
    assert (pairs, agree) == (2, 1)        # 1.03 vs 1.5 predicted tied: a miss
    np.testing.assert_allclose(errors, [1.0 / 1.03 - 1, 1.2 / 1.5 - 1])


def test_leave_one_out_never_shows_the_held_out_table_to_the_fit():
    tables = [{"id": i} for i in range(5)]
    seen = []

    def fit(train):
        seen.append({t["id"] for t in train})
        return frozenset(t["id"] for t in train)

    def score_one(held_out, fitted):
        assert held_out["id"] not in fitted
        return {"id": held_out["id"]}

    out = P.leave_one_out(tables, fit, score_one)
    assert [r["id"] for r in out] == list(range(5))
    assert seen == [set(range(5)) - {i} for i in range(5)]
    assert all(r["fitted"] == frozenset(set(range(5)) - {r["id"]}) for r in out)


def _fake_terms(i: int, published_rel: list[float], wire_s: float) -> "P.TableTerms":
    """A two-strategy table: compute alone (reference) and one strategy whose step time is compute
    plus a fully exposed wire time (no latency or CPU terms)."""
    zeros = np.zeros(1)
    terms = {n: zeros.copy() for n in ("wire_s", "ps_latency_rounds", "ring_steps", "ring_steps_objectstore",
                                      "ps_share", "stale_factor", "cpu_bytes_max", "ps_calls_max", "cpu_contention",
                                      "ar_curve_s", "psgd_matrices", "nccl_ring_steps")}
    terms.update(compute_s=np.array([1.0]), wire_s=np.array([wire_s]), exposed_frac=np.ones(1), stale_factor=np.ones(1))
    return P.TableTerms(f"fake{i}", ["compute_only", "synced"], 0, np.array(published_rel), 1.0,
                        np.array([1]), terms)


def test_the_fitted_parameters_of_a_fold_come_from_the_other_tables_only():
    # tables consistent with a 0.5 bandwidth efficiency, and one wildly off: the fold that holds
    # it out must fit the consistent ones exactly as a fit on them alone does
    good = [_fake_terms(i, [1.0, 1.0 + w / 0.5], w) for i, w in enumerate((0.2, 0.5, 1.0))]
    wild = _fake_terms(9, [1.0, 40.0], 0.3)
    tables = good + [wild]
    out = P.leave_one_out(tables, P.fit_params, lambda tt, p: P.score(tt, p))
    alone = P.fit_params(good)
    assert out[3]["fitted"] == alone
    assert out[0]["fitted"] != alone       # folds that train on the wild table differ
    # relative times pin compute_scale / efficiency, not each (the ridge splits them): the fit
    # reproduces the consistent tables, and the wild one pulls the all-table fit away from them
    assert all(abs(P.score(t, alone)["ratio_errors"][0]) < 0.1 for t in good)
    assert max(abs(P.score(t, P.fit_params(tables))["ratio_errors"][0]) for t in good) > 0.3
    assert out[3]["pairs"] == 1 and out[3]["pairs_agreeing"] == 1


def test_the_inner_choice_sees_only_the_training_tables_and_picks_the_least_error():
    """Of two fits, the one whose leave-one-out within the training tables errs less is chosen
    and refitted on all of them; the held-out table of an outer fold never reaches either."""
    tables = [{"id": i, "err": e} for i, e in enumerate((0.1, 0.3, 0.2))]
    seen = []

    def fit_to(bias):
        def fit(train):
            seen.append({t["id"] for t in train})
            return bias
        return fit

    def score_one(held_out, bias):      # error = the table's own plus the fit's bias
        return {"pairs": 1, "pairs_agreeing": 1, "ratio_errors": [held_out["err"] + bias]}

    label, fitted, inner = P.select_by_inner_loo(tables[:2], {"loose": fit_to(0.5), "tight": fit_to(0.0)}, score_one)
    assert label == "tight" and fitted == 0.0
    assert inner == pytest.approx({"loose": 0.7, "tight": 0.2})   # medians of (0.6, 0.8) and (0.1, 0.3)
    assert all(2 not in s for s in seen)
    # equal errors: the later (more regularized) one
    assert P.select_by_inner_loo(tables, {"a": fit_to(0.0), "b": fit_to(0.0)}, score_one)[0] == "b"


def test_fit_params_selected_keeps_the_defaults_when_fitting_does_not_transfer():
    # every table says something different about the same parameter: fitting some tables
    # predicts the held-out one worse than the defaults do, so the strongest ridge wins
    tables = [_fake_terms(i, [1.0, r], 0.5) for i, r in enumerate((1.3, 4.0, 1.6, 6.0))]
    chosen = P.fit_params_selected(tables)
    assert chosen.ridge == max(P.RIDGES) and set(chosen.inner_errors) == set(P.RIDGES)
    consistent = [_fake_terms(i, [1.0, 1.0 + w / 0.5], w) for i, w in enumerate((0.2, 0.5, 1.0, 0.7))]
    assert P.fit_params_selected(consistent).ridge < max(P.RIDGES)   # here the fit transfers


def test_fit_params_with_no_tables_keeps_the_prior():
    assert P.fit_params([]) == AlphaBeta()


def test_the_cli_writes_leave_one_out_results_with_their_run(tmp_path):
    cli = _module("published_tables")
    for name in ("parallax_eurosys19_image.yaml", "byteps_issue29_2x1v100_resnet50.yaml",
                 "tf_benchmarks_gce_8k80_resnet50.yaml"):
        text = open(os.path.join(BENCH, "published", name)).read()
        (tmp_path / name).write_text(text.replace("../../configs/", os.path.join(REPO, "configs") + "/"))
    out = tmp_path / "loo.json"
    assert cli.main(["--dir", str(tmp_path), "--leave-one-out", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["commit"] and data["run_started"] and data["mode"] == "leave_one_out"
    assert len(data["tables"]) == 3 and data["leave_one_out"]["tables"] == 3
    assert {"leave_one_out", "untouched"} <= set(data["tables"][0])
    fixed = tmp_path / "fixed.json"
    assert cli.main(["--dir", str(tmp_path), "--leave-one-out", "--ridge", "0.1", "--json", str(fixed)]) == 0
    assert {t["leave_one_out"]["ridge"] for t in json.loads(fixed.read_text())["tables"]} == {0.1}
    assert cli.main(["--dir", str(tmp_path), "--leave-one-out", "--ridge", "-1"]) == 2
    default = tmp_path / "default.json"
    assert cli.main(["--dir", str(tmp_path), "--json", str(default)]) == 0
    assert json.loads(default.read_text())["started"]
    shutil.rmtree(tmp_path)


def test_sparse_rows_per_step_overrides_the_model_and_names_only_sparse_variables(loaded, tmp_path):
    t = loaded["nvidia_dle_ncf_dgx1_8v100.yaml"]
    rows = {v.name: v.rows_per_step for v in t["model"].variables if v.sparse}
    assert rows["mlp_user_embedding/embeddings"] == 84740 and rows["gmf_item_embedding/embeddings"] == 26545
    text = open(os.path.join(BENCH, "published", "nvidia_dle_ncf_dgx1_8v100.yaml")).read()
    text = text.replace("../../configs/", os.path.join(REPO, "configs") + "/")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("  gmf_item_embedding/embeddings: 26545", "  mlp_dense1/kernel: 3"))
    with pytest.raises(ConfigError, match="not sparse variables"):
        P.load_table(str(bad))
