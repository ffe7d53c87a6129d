"""Recipes: YAML files named after the scheme they describe (see qoqtool.recipe)."""
