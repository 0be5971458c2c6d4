"""Offline half of qserve: checkpoint readers, FP8 math, recipes, artifacts."""
