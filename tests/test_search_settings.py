"""SearchSettings validates its knobs on construction (pure: no Ray, no TensorFlow)."""
import dataclasses
import re

import numpy as np
import pytest

from strategy_space import ConfigError
from tuner.search.model_based import SearchSettings as FromModelBased
from tuner.search.settings import SearchSettings


def test_the_defaults_and_the_tests_settings_are_valid_and_one_class():
    assert FromModelBased is SearchSettings
    SearchSettings()
    SearchSettings(batch=1, candidates=16, chains=4, anneal_steps=0, epsilon=0.0, explore_ratio=None,
                   explore_from_round=1, trust_radius=0, trust_trials=0, seed=np.int64(3))


@pytest.mark.parametrize("field,value,allowed", [
    ("batch", 0, "an integer >= 1"),
    ("batch", 2.0, "an integer >= 1"),
    ("batch", True, "an integer >= 1"),
    ("epsilon", 1.5, "a number from 0 to 1"),
    ("epsilon", float("nan"), "a number from 0 to 1"),
    ("explore_ratio", 0.0, "None or a number > 0"),
    ("explore_ratio", "1.25", "None or a number > 0"),
    ("explore_from_round", 0, "an integer >= 1"),
    ("candidates", -4, "an integer >= 1"),
    ("chains", 0, "an integer >= 1"),
    ("proposals", 0, "an integer >= 1"),
    ("anneal_steps", -1, "an integer >= 0"),
    ("trust_radius", -1, "an integer >= 0"),
    ("trust_accuracy", 1.01, "a number from 0 to 1"),
    ("trust_ratio", 0, "a number > 0"),
    ("trust_ratio", float("inf"), "a number > 0"),
    ("trust_trials", None, "an integer >= 0"),
    ("seed", -1, "an integer >= 0"),
])
def test_a_bad_knob_is_named_with_its_value_and_what_it_may_be(field, value, allowed):
    with pytest.raises(ConfigError, match=re.escape(f"SearchSettings.{field} must be {allowed}, got {value!r}")):
        SearchSettings(**{field: value})


def test_every_bad_knob_is_reported_at_once_and_replace_validates_too():
    with pytest.raises(ConfigError) as e:
        SearchSettings(batch=0, seed=-1, epsilon=2)
    assert len(e.value.problems) == 3
    with pytest.raises(ConfigError, match="chains must be an integer >= 1, got 0"):
        dataclasses.replace(SearchSettings(), chains=0)
