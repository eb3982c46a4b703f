"""Trainer backends, keyed by `trainer.backend` (see base.py for the interface)."""
