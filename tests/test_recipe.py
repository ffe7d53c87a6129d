"""Recipes as users write them: every bundled one reads back as it was saved, and a recipe
that names something wrongly is one UserError naming the key, before any work."""

import pytest

from qoqtool.errors import UserError
from qoqtool.recipe import known_recipes, load_recipe, recipe_from_dict

WEIGHTS = {"bits": 4, "scheme": "progressive", "group_size": 128}


@pytest.mark.parametrize("name", known_recipes())
def test_a_bundled_recipe_reads_back_from_what_a_manifest_saves(name):
    recipe = load_recipe(name)
    again = recipe_from_dict(recipe.to_dict())
    assert again.to_dict() == recipe.to_dict()


@pytest.mark.parametrize("change, words", [
    ({"bogus_top": 1}, "unknown key(s) bogus_top; known: name, description, weights"),
    ({"weights": "int4"}, "weights is a mapping such as {bits: 4"),
    ({"weights": None}, "weights is a mapping"),
    ({"activations": 8}, "activations is a mapping such as {bits: 8}, not 8"),
    ({"activations": {"bits": "eight"}}, "activations.bits is a whole number, not 'eight'"),
    ({"kv_cache": [4]}, "kv_cache is a mapping such as {bits: 4}, not [4]"),
    ({"kv_cache": {"bits": 3}}, "kv_cache.bits must be 4, 8 or 16, not 3"),
    ({"weights": dict(WEIGHTS, group_size="g128")}, "group_size is null (per channel) or a power of two from 32"),
    ({"weights": dict(WEIGHTS, group_size=-5)}, "not -5"),
    ({"weights": dict(WEIGHTS, group_size=96)}, "not 96"),
    ({"weights": dict(WEIGHTS, bits=True)}, "weights.bits is a whole number"),
    ({"steps": {"rotate": {"seed": 7}}}, "steps is a list, one '- name: {params}' item per step"),
    ({"steps": [{"rotate": {}}, {"rotate": {"down_hadamard": True}}]}, "step rotate appears twice"),
    ({"steps": [{"rotate": 7}]}, "step rotate's parameters are a mapping"),
    ({"steps": [{"smooth_output": {"grid": "20"}}]}, "step smooth_output: grid is a whole number, not '20'"),
    ({"steps": [{"smooth_output": {"grid": 0}}]}, "grid must be at least 1, not 0"),
    ({"steps": [{"smooth_output": {"linears": ["up_proj"]}}]}, "linears may name o_proj and down_proj only, not up_proj"),
    ({"steps": [{"reorder": {"linears": "o_proj"}}]}, "linears is a list of names, not 'o_proj'"),
    ({"steps": [{"rotate": {"down_hadamard": "yes"}}]}, "down_hadamard is true or false, not 'yes'"),
    ({"steps": [{"smooth_attention": {"alpha": 1.5}}]}, "alpha must lie in [0, 1], not 1.5"),
    ({"steps": [{"clip": {"steps": 0}}]}, "steps be at least 1"),
    ({"steps": [{"clip": {"min_ratio": 0}}]}, "min_ratio must lie in (0, 1]"),
    ({"steps": [{"gptq": {"block_size": 0}}]}, "block_size at least 1"),
])
def test_a_bad_recipe_is_one_user_error_naming_the_key(change, words):
    with pytest.raises(UserError) as err:
        recipe_from_dict({"name": "bad", "weights": WEIGHTS, **change}, "bad.yaml")
    message = str(err.value)
    assert message.startswith("recipe bad.yaml: ") and words in message and "\n" not in message


def test_parameters_take_their_defaults_type():
    recipe = recipe_from_dict({"name": "ok", "weights": WEIGHTS,
                               "steps": [{"smooth_attention": {"alpha": 1}}, {"reorder": {"linears": ["o_proj"]}}]})
    saved = recipe.to_dict()["steps"]
    assert saved == [{"smooth_attention": {"alpha": 1.0}}, {"reorder": {"linears": ["o_proj"]}}]
    assert isinstance(saved[0]["smooth_attention"]["alpha"], float)
