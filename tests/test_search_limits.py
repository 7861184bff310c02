"""autosync.search_limits: what a model's optimizer keeps out of a search (no Ray, no TensorFlow)."""
import pytest

from autosync.search_limits import search_limits
from strategy_space import ConfigError
from tuner.search.constraints import Constraints, Rule


def test_an_optimizer_exact_on_shards_adds_no_pin():
    user = Constraints((Rule(match="a*", shards=3),), staleness=2)
    limits = search_limits({"class": "Adam", "learning_rate": 0.1, "clipvalue": 1.0}, user)
    assert limits.constraints is user and limits.staleness_ok
    assert limits.partition_note == limits.staleness_note == ""
    assert search_limits({}).constraints is None   # a runner with no optimizer to say


@pytest.mark.parametrize("config, why", [
    ({"class": "SGD", "clipnorm": 0.5}, "optimizer option clipnorm=0.5 clips each variable by its own norm"),
    ({"class": "Adafactor"}, "optimizer 'Adafactor' reads whole variables (norms or factors)"),
])
def test_clipnorm_or_a_whole_variable_rule_pins_one_shard_before_the_users_rules(config, why):
    user = Constraints((Rule(match="emb*", sync="ps"),), staleness=1)
    limits = search_limits(config, user)
    first, *rest = limits.constraints.rules
    assert first == Rule(match="*", shards=1) and tuple(rest) == user.rules
    assert limits.constraints.staleness == 1 and limits.staleness_ok
    assert limits.partition_note == f"no variable partitioned: {why}, which shards updated separately cannot do"


def test_a_pin_the_optimizer_makes_the_runtime_refuse_is_said_with_its_fix():
    user = Constraints((Rule(match="emb*", shards=2), Rule(match="d*", shards=1)), staleness=2)
    with pytest.raises(ConfigError) as e:
        search_limits({"class": "SGD", "clipnorm": 1.0, "global_clipnorm": None}, user)
    assert e.value.problems == ["constraint rule match='emb*': pins shards 2, but optimizer option clipnorm=1.0 clips "
                                "each variable by its own norm, which shards updated separately cannot do; pin shards "
                                "1 or leave shards free"]
    with pytest.raises(ConfigError, match=r"pin staleness 2, but the optimizer's global_clipnorm=1.0 needs every "
                                          r"gradient of a step before any update; pin staleness 0"):
        search_limits({"class": "SGD", "global_clipnorm": 1.0}, user)


def test_global_clipnorm_proposes_no_staleness():
    limits = search_limits({"class": "SGD", "global_clipnorm": 1.0}, Constraints(staleness=0))
    assert not limits.staleness_ok and limits.constraints == Constraints(staleness=0)
    assert limits.staleness_note.startswith("staleness and asynchronous PS not proposed: the optimizer's global_clipnorm")
    assert limits.partition_note == ""


def test_a_variable_with_a_constraint_is_pinned_whole_to_the_graph_all_reduce_before_the_users_rules():
    from autosync.runtime.optimizer_config import CONSTRAINED

    config = {"class": "Adam", "learning_rate": 0.1, CONSTRAINED: {"out/kernel": "MaxNorm", "emb[1]/embeddings": "NonNeg"}}
    user = Constraints((Rule(match="emb*", compressor="none"),), staleness=1)
    limits = search_limits(config, user)
    *pins, own = limits.constraints.rules
    assert own == user.rules[0] and limits.constraints.staleness == 1
    assert limits.search_note == ("kept whole on the graph all-reduce, which alone applies their constraints: "
                                  "emb[1]/embeddings, out/kernel") and limits.partition_note == ""
    assert [(p.sync, p.backend, p.shards) for p in pins] == [("all_reduce", "graph", 1)] * 2
    assert [p.selects(n, False) for p in pins for n in ("emb[1]/embeddings", "emb1/embeddings", "out/kernel")] == \
        [True, False, False, False, False, True]   # each pin selects its variable alone, brackets and all
    clash = Constraints((Rule(match="out/*", sync="ps"), Rule(match="*", backend="gloo"), Rule(match="o*", shards=2)))
    with pytest.raises(ConfigError) as e:
        search_limits(config, clash)
    assert len(e.value.problems) == 4
    assert e.value.problems[0] == ("constraint rule match='out/*': pins sync ps on out/kernel, which has a constraint "
                                   "that only the graph all-reduce applies (Keras applies it after each update); leave "
                                   "out/kernel free or pin sync all_reduce, backend graph")
    assert all("pins backend gloo on" in p for p in e.value.problems[1:3]) and "shards 2 on out/kernel" in e.value.problems[3]


def test_a_users_rule_for_sparse_variables_does_not_clash_with_a_dense_constrained_one():
    """``sparse: true, sync: ps`` pins the embeddings, not a constrained dense kernel: no clash
    where the model says which variables are sparse; a constrained embedding it does move."""
    from autosync.runtime.optimizer_config import CONSTRAINED

    config = {"class": "Adam", "learning_rate": 0.1, CONSTRAINED: {"out/kernel": "MaxNorm"}}
    user = Constraints((Rule(match="*", sparse=True, sync="ps"),))
    limits = search_limits(config, user, sparse={"emb/embeddings"})
    assert limits.constraints.rules[-1] == user.rules[0]
    with pytest.raises(ConfigError, match="pins sync ps on out/kernel"):
        search_limits(config, user, sparse={"out/kernel"})
    with pytest.raises(ConfigError, match="pins sync ps on out/kernel"):   # sparsity unknown: taken to select
        search_limits(config, user)
