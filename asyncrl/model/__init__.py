"""The GLM-5 (HF `glm_moe_dsa`) model: MoE + MLA + DSA, weight-compatible with transformers.

Modules in reading order: config (hyper-parameters, torch-free) · rope · norm · batch (ForwardBatch,
the one forward input) · kv_cache (token-slot pool) · indexer (DSA top-k) · attention (absorbed MLA,
sparse / dense) · moe (router, batched experts) · layers · model (Glm5ForCausalLM: engine and trainer
entry points) · io (HF safetensors checkpoints). This package file stays torch-free so that loading a
run config does not import torch. See docs/model.md.
"""
