"""Typed configuration of a run: one dataclass per component, composed into `RunConfig`.

Hydra's yaml groups under configs/ mirror these classes one to one. The schemas are registered in
Hydra's ConfigStore, so a misspelt key or a value of the wrong type fails at start with a message
that names the full key (e.g. `Key 'lr_rate' not in 'TrainerConfig'  full_key: trainer.lr_rate`).
Each component reads only its own section.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from dataclasses import Field, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional, TypeVar

from omegaconf import MISSING, DictConfig, OmegaConf

from asyncrl.model.config import ModelConfig
from asyncrl.sampling import is_truncating


@dataclass
class RedisConfig:
    url: Optional[str] = None
    """redis://host:port/db of an existing server; None starts an embedded redis-server."""
    aof: bool = True
    """Embedded server only: persist every write to an append-only file."""
    appendfsync: str = "always"
    """Embedded server only: redis' appendfsync. `always` (the default) fsyncs before each reply, so every
    acknowledged write survives a redis-server crash, which the launcher restarts from the AOF. `everysec`
    may lose the last 1-2 s of acknowledged writes there (it answers a write whose AOF append it postponed
    behind a running fsync): groups, samples or acknowledgements the other components believe written (they
    count and log what they see gone: docs/run.md, Failures).
    Measured (bench/results/redis_fsync.md): a lone writer 0.37 ms a write instead of 0.15 ms; 32 concurrent
    writers 0.078 vs 0.069 ms; during an AOF rewrite p99 0.96 vs 0.22 ms; a 30-step tiny_demo run 63.1 / 64.6 s
    vs 63.8 / 62.0 s (two runs each)."""
    data_dir: Optional[str] = None
    """Embedded server only: where the AOF lives; None = <run_dir>/redis."""
    retention_groups: int = 10_000
    """Consumed groups (and their samples) kept for inspection before they are trimmed."""


@dataclass
class ModelSection:
    arch: ModelConfig = field(default_factory=ModelConfig)
    """Architecture, with exactly the HF config.json field names."""
    path: Optional[str] = None
    """HF-format checkpoint directory (config.json + safetensors); None = random init from `arch`."""
    tokenizer: str = "builtin:tiny"
    """A tokenizer.json path or directory, or `builtin:tiny` (the tokenizer shipped in asyncrl/assets)."""
    dtype: str = "float32"
    """Compute dtype on CPU engines and the torch trainer: float32 or bfloat16."""


@dataclass
class SamplingConfig:
    """Default sampling of rollout turns. Every field reaches the gateway session of each episode (its
    defaults and policy: docs/architecture.md "How a setting travels"); an agent may override the sampling
    fields per request, and the gateway records the temperature of every generated token for the trainer."""

    temperature: float = 1.0
    """Softmax temperature of every generated token (1.0: the model's own distribution)."""
    top_p: float = 1.0
    """Nucleus sampling: probability mass kept (1.0: off; below 1 truncates, see allow_truncation)."""
    top_k: int = -1
    """Sample among the k most likely tokens only (-1 or 0: off; above 0 truncates)."""
    min_p: float = 0.0
    """Drop tokens below min_p x the most likely token's probability (0.0: off; above 0 truncates)."""
    max_new_tokens: int = 256
    """Tokens one model turn may generate at most."""
    allow_truncation: bool = False
    """Accept top_p < 1, top_k > 0, min_p > 0 or min_new_tokens > 0 in RL sessions (config or agent
    request). Off: the run refuses such a config at start and the gateway answers such a request with a
    400 naming the field, because the trained ratios would not match the sampling distribution."""

    def __post_init__(self) -> None:
        truncating = [f"{name}={getattr(self, name)}" for name in ("top_p", "top_k", "min_p")
                      if is_truncating(name, getattr(self, name))]
        if truncating and not self.allow_truncation:
            raise ValueError(f"rollout.sampling {', '.join(truncating)} truncates the distribution the engines "
                             "draw from, but the trainer's ratios use the untruncated one; set "
                             "rollout.sampling.allow_truncation=true to accept that mismatch (docs/trainer.md "
                             "\"Sampling and the ratios\")")


ENGINE_API_KEY_ENV = "ASYNCRL_ENGINE_API_KEY"
"""Where the launcher hands rollout.api_key to the built-in engine and the gateway (their --api-key and
--engine-api-key default), so that it stays off their command lines."""


@dataclass
class RolloutConfig:
    backend: str = "cpu"
    """Plugin (asyncrl/plugins.py): `cpu` (asyncrl's built-in SGLang-compatible engine), `sglang` (a real
    SGLang server, GPU), or the import path of an EngineBackend (`my_pkg.mod:MyBackend`)."""
    num_engines: int = 1
    """Engine servers the run starts (one Ray actor each)."""
    num_cpus_per_engine: float = 1.0
    """Ray CPUs reserved for each engine actor."""
    num_gpus_per_engine: float = 0.0
    """Ray GPUs reserved for each engine actor (0 for the cpu backend)."""
    max_running_requests: int = 128
    """Continuous-batching width: requests decoded together in one step."""
    max_total_tokens: int = 65536
    """KV-cache budget in tokens; beyond it the scheduler retracts requests instead of failing."""
    chunked_prefill_size: int = 512
    """Prompt tokens prefilled per scheduler step (long prompts are split)."""
    routing_replay: bool = False
    """Rollout routing replay (R3): engines record which experts every token was routed to
    (--enable-return-routed-experts), the gateway stores them with each sample, and the trainer's
    forward uses them instead of routing anew, so the experts that produced the rollout's log-probs are
    the ones trained. 2 bytes x layers x top-k per token in Redis (GLM-5: 1.2 KB a token)."""
    incremental_streaming_output: bool = True
    """Engines stream only what is new in each event (SGLang's --incremental-streaming-output), so a long
    streamed turn costs the gateway O(tokens), not O(tokens^2); asyncrl's engine client reads both modes."""
    speculative: bool = False
    """MTP speculative decoding in the engines: the checkpoint's MTP layer drafts speculative_num_steps
    tokens per decode step, one target forward verifies them by rejection sampling, so tokens, log-probs
    and their distribution are the same as without it (docs/engine.md). SGLang's EAGLE flags on both
    backends. Off by default: on CPU it pays only with a well-trained MTP layer (bench/results/speculative.md)."""
    speculative_num_steps: int = 2
    """Drafts per decode step (SGLang's --speculative-num-steps), the one MTP layer reused for each (GLM-5: 2)."""
    health_check_interval_s: float = 10.0
    """Seconds between health checks of each engine process; a failed or dead one is restarted."""
    health_check_timeout_s: float = 30.0
    """Seconds a health check may take before the engine counts as failed (x 10: its start-up)."""
    api_key: Optional[str] = field(default=None, repr=False)
    """Engine API key (SGLang's --api-key): every engine route but /health*, /metrics wants
    `Authorization: Bearer <key>`; the launcher gives it to the engines, the gateway and the trainer."""
    sglang_args: list[str] = field(default_factory=list)
    """Extra command-line flags passed to `python -m sglang.launch_server` (GPU backend)."""
    cpu_args: list[str] = field(default_factory=list)
    """Extra command-line flags passed to `asyncrl engine serve` (CPU backend), e.g. [--stream-interval, 4]."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Default sampling of rollout turns (SamplingConfig)."""


