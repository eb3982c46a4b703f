"""Engine backends: how an engine server process is started, by `rollout.backend` type.

`cpu`    asyncrl's built-in engine (`python -m rollout.server`), any machine.
`sglang` a real SGLang server (`python -m sglang.launch_server`) with the DSA flags of engine.md (GPU).

Both are driven afterwards through the same SGLang-native HTTP API (asyncrl.engine_client), so the
actor, gateway and trainer never branch on the backend. New backends register in `BACKENDS`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from asyncrl.config import ENGINE_API_KEY_ENV, RolloutConfig
from asyncrl.plugins import load_plugin
from asyncrl.process import spawn


@dataclass
class LaunchSpec:
    model_path: str
    host: str
    port: int
    weight_version: str
    log_path: Path
    tokenizer_path: Optional[str] = None
    seed: int = 0


class EngineBackend(ABC):
    def __init__(self, cfg: RolloutConfig) -> None:
        self.cfg = cfg

    def common_flags(self) -> list[str]:
        """Flags both servers spell the same way (the CPU engine mirrors SGLang's)."""
        flags = ["--incremental-streaming-output"] if self.cfg.incremental_streaming_output else []
        flags += ["--enable-return-routed-experts"] if self.cfg.routing_replay else []
        return flags + (self._speculative_flags() if self.cfg.speculative else [])

    def _speculative_flags(self) -> list[str]:
        """SGLang's MTP recipe (EAGLE with the checkpoint's own MTP layer, a chain: top-k 1, steps + 1 tokens)."""
        steps = self.cfg.speculative_num_steps
        return ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(steps),
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(steps + 1)]

    @abstractmethod
    def command(self, spec: LaunchSpec) -> list[str]:
        """argv of the server process."""

    def environment(self) -> dict[str, str]:
        return {}

    def check_available(self) -> None:
        """Raise a clear error when this backend cannot run here."""

    def launch(self, spec: LaunchSpec) -> subprocess.Popen:
        """Start the server; it dies with the launching process (asyncrl.process)."""
        self.check_available()
        return spawn(self.command(spec), spec.log_path, self.environment())


class CpuBackend(EngineBackend):
    def command(self, spec: LaunchSpec) -> list[str]:
        cfg = self.cfg
        argv = [sys.executable, "-m", "rollout.server", "--model", spec.model_path, "--host", spec.host,
                "--port", str(spec.port), "--weight-version", spec.weight_version,
                "--max-running-requests", str(cfg.max_running_requests),
                "--max-total-tokens", str(cfg.max_total_tokens),
                "--chunked-prefill-size", str(cfg.chunked_prefill_size),
                "--num-threads", str(max(1, int(cfg.num_cpus_per_engine))), "--random-seed", str(spec.seed)]
        if spec.tokenizer_path:
            argv += ["--tokenizer", spec.tokenizer_path]
        return argv + self.common_flags() + list(cfg.cpu_args)

    def environment(self) -> dict[str, str]:
        """The API key goes by environment (the engine's --api-key default), not on the visible command line."""
        return {ENGINE_API_KEY_ENV: self.cfg.api_key} if self.cfg.api_key else {}


class SGLangBackend(EngineBackend):
    """SGLang 0.5.23 for GlmMoeDsaForCausalLM: the `dsa` attention backend with torch top-k.

    `--enable-deterministic-inference` is refused by stock SGLang with the dsa backend (slime patches
    SGLang for it), so asking for it here fails with that explanation instead of a late crash."""

    def check_available(self) -> None:
        if importlib.util.find_spec("sglang") is None:
            raise RuntimeError("rollout.backend=sglang needs SGLang (`pip install -e .[gpu]` on a CUDA machine); "
                               "on CPU machines use rollout.backend=cpu")
        if "--enable-deterministic-inference" in self.cfg.sglang_args and not os.environ.get("ASYNCRL_SGLANG_PATCHED"):
            raise RuntimeError("stock SGLang 0.5.23 refuses --enable-deterministic-inference with the dsa attention "
                               "backend; use a patched SGLang (as slime does) and set ASYNCRL_SGLANG_PATCHED=1, or drop "
                               "the flag (deterministic torch top-k is still used: --dsa-topk-backend torch)")

    def command(self, spec: LaunchSpec) -> list[str]:
        cfg = self.cfg
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", spec.model_path,
                "--host", spec.host, "--port", str(spec.port), "--weight-version", spec.weight_version,
                "--attention-backend", "dsa", "--dsa-prefill-backend", "flashmla_sparse",
                "--dsa-decode-backend", "flashmla_kv", "--dsa-topk-backend", "torch",
                "--max-running-requests", str(cfg.max_running_requests),
                "--chunked-prefill-size", str(cfg.chunked_prefill_size),
                "--max-total-tokens", str(cfg.max_total_tokens), "--random-seed", str(spec.seed),
                "--trust-remote-code", *self.common_flags(), *self._api_key_flags(), *cfg.sglang_args]

    def _api_key_flags(self) -> list[str]:
        """SGLang reads its API key from the command line only (visible in `ps` on the engine's node)."""
        return ["--api-key", self.cfg.api_key] if self.cfg.api_key else []

    def environment(self) -> dict[str, str]:
        return {"SGLANG_DSA_FUSE_TOPK": "0"}  # the torch top-k path needs the unfused kernel


BACKENDS: dict[str, str] = {"cpu": "rollout.backends:CpuBackend", "sglang": "rollout.backends:SGLangBackend"}
"""`rollout.backend` built-ins -> import path of their EngineBackend (asyncrl/plugins.py)."""


def make_backend(cfg: RolloutConfig) -> EngineBackend:
    """The backend `cfg.backend` names (a built-in or the import path of an EngineBackend)."""
    return load_plugin(BACKENDS, cfg.backend, "rollout.backend")(cfg)

