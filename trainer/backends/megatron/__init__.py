"""The megatron backend (`trainer.backend: megatron`, docs/megatron.md): backend.py is the entry point; importing
this package imports nothing of megatron-core."""