def _check_gc_sweep_s(value: float) -> None:
    if not value >= 0:
        raise ValueError(f"gc_sweep_s must be >= 0 (0: no survivor freezing), got {value}")


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    """Interface the gateway binds (0.0.0.0: every interface)."""
    port: int = 0
    """0 picks a free port (the bound URL is published through Ray/Redis). With replicas > 1, replica i
    binds port + i (0: each a free one)."""
    replicas: int = 1
    """Gateways the launcher starts (`gateway`, `gateway-1`, ...), each a Ray actor placed by
    cluster.placement.gateway (a custom resource one unit of which each gateway node offers puts one on each);
    the orchestrator places sessions among them. One gateway process took 3.2 ms of CPU a request in the
    control-plane bench: docs/cluster_sizing.md says how many a load needs."""
    auth_token: Optional[str] = None
    """When set, every route requires `Authorization: Bearer <token>`."""
    max_request_bytes: int = 8 * 1024 * 1024
    """Largest request body accepted, in bytes; a larger one is refused."""
    load_factor: float = 1.25
    """Bounded-load consistent hashing: no engine takes more than load_factor x the mean load (beyond
    balance_abs_threshold)."""
    balance_abs_threshold: int = 32
    """A session's engine keeps its turns (and its prefix cache) until it carries this many requests more than
    the least loaded engine; beyond that, and beyond load_factor x the mean, its turns go to the next engine
    (SGLang's router: --balance-abs-threshold, 64). 0: the load_factor bound alone."""
    engine_timeout_s: float = 600.0
    """HTTP timeout of one engine call, in seconds (connect: 5 s)."""
    health_interval_s: float = 2.0
    """Seconds between health rounds over the engines (and re-reads of the registry with engines_from_redis)."""
    engine_urls: list[str] = field(default_factory=list)
    """Engines to route over at start; the set may be replaced later (POST /engines)."""
    engines_from_redis: bool = False
    """Follow the run's engine registry (`engines` hash, rewritten by engine actors after each
    restart) at every health round, instead of a fixed list."""
    tokenizer: Optional[str] = None
    """Tokenizer spec (see ModelSection.tokenizer); None = the run's model.tokenizer."""
    thinking: bool = True
    """GLM thinking mode: the generation prompt opens a <think> block (False: `<|assistant|></think>`)."""
    model_name: str = "asyncrl"
    """Model id reported in OpenAI replies and /v1/models."""
    redis_url: Optional[str] = None
    """Where finished trajectories go; None = the run's Redis (the launcher fills it in)."""
    run_name: Optional[str] = None
    """Key prefix of the run in Redis (asyncrl:{run}:...); None = the run's name."""
    public_url: Optional[str] = None
    """Base of the session base_urls handed out; None = the scheme and Host the caller used."""
    session_idle_timeout_s: float = 3600.0
    """An open session unused this long is aborted (its episode is gone); memory stays bounded."""
    finished_session_ttl_s: float = 300.0
    """A finished session's record stays readable (GET) this long; its finish reply stays longer."""
    max_interruptions: int = 8
    """Engine aborts (e.g. weight updates with pause mode abort) a turn survives by continuing."""
    engine_wait_s: float = 120.0
    """Seconds a turn with no engine left to try (the only one died) waits, its request held open, for a
    healthy one to continue on before answering 503; longer than an engine restart (~11 s on CPU)."""
    routing_replay: bool = False
    """Ask engines for each call's routed experts and store them with the samples. Set by the launcher
    from rollout.routing_replay."""
    engine_api_key: Optional[str] = field(default=None, repr=False)
    """Sent to the engines as `Authorization: Bearer <key>`. Set by the launcher from rollout.api_key."""
    gc_sweep_s: float = 600.0
    """Seconds between sweeps of the frozen heap (asyncrl/gc_policy.py): what survives a garbage collection is
    frozen, so no later collection walks the long-lived state again (their pauses were the gateway's latency
    tail), and each sweep frees the reference cycles that died frozen, at the cost of one full collection's
    pause. 0: CPython's generational collection instead."""

    def __post_init__(self) -> None:
        _check_gc_sweep_s(self.gc_sweep_s)
        if self.replicas < 1:
            raise ValueError(f"gateway.replicas must be >= 1, got {self.replicas}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0 (0: the load_factor bound alone), got "
                             f"{self.balance_abs_threshold}")
        if not self.load_factor >= 1:
            raise ValueError(f"load_factor must be >= 1 (a bound below the mean load leaves no engine to route to), "
                             f"got {self.load_factor}")


