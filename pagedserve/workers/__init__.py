"""Executor and workers: model runner, models, layers, sampler, parallel state."""
