"""Engines: what a service uses to run model functions (`generate`, `logprobs`, `train_step`,
`load_state`, `export_state`). `Engine` is the protocol; `TorchEngine` the torch implementation."""

from plexrl.engines.base import Engine, GenerationOutput

__all__ = ["Engine", "GenerationOutput"]