@dataclass
class EpisodeDeadlineConfig:
    """How the orchestrator sizes the deadline of an env that sets none (orchestrator/deadlines.py has the why):
    `factor` x the p99 of its last `window` episodes (model outcomes, and episodes cut at their deadline),
    between `min_s` and `orchestrator.episode_timeout_s`, once `after_episodes` have ended."""

    factor: float = 4.0
    """Deadline = factor x p99 of the env's episode durations; 0: every env without a deadline of its own gets
    `orchestrator.episode_timeout_s`."""
    min_s: float = 60.0
    """A sized deadline is never shorter (a fast env's slow episode is not cut for being slower than the rest)."""
    window: int = 200
    """The env's most recent episodes the p99 is taken over."""
    after_episodes: int = 20
    """Episodes of the env that must have ended before its deadline is sized."""

    def __post_init__(self) -> None:
        if self.factor < 0 or (0 < self.factor < 1):
            raise ValueError(f"episode_deadline.factor must be 0 (off) or >= 1, got {self.factor}")
        if not self.min_s > 0 or self.window < 1 or not 1 <= self.after_episodes <= self.window:
            raise ValueError("episode_deadline: min_s must be > 0 and 1 <= after_episodes <= window, got "
                             f"min_s={self.min_s}, window={self.window}, after_episodes={self.after_episodes}")


@dataclass
class DynamicSamplingConfig:
    """DAPO-style dynamic sampling (slime's --dynamic-sampling-filter-path check_reward_nonzero_std, verl's
    algorithm.filter_groups): a complete group whose usable members' rewards are all equal carries no
    signal (its advantages are all 0), so the orchestrator does not append it to the `groups` stream; it
    deletes its samples and starts another group in its place, so every step the trainer reads is filled
    with groups that have reward variance. docs/orchestrator.md "Dynamic sampling" has the rules and why
    they neither deadlock nor break the staleness bound."""

    enabled: bool = False
    """Filter complete groups whose rewards are all equal (the class docstring says how)."""
    std_tol: float = 0.0
    """A group is uninformative when the population std of its done members' rewards is <= std_tol
    (0: exactly equal rewards, as DAPO, slime and verl filter)."""
    max_filtered_batches: int = 10
    """Guard for rewards that never vary (a task too hard or too easy for the model, a broken reward):
    once max_filtered_batches x groups_per_step groups in a row were filtered (no informative group
    delivered in between), uninformative groups are delivered anyway (counted as passed) until the next
    informative one, so the run keeps stepping and ends instead of generating forever; a warning says so.
    As verl's max_num_gen_batches (the DAPO recipe uses 10), which raises instead. 0: never pass (filter
    forever; the warnings and the filtered fraction still show it)."""


TASK_ORDERS = ("shuffled", "listed")


@dataclass
class OrchestratorConfig:
    host: str = "127.0.0.1"
    """Interface the orchestrator binds (0.0.0.0: every interface)."""
    port: int = 0
    """Port it binds; 0 picks a free one (the bound URL is published through Ray/Redis)."""
    auth_token: Optional[str] = None
    """When set, every /v1 route requires `Authorization: Bearer <token>` (/health, /metrics stay open)."""
    redis_url: Optional[str] = None
    """Redis of the run (its state, the groups stream); required to serve. The launcher fills it in."""
    run_name: str = "asyncrl"
    """Key prefix of the run in Redis (asyncrl:{run}:...). The launcher fills it in with the run's name."""
    sessions: str = "gateway"
    """Plugin (asyncrl/plugins.py), where episodes get their LLM endpoint: `gateway` (a TITO gateway session
    per episode, trajectories recorded), `endpoint` (every episode uses `llm_url` directly, nothing recorded:
    evaluation, benchmarks; refused in a training run), or the import path of a SessionProvider. Run alone,
    the orchestrator picks the built-in by the URL it is given (--gateway or --llm-url)."""
    gateway_url: Optional[str] = None
    """TITO gateway base URL for `sessions: gateway`, or several gateways' URLs comma-separated (sessions go
    to the one with the fewest open sessions; orchestrator/sessions.py); the launcher fills it in."""
    gateway_token: Optional[str] = None
    """Bearer token sent to the gateway (its auth_token); None: none sent."""
    env_token: Optional[str] = field(default=None, repr=False)
    """Sent to env services as `Authorization: Bearer <token>`. Set by the launcher from envs.auth_token."""
    llm_url: Optional[str] = None
    """OpenAI-compatible base URL for `sessions: endpoint`."""
    model_name: str = "asyncrl"
    """`model` field of the episodes' LLM endpoint."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling of every model turn of an episode (max_new_tokens is sent to envs as max_tokens)."""
    seed: int = 0
    """Seeds the task order of every env and the episodes' seeds."""
    max_in_flight: int = 1024
    """Episodes running at env services at once, over all envs."""
    max_groups: Optional[int] = None
    """Start at most this many groups in the run, then finish them (evaluation runs, tests); None = forever."""
    task_split: str = "train"
    """The split whose tasks groups play (GET /tasks?split=): `train` in training; `asyncrl eval` plays `eval`
    (the held-out tasks) or whichever split it is asked for."""
    task_order: str = "shuffled"
    """`shuffled`: pass after pass over an env's tasks, each in a new seeded order (training); `listed`: one pass in
    the env's own order, one group per task, then no more groups of that env (`asyncrl eval`; with max_groups,
    its first tasks)."""
    group_size: int = 8
    """GRPO group: episodes of one task, one gateway session each."""
    max_attempts: int = 3
    """Dispatches of one episode that may fail (HTTP error, timeout, missed heartbeats, env status failed)
    before it is given up; refusals (429/503) and orchestrator restarts do not count."""
    heartbeat_interval_s: float = 5.0
    """Seconds between the heartbeats env services are told (at registration) to send."""
    heartbeat_timeout_s: float = 15.0
    """No heartbeat (or successful /health probe) for this long: the service is unhealthy."""
    episode_timeout_s: float = 600.0
    """Sent to envs as deadline_s (the orchestrator gives up on the request `request_grace_s` later): the deadline
    of an env's episodes until `episode_deadline` sizes one from the env's figures, and the most it sizes."""
    episode_deadline: EpisodeDeadlineConfig = field(default_factory=EpisodeDeadlineConfig)
    """Deadlines sized from each env's own episode durations, for envs with no episode_timeout_s of their own."""
    request_grace_s: float = 30.0
    """Seconds past an episode's deadline_s the orchestrator still waits for the env's answer."""
    max_turns: int = 20
    """Model calls an episode may make (EpisodeContext.max_turns), unless max_turns_by_env says otherwise."""
    max_turns_by_env: dict[str, int] = field(default_factory=dict)
    """max_turns of one env's episodes, by env name or domain (the name's entry first); missing = max_turns.
    The launcher fills it from envs.services.<name>.max_turns."""
    episode_timeout_s_by_env: dict[str, float] = field(default_factory=dict)
    """episode_timeout_s (deadline_s) of one env's episodes, by env name or domain, never resized; missing = sized
    by `episode_deadline`.
    The launcher fills it from envs.services.<name>.episode_timeout_s."""
    wait_for_envs: list[str] = field(default_factory=list)
    """Env names whose tasks new groups wait for at start, so that the first steps' mix holds every env of
    the run and not only those that came up first (the launcher fills in the run's envs); empty: none."""
    wait_for_envs_s: float = 120.0
    """How long new groups wait for `wait_for_envs`; then they start with the envs there are (a warning
    names the missing ones)."""
    domain_weights: dict[str, float] = field(default_factory=dict)
    """Dispatch ratios by env name or domain, e.g. {swe: 2, terminal: 1, search: 1}; a domain's weight is
    shared by its envs (in proportion to their registered weights); missing = env's registered weight."""
    rate_limits: dict[str, float] = field(default_factory=dict)
    """Episodes per second per env name; missing = unlimited."""
    max_unconsumed_groups: int = 256
    """Backpressure: new groups wait while complete groups the trainer has not consumed plus open groups
    reach this many (0 = off). Keep it above max_in_flight / group_size, or it caps the groups in flight."""
    staleness_limit: Optional[int] = None
    """Backpressure: start group n only while n < (weight_version + staleness_limit + 1) * groups_per_step,
    so no group is generated more than this many weight versions ahead of the trainer (None = off). With
    dynamic_sampling, n counts only groups that reach the trainer usable (filtered ones and ones its group
    rule drops are not counted), so filtered groups never use up the budget."""
    groups_per_step: int = 4
    """Groups the trainer consumes per weight version (used by staleness_limit and dynamic_sampling; the
    launcher passes trainer.groups_per_step x weight_push.every_k_steps)."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """Filter groups with equal rewards before the trainer sees them (off by default)."""
    backpressure_interval_s: float = 1.0
    """The longest wait between reads of the trainer-side signals (unconsumed groups, weight version);
    they are read at once whenever the trainer reports progress (docs/orchestrator.md "Backpressure")."""
    lease_ttl_s: float = 10.0
    """One orchestrator per run: it holds a Redis lease; a successor waits until it expires."""
    rate_window_s: float = 10.0
    """Window of the episodes_per_s figure."""
    gc_sweep_s: float = 600.0
    """Seconds between sweeps of the frozen heap (asyncrl/gc_policy.py): what survives a garbage collection is
    frozen, so no later collection walks the long-lived state again (their pauses were the orchestrator's latency
    tail), and each sweep frees the reference cycles that died frozen, at the cost of one full collection's
    pause. 0: CPython's generational collection instead."""

    def __post_init__(self) -> None:
        _check_gc_sweep_s(self.gc_sweep_s)
        if self.task_order not in TASK_ORDERS:
            raise ValueError(f"orchestrator.task_order must be one of {TASK_ORDERS}, got {self.task_order!r}")


