"""Recipes: the chain of stages that makes the shipped models, one folder of TOML files each."""