@dataclass
class EnvServiceConfig:
    name: Optional[str] = None
    """The env's name at the orchestrator (its replicas share it); None = its key in envs.services."""
    target: str = MISSING
    """The env class served by the SDK app: an import path (envs.tasks.ArithmeticEnv, my_pkg:MyEnv: importable
    from the run's working directory or $PYTHONPATH) or path/to/file.py:Class (relative to that directory)."""
    domain: Optional[str] = None
    """None = the env class's `domain`, else the name (the service fills it in when it registers)."""
    num_replicas: int = 1
    """Env service processes started for this env (they share its name)."""
    capacity: int = 64
    """Episodes one replica runs at once; one more gets 429."""
    weight: float = 1.0
    """Dispatch weight sent with the registration (a relative share of episodes)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Constructor keyword arguments of the env class (`--option k=v`)."""
    sandbox: str = "namespace"
    """Plugin (asyncrl/plugins.py): `namespace` (isolated; refused where the machine lacks namespaces),
    `local_unsafe`, or the import path of a SandboxBackend."""
    sandbox_options: dict[str, Any] = field(default_factory=dict)
    """SandboxConfig fields (envs/sdk/sandbox.py: memory_mb, ro_paths, ...), passed as `--sandbox-option k=v`."""
    python: Optional[str] = None
    """The interpreter of this env's service processes, for an env in a venv of its own (the light env SDK and
    what the env needs, docs/envs.md): e.g. .venv-verifiers/bin/python, relative to the run's working
    directory; None: the run's own interpreter."""
    context: dict[str, Any] = field(default_factory=dict)
    """Context management of the env's agent loops, ContextConfig fields (envs/sdk/context.py: keep_recent_k,
    discard_at_tokens, ...), passed as `--context-option k=v`; empty: off."""
    max_turns: Optional[int] = None
    """Model calls an episode of this env may make (EpisodeContext.max_turns); None = orchestrator.max_turns."""
    episode_timeout_s: Optional[float] = None
    """Deadline of this env's episodes (EpisodeContext.deadline_s); None = sized from the env's episode durations
    (orchestrator.episode_deadline), orchestrator.episode_timeout_s until it is."""

    def __post_init__(self) -> None:
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.episode_timeout_s is not None and not self.episode_timeout_s > 0:
            raise ValueError(f"episode_timeout_s must be > 0, got {self.episode_timeout_s}")


@dataclass
class EnvsConfig:
    services: dict[str, Any] = field(default_factory=dict)
    """The run's env services by name, each an EnvServiceConfig: `+envs.services.myenv={target: my_pkg.MyEnv}`
    adds one to those of the config, `envs.services.arithmetic.max_turns=5` sets a field of one,
    `~envs.services.arithmetic` drops one (docs/envs.md "Adding an env to a run").

    Typed `Any` and open (not in Hydra's struct mode, see register_configs) because OmegaConf 2.3 cannot
    add a `{...}` override to a dict of dataclasses ("dict is not a subclass of EnvServiceConfig"); each
    entry is validated against EnvServiceConfig here instead, when the run's config is resolved
    (to_dataclass), and a misspelt field fails there naming it (`envs.services.myenv.capacitty`)."""

    auth_token: Optional[str] = field(default=None, repr=False)
    """Bearer token every env service of the run wants (/health, /metrics open); the orchestrator and
    `asyncrl eval` send it. None: env services take any caller, so keep them on loopback."""

    def __post_init__(self) -> None:
        if not isinstance(self.services, dict):
            raise ValueError(f"envs.services must map env names to their settings ({{arithmetic: {{target: ...}}, "
                             f"...}}), got {type(self.services).__name__}")
        self.services = {key: _env_service(str(key), value) for key, value in self.services.items()}


def _env_service(key: str, value: Any) -> EnvServiceConfig:
    if isinstance(value, EnvServiceConfig):
        service = value
    else:
        try:
            service = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvServiceConfig), value or {}))
        except Exception as err:  # OmegaConf's errors name the field relative to the entry
            message = str(err).splitlines()[0] if str(err).strip() else type(err).__name__
            field_key = getattr(err, "full_key", None)
            raise ValueError(f"envs.services.{key}{'.' + field_key if field_key else ''}: {message}") from err
    service.name = service.name or key
    return service


@dataclass
class LossConfig:
    type: str = "direct_double_sided_is"
    """Plugin (asyncrl/plugins.py): `direct_double_sided_is` (GLM-5 eq. 3-5), `icepop_ppo`, or the import
    path of a PolicyLoss."""
    eps_low: float = 0.2
    """Lower ratio bound 1 - eps_low: tokens below it are masked (direct_double_sided_is) or clipped (icepop_ppo)."""
    eps_high: float = 0.28
    """Upper ratio bound 1 + eps_high: tokens above it are masked (direct_double_sided_is) or clipped (icepop_ppo)."""
    icepop_beta: float = 2.0
    """icepop_ppo only: tokens whose pi_train_old / pi_rollout ratio lies outside [1/beta, beta] are masked."""
    aggregation: str = "token"
    """`token`: mean over all loss tokens of the batch; `sequence`: mean of per-sequence means."""


@dataclass
class WeightPushConfig:
    method: str = "disk"
    """Plugin (asyncrl/plugins.py): `disk` (atomic safetensors + update_weights_from_disk), `tensor`,
    `distributed` (broadcast), or the import path of a WeightPusher."""
    every_k_steps: int = 1
    """Optimizer steps between weight pushes to the engines."""
    reset_optimizer: bool = True
    """Reset the optimizer state after each push (the GLM-5 paper's default)."""
    pause_mode: str = "in_place"
    """How engines pause for the update: `in_place` (running requests keep their KV and continue with
    the new weights; their tokens record both versions), `retract` (requests are re-prefilled with the
    new weights), `abort` (requests end; the gateway retries them)."""
    snapshot_every_pushes: int = 10
    """tensor/distributed: also write an HF snapshot every N pushes, and at every push an engine failed
    (disk pushes always are snapshots). The `weights` hash points at the newest snapshot: what a
    restarted engine loads."""
    keep_snapshots: int = 3
    """Weight snapshot directories kept under <run_dir>/weights (older ones are deleted)."""
    master_address: Optional[str] = None
    """distributed: address engines use to reach the trainer's broadcast group; None = this node's IP."""
    distributed_backend: str = "auto"
    """distributed: `gloo`, `nccl`, or `auto` (nccl when the trainer's weights are on a GPU)."""
    engine_kind: str = "builtin"
    """distributed: `builtin` (asyncrl's engine) or `sglang`. They create their end of the broadcast group
    differently (default group vs SGLang's custom group); the trainer mirrors the one it talks to."""
    timeout_s: float = 600.0
    """Per engine call (pause, update, resume) and for joining the broadcast group."""
    verify_weights: bool = True
    """After each update, while the engines are still paused, read back the first rows of a few tensors
    from every engine (SGLang's /get_weights_by_name) and compare them with what was sent: an engine that
    serves other values counts as failed and is restarted with the pushed weights. An engine that cannot
    answer the read (an SGLang model without get_weights_by_name) is logged, not failed; turn it off there."""
    engine_api_key: Optional[str] = field(default=None, repr=False)
    """Sent to the engines as `Authorization: Bearer <key>`. Set by the launcher from rollout.api_key."""


@dataclass
class MegatronConfig:
    """Model parallelism of the megatron backend; data parallelism is world_size / tensor_parallel."""

    tensor_parallel: int = 1
    """Tensor-parallel ranks (sequence parallelism is on whenever this is > 1)."""
    expert_parallel: int = 1
    """Expert-parallel ranks: routed experts are split across them (carved out of data parallelism)."""


OPTIMIZERS = ("adamw", "muon")
"""trainer.optimizer's values (trainer/optimizers.py)."""


@dataclass
class TrainerConfig:
    backend: str = "torch"
    """Plugin (asyncrl/plugins.py): `torch` (CPU default, DDP over gloo), `megatron` (megatron-core), or the
    import path of a TrainerBackend."""
    lr: float = 1e-5
    """Learning rate (Muon's scaled to match AdamW's update size: one lr for both)."""
    optimizer: str = "adamw"
    """`adamw`, or `muon`: Muon for the hidden matrices (attention, MLPs, router, each routed expert), AdamW for
    embeddings, head, norms and the MTP layer, as GLM-5 trains (trainer/optimizers.py). Torch backend only."""
    weight_decay: float = 0.0
    """Decoupled weight decay (both optimizers); 0: none."""
    grad_clip: float = 1.0
    """Global gradient L2-norm clip per optimizer step; 0: no clipping."""
    groups_per_step: int = 4
    """GRPO groups (of orchestrator.group_size episodes each) per optimizer step."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch."""
    advantage: str = "group_mean"
    """`group_mean` (agentic: r - mean) or `group_norm` (reasoning: (r - mean) / std)."""
    staleness_tau: int = 4
    """Drop samples whose first weight version lags the current one by more than tau."""
    freeze_indexer: bool = True
    """Keep the DSA indexer fixed (GLM-5 §3.2): no gradient, not in the optimizer."""
    indexer_kl_coef: float = 1.0
    """Only with freeze_indexer false: weight of the indexer's KL alignment loss, its only training signal."""
    mtp_loss_coef: float = 0.0
    """Weight of the online MTP loss (trainer/mtp_loss.py: cross-entropy of the MTP layer's draft of the
    token after next, on generated tokens), which trains the MTP layer only; the policy update is the
    same with or without it. 0: the MTP layer stays as loaded. torch backend; needs an MTP layer."""
    mtp_depths: int = 3
    """Depths the MTP loss trains the one MTP layer at (GLM-5: 3): depth d reads the layer's own output of
    depth d - 1, as speculative decoding's draft d does (trainer/mtp_loss.py). 1: first drafts only."""
    grad_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of storing its activations."""
    device: str = "cpu"
    """torch backend: `cpu`, `cuda` (cuda:<LOCAL_RANK>), or `auto` (cuda when available)."""
    dense_attention_up_to: int = 512
    """torch backend: micro-batches whose longest sequence is at most this long use masked dense attention,
    longer ones sparse attention over the index_topk selected keys. Same result; dense is faster at short
    lengths (gathering selected keys costs more than it saves), sparse at long ones (O(T*k) vs O(T^2)).
    0 = always sparse. The unfrozen indexer always trains with sparse attention (its KL needs it)."""
    checkpoint_every: int = 10
    """Steps between checkpoints. Groups are acknowledged only once a checkpoint holds their step, so a
    crash re-trains at most this many steps (from the restored weights), and never loses a group."""
    keep_checkpoints: int = 2
    """Checkpoints kept under <run_dir>/checkpoints (older ones are deleted)."""
    redis_retry_s: float = 120.0
    """For about how long a Redis command that failed (connection lost, 30 s without an answer) is sent
    again before the trainer gives up and the run fails: a Redis restart or stall in between is ridden
    out. 0: the first failure ends the run."""
    metrics_host: str = "127.0.0.1"
    """Where the trainer's Prometheus /metrics and /health bind (0.0.0.0: every interface, advertised
    by the node's IP); the URL is in the run's `services` hash as `trainer_metrics`."""
    metrics_port: Optional[int] = 0
    """0: a free port; None: no endpoint."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss (LossConfig)."""
    weight_push: WeightPushConfig = field(default_factory=WeightPushConfig)
    """How and how often the trained weights reach the engines (WeightPushConfig)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Only read by the megatron backend."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"trainer.optimizer {self.optimizer!r}: one of {', '.join(OPTIMIZERS)}")


@dataclass
class WarmupStage:
    """An earlier supervised stage of the warm-up, on another env's demonstrations (WarmupConfig.stages)."""

    env: str = MISSING
    """Import path of an env class offering demonstrations(count, seed), as WarmupConfig.env."""
    env_options: dict[str, Any] = field(default_factory=dict)
    """Constructor keyword arguments of the stage's env class."""
    steps: int = 0
    """Supervised optimizer steps of the stage (the most it takes when `until_loss` is set)."""
    batch_size: int = 32
    """Demonstrations per optimizer step of the stage."""
    until_loss: Optional[float] = None
    """End the stage once its loss, averaged over its last LOSS_WINDOW steps (trainer/sft.py), is below
    this. A stage that must end past its learning jump reaches it at a step that depends on the sample stream
    and the CPU's floating point (the copy stage of scripts/build_tiny_base.py: loss 0.01 at step 1,000 on an
    Intel host, ~1,250 to past 1,840 on an AMD one); a fixed step count stops some hosts before it. None: run
    `steps`."""


@dataclass
class WarmupConfig:
    """Supervised warm-up before RL (0 steps: none). Produces <run_dir>/warmup, reused by later runs."""

    stages: list[WarmupStage] = field(default_factory=list)
    """Stages run in order before the main one (env, steps), with the same optimizer and lr. E.g. a copy task
    over digits for a model from random weights, where a real run starts from a pretrained LM: without the
    copying a pretrained model can do, the tiny model's first 300+ demonstration steps learn only the format
    (scripts/build_tiny_base.py runs that stage once for the main job; docs/envs.md "File lookup")."""
    steps: int = 0
    """Supervised optimizer steps before RL; 0: no warm-up."""
    env: str = "envs.tasks.ArithmeticEnv"
    """Import path (asyncrl/plugins.py) of an env class offering demonstrations(count, seed)."""
    env_options: dict[str, Any] = field(default_factory=dict)
    """Constructor keyword arguments of the warm-up env class."""
    batch_size: int = 32
    """Demonstrations per warm-up optimizer step."""
    lr: float = 3e-3
    """AdamW learning rate of the warm-up."""
    mtp_loss_coef: float = 0.0
    """Weight of the MTP loss in the warm-up (as trainer.mtp_loss_coef, on the assistant tokens): the MTP
    layer learns to draft from the warmed-up policy; the policy's own warm-up is unchanged. 0: none."""
    mtp_depths: int = 3
    """As trainer.mtp_depths, for the warm-up's MTP loss and its MTP self-distillation."""
    mtp_distill_samples: int = 0
    """After the supervised steps, the warmed-up policy samples (temperature 1) this many replies to fresh
    demonstration prompts, and the MTP layer alone is fitted to them for `mtp_distill_steps` steps: drafts
    of the policy's own text, not of the demonstrations (EAGLE trains its drafter on the target's
    regenerated data). 0: none. Worth it with rollout.speculative (bench/results/speculative.md)."""
    mtp_distill_steps: int = 100
    """Full-batch AdamW steps (at `lr`) of the MTP self-distillation."""
    thinking: bool = False
    """Chat-template mode; must match the gateway's."""


@dataclass
class RayConfig:
    address: Optional[str] = None
    """Ray cluster to join ("auto": the one `ray start` runs here; "host:port"); None joins the cluster of
    `ray job submit`, else starts a fresh local one (never a stale cluster left on the machine)."""
    num_cpus: Optional[int] = None
    """CPUs of a freshly started local Ray cluster; None: the machine's CPU count."""


@dataclass
class PlacementConfig:
    """Ray custom resources each actor of a component asks for, so Ray starts it on a node that offers them
    (`ray start --resources='{"rollout_node": 64}'`), next to the CPUs / GPUs it reserves. Empty: anywhere
    Ray likes (the launcher's node first). Example: engines and env services on the rollout nodes, the rest
    on the head: `cluster.placement.engines={rollout_node: 1} cluster.placement.envs={rollout_node: 1}`."""

    engines: dict[str, float] = field(default_factory=dict)
    """Each engine actor (rollout.num_engines of them)."""
    gateway: dict[str, float] = field(default_factory=dict)
    """The gateway's actor (next to the engines saves a hop; next to the env services, theirs)."""
    orchestrator: dict[str, float] = field(default_factory=dict)
    """The orchestrator's actor."""
    envs: dict[str, float] = field(default_factory=dict)
    """Each replica of every env service."""
    trainer: dict[str, float] = field(default_factory=dict)
    """The trainer actor: its node holds the run's checkpoints, weight snapshots and final weights."""


@dataclass
class ClusterConfig:
    """A run whose Ray cluster spans hosts (docs/run.md "A run across hosts")."""

    host: Optional[str] = None
    """Interface every service of the run binds: the engines, the gateway, the orchestrator, the env services,
    the embedded Redis, the trainer's /metrics. None: each its own (gateway.host, orchestrator.host,
    trainer.metrics_host; the others 127.0.0.1), so a one-machine run stays on loopback. 0.0.0.0 for a run
    across hosts: each service then publishes its node's address (Ray's node IP) as its URL."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Which nodes each component runs on (PlacementConfig)."""
    shared_fs: bool = False
    """The run dir is on a filesystem every node mounts at the same path (NFS, Lustre). False, on a cluster
    of more than one node: nothing assumes another node can read the launcher's or the trainer's files. The
    initial weights travel to the engines' and the trainer's nodes through Ray's object store, a restarting
    engine fetches the newest weight snapshot from the trainer actor, and weight_push.method=disk (which
    hands the engines a path on the trainer's disk) is refused at start."""


@dataclass
class ComponentsConfig:
    """What the launcher starts; replace one to plug in another implementation. Classes and functions are
    import paths (asyncrl/plugins.py: `package.module:Name` or `package.module.Name`); services are modules."""

    engine_group: str = "rollout.actor.EngineGroup"
    """Import path of the engine group class (starts and supervises the engines)."""
    gateway: str = "gateway.server"
    """Module run as the gateway service (`python -m MODULE ... --port 0 --url-file F`)."""
    orchestrator: str = "orchestrator.server"
    """Module run as the orchestrator service (`python -m MODULE ... --port 0 --url-file F`)."""
    env_service: str = "envs.serve"
    """Module run as each env service (`python -m MODULE --env TARGET ... --port 0 --url-file F`)."""
    trainer: str = "trainer.actor.Trainer"
    """Import path of the trainer actor class."""
    warmup: str = "trainer.sft.warmup"
    """Import path of the warm-up function (model, WarmupConfig, out_dir, seed)."""


@dataclass
class ResourcesConfig:
    num_cpus: float = 1.0
    """Ray CPUs reserved for the trainer actor."""
    num_gpus: float = 0.0
    """Ray GPUs reserved for the trainer actor."""


WANDB_MODES = ("auto", "offline", "online")


@dataclass
class WandbConfig:
    """Weights & Biases logging of the run's metrics (asyncrl_run/wandb_mirror.py, docs/run.md "Weights &
    Biases"), done by the launcher next to TensorBoard: one W&B run per run dir, resumed with it."""

    enabled: bool = False
    """Log the run to W&B (TensorBoard is written either way)."""
    project: str = "asyncrl"
    """W&B project of the run."""
    entity: Optional[str] = None
    """W&B entity (user or team); None: the account's default entity."""
    mode: str = "auto"
    """`auto`: $WANDB_MODE when set, else `online` when W&B credentials exist ($WANDB_API_KEY or a
    `wandb login` entry in ~/.netrc), else `offline`; `offline`: files only, uploaded later with `wandb
    sync` (an air-gapped cluster); `online`: streamed to the W&B server (the run fails at start without
    credentials or a reachable server)."""
    group: Optional[str] = None
    """W&B run group (runs of one sweep or comparison side by side); None: none."""
    tags: list[str] = field(default_factory=list)
    """W&B tags of the run."""
    name: Optional[str] = None
    """W&B display name; None: the run's name."""
    dir: Optional[str] = None
    """Where W&B writes its files (<dir>/wandb/<offline-run-...>); None: the run dir (<run_dir>/wandb)."""

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"wandb.mode must be one of {', '.join(WANDB_MODES)}, got {self.mode!r}")
        if not self.project:
            raise ValueError("wandb.project must not be empty")


@dataclass
class RunConfig:
    name: str = "asyncrl"
    """Run name: the prefix of its Redis keys and Ray actor names, and of the default run_dir."""
    run_dir: Optional[str] = None
    """Where the run writes (Redis AOF, checkpoints, final weights, TensorBoard, logs, summary.json);
    None = runs/<name>. Relative to the working directory, except under `ray job submit` (whose working
    directory is Ray's temporary copy of the package): there under $ASYNCRL_HOME (default ~/asyncrl)."""
    resume: bool = True
    """A run dir that holds a previous run is resumed (from its newest checkpoint, with its Redis state).
    false: the old files are moved to <run_dir>.<timestamp> (and the run's keys in an external Redis
    deleted), and the run starts afresh."""
    seed: int = 0
    """Seed of the model's random init, the warm-up, the trainer and the orchestrator's task order."""
    mode: str = "async"
    """`async`: rollout never waits for training. `sync`: generate a batch, train, push (baseline)."""
    total_steps: int = 100
    """Optimizer steps the run trains before it ends."""
    redis: RedisConfig = field(default_factory=RedisConfig)
    """The run's Redis (RedisConfig)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray cluster the run uses (RayConfig)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Addresses, placement and filesystem of a run across hosts (ClusterConfig)."""
    model: ModelSection = field(default_factory=ModelSection)
    """The model every component loads (ModelSection)."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm-up before RL (WarmupConfig)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The engines (RolloutConfig)."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The TITO gateway (GatewayConfig)."""
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    """The orchestrator (OrchestratorConfig)."""
    envs: EnvsConfig = field(default_factory=EnvsConfig)
    """The run's env services (EnvsConfig)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The trainer (TrainerConfig)."""
    trainer_resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    """Ray resources reserved for the trainer actor (ResourcesConfig)."""
    trainer_restarts: int = 3
    """How often a dead trainer process is restarted (it resumes from its last checkpoint)."""
    trainer_restart_timeout_s: float = 300.0
    """How long Ray may take to bring a dead trainer back before the run fails."""
    stall_limit_s: float = 1800.0
    """No training step for this long stops the run (exit 1), naming the component that holds it up
    (launcher.stall_cause: the orchestrator, the trainer, or an env's services). Keep it above the longest
    step you expect, e.g. above orchestrator.episode_timeout_s (600 s) when a step may wait on one slow
    episode; 0 = never stop."""
    components: ComponentsConfig = field(default_factory=ComponentsConfig)
    """Which implementation the launcher starts for each component (ComponentsConfig)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging of the run's metrics (WandbConfig)."""

    def __post_init__(self) -> None:
        push = self.trainer.weight_push
        if self.rollout.backend == "sglang" and push.method == "tensor":
            raise ValueError("weight_push.method=tensor sends asyncrl's CPU-safe load_format (asyncrl_safetensors_b64), "
                             "which SGLang 0.5.23's /update_weights_from_tensor refuses (Unknown load_format: it takes "
                             "CUDA IPC handles of a process on its node); with rollout.backend=sglang use `disk` or "
                             "`distributed` (weight_push.engine_kind=sglang)")
        if self.rollout.backend == "sglang" and push.method == "distributed" and push.engine_kind != "sglang":
            raise ValueError("weight_push.method=distributed with rollout.backend=sglang needs "
                             "weight_push.engine_kind=sglang: SGLang joins the broadcast group under its own key space "
                             f"(init_custom_process_group), not the built-in engine's ({push.engine_kind!r})")
        if self.orchestrator.sessions == "endpoint":
            raise ValueError("orchestrator.sessions=endpoint records no trajectories, so a training run would never "
                             "step: use `gateway` (the default) or the import path of a SessionProvider that records "
                             "them; `asyncrl eval` is the command for unrecorded episodes")


Section = TypeVar("Section")
SECRET_SUFFIXES = ("token", "api_key")
"""Fields named so (and those declared repr=False) are secrets: never written to a section file, shown
as "<set>" by /server_info; they travel by environment variable (asyncrl_run.launcher)."""


def is_secret(f: Field) -> bool:
    return not f.repr or f.name.endswith(SECRET_SUFFIXES)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal after it in the class body) by field name: what docs
    readers and the generated flags' --help show. Empty when the class's source cannot be read."""
    try:
        [node] = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    except (OSError, TypeError):
        return {}
    docs = {}
    for stmt, after in zip(node.body, node.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def section_data(section: Any, redact: bool = False) -> dict[str, Any]:
    """A config dataclass as JSON-able data, nested ones included (also as dict values: envs.services);
    secrets left out, or with `redact` shown as "<set>" (None when unset), as a service's /server_info
    reports them."""
    out: dict[str, Any] = {}
    for f in fields(section):
        value = getattr(section, f.name)
        if is_secret(f):
            if redact:
                out[f.name] = None if value is None else "<set>"
        else:
            out[f.name] = _value_data(value, redact)
    return out


def _value_data(value: Any, redact: bool) -> Any:
    if is_dataclass(value):
        return section_data(value, redact)
    if isinstance(value, dict):
        return {k: _value_data(v, redact) for k, v in value.items()}
    return value


def write_section(section: Any, path: Path) -> Path:
    """A service's resolved section as JSON at `path` (atomically), secrets left out: what the launcher
    hands the service as `--config FILE`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(section_data(section), indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def load_section(cls: type[Section], path: Optional[Path] = None, overrides: Optional[dict] = None) -> Section:
    """`cls` from its defaults, then the JSON file at `path`, then `overrides` (field -> value, nested
    sections as dicts), strictly: an unknown key or a value of the wrong type raises ValueError naming it."""
    layers = [json.loads(Path(path).read_text())] if path else []
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), *layers, overrides or {})
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except Exception as err:  # OmegaConf's errors name the key; __post_init__ checks raise ValueError
        message = str(err).splitlines()[0] if str(err).strip() else type(err).__name__
        key = getattr(err, "full_key", None)
        raise ValueError(f"{cls.__name__}{'.' + key if key else ''}{f' ({path})' if path else ''}: {message}") from err


ASSETS_DIR = Path(__file__).resolve().parent / "assets"


def asset_path(name: str) -> str:
    """`${asset:NAME}` in a config: the absolute path of asyncrl/assets/NAME (shipped with the package, so it
    is there in a Ray job's working-dir copy too)."""
    path = ASSETS_DIR / name
    if not path.exists():
        shipped = ", ".join(sorted(p.name for p in ASSETS_DIR.iterdir()))
        raise ValueError(f"${{asset:{name}}}: no {path} (the assets: {shipped})")
    return str(path)


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (the yaml groups validate against them), and the
    `${asset:NAME}` resolver."""
    from hydra.core.config_store import ConfigStore

    OmegaConf.register_new_resolver("asset", asset_path, replace=True)

    cs = ConfigStore.instance()
    run, envs = OmegaConf.structured(RunConfig), OmegaConf.structured(EnvsConfig)
    for services in (run.envs.services, envs.services):  # new env names and fields may be added (EnvsConfig)
        OmegaConf.set_struct(services, False)
    for component in fields(PlacementConfig):  # `cluster.placement.engines={rollout_node: 1}` names a new resource
        OmegaConf.set_struct(run.cluster.placement[component.name], False)
    cs.store(name="run_schema", node=run)
    for group, node in [("model", ModelSection), ("rollout", RolloutConfig), ("trainer", TrainerConfig),
                        ("envs", envs)]:
        cs.store(group=group, name=f"{group}_schema", node=node)


def to_dataclass(cfg: DictConfig) -> RunConfig:
    """Resolved, validated, typed view of a composed Hydra config."""
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    run: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    run.run_dir = run.run_dir or f"runs/{run.name}"
    return run


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def load_model_section(name: str = "tiny") -> ModelSection:
    """configs/model/<name>.yaml as a validated ModelSection (for tools, tests and benchmarks)."""
    raw = OmegaConf.load(CONFIG_DIR / "model" / f"{name}.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelSection), raw))  # type: ignore[return-value]
