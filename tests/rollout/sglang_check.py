"""SGLang's own code, run in .venv-sglang (`make sglang-venv`), judging what asyncrl hands a real SGLang server.

Not a test module: tests/rollout/test_sglang_native.py runs it as `.venv-sglang/bin/python sglang_check.py`
with one JSON job on stdin and reads one JSON answer on stdout (the two venvs share nothing: asyncrl's side
builds the command lines and request bodies with its own code, this side only judges them with SGLang's).

The job: {"argvs": {id: argv}, "requests": {id: {"method", "path", "body"}}, "vocab_size": int}. The answer:
  argvs[id]     {"ok": true, "fields": {ServerArgs field: value}} or {"ok": false, "error": ...}: the argv parsed
                by `sglang.srt.server_args.prepare_server_args`, SGLang's own entry (`sglang serve` / launch_server);
  requests[id]  {"ok": true, "type": name} or {"ok": false, "error": ...}: the body as SGLang's http_server takes
                it (route, method and the request type bound to the route read from http_server.py itself), then
                built as that type (a dataclass: an unknown key is a TypeError) and put through the type's own
                checks (the /generate schema gate, normalize_batch_and_arguments, SamplingParams(**...) + verify);
  sglang        facts read off SGLang's source, for the response checks: its version, the keys of the dicts its
                /model_info and weight-update handlers answer with, the meta_info keys its OpenAI layer reads
                with a subscript (it fails without them) and those its tokenizer manager writes.

Two imports cannot be satisfied on a CPU machine without a CUDA package, so they are stubbed before SGLang is
imported (nothing else is):
  * triton: `sglang/__init__` imports sglang.srt.utils.common, which imports triton unconditionally; the Linux
    triton wheel bundles NVIDIA's ptxas and CUDA headers. SGLang's own stub is used, the one it installs on Apple
    silicon (sglang/_platform_stubs.py), by running its installer with the platform checks answered as macOS's.
  * torchvision: io_struct imports schedule_batch, which imports sglang.srt.configs, every model config of
    which InternVL's and DeepSeek-OCR's import torchvision.transforms; PyPI's torchvision wheel bundles libcudart
    and libnvjpeg (the CPU build lives on download.pytorch.org, which CI cannot reach). A module whose attributes
    raise when called stands in; no code path checked here calls into it.
ServerArgs needs no stub: in 0.5.23 its __post_init__ does nothing, and the hardware- and checkpoint-dependent
resolution (`resolve_once`: model config, device, CUDA) runs only when a launcher starts the engine, so
prepare_server_args is exactly SGLang's argparse over its own flag definitions, plus from_cli_args.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import platform
import sys
import sysconfig
import types
from contextlib import redirect_stderr
from pathlib import Path
from unittest import mock

SITE = Path(sysconfig.get_paths()["purelib"])


def _stub_triton() -> None:
    import torch

    spec = importlib.util.spec_from_file_location("_sglang_platform_stubs", SITE / "sglang" / "_platform_stubs.py")
    stubs = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stubs
    spec.loader.exec_module(stubs)
    with mock.patch.object(sys, "platform", "darwin"), mock.patch.object(platform, "machine", return_value="arm64"), \
            mock.patch.object(torch.backends.mps, "is_available", return_value=True):
        stubs.install_platform_stubs()


class _Unavailable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is stubbed in .venv-sglang (tests/rollout/sglang_check.py)")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []
        module.__version__ = "0.0"  # transformers' version probe: below every version it gates on


def _boot() -> None:
    if importlib.util.find_spec("triton") is None:
        _stub_triton()
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.insert(0, _TorchvisionStub())


# Reading SGLang's source ---------------------------------------------------------------------------------------

def _tree(relative: str) -> ast.Module:
    return ast.parse((SITE / relative).read_text())


def _const(node: ast.AST):
    return node.value if isinstance(node, ast.Constant) else None


def routes() -> dict[str, dict]:
    """http_server.py's routes (and those of the routers it includes that asyncrl calls: v1_loads.py): path ->
    {"methods", "type" (the class the handler's body parameter is), "keys" (every string key of the dict literals
    in the handler: what it answers with)}."""
    out: dict[str, dict] = {}
    handlers = [fn for name in ("http_server.py", "v1_loads.py") for fn in _tree(f"sglang/srt/entrypoints/{name}").body]
    for fn in handlers:
        if not isinstance(fn, ast.AsyncFunctionDef):
            continue
        for deco in fn.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and isinstance(deco.func.value, ast.Name) and deco.func.value.id in ("app", "router") and deco.args):
                continue
            path = _const(deco.args[0])
            if not isinstance(path, str):
                continue
            kind = deco.func.attr
            methods = [kind.upper()] if kind in ("get", "post", "put", "delete") else []
            for kw in deco.keywords:
                if kw.arg == "methods":
                    methods = [_const(e) for e in kw.value.elts]
            body_type = None
            for arg in fn.args.args:
                ann = arg.annotation
                if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated":
                    ann = ann.slice.elts[0]
                if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
                    ann = ann.slice
                if isinstance(ann, ast.Name) and ann.id not in ("Request", "str", "int", "float", "bool"):
                    body_type = ann.id
            keys = sorted({_const(k) for d in ast.walk(fn) if isinstance(d, ast.Dict) for k in d.keys
                           if isinstance(_const(k), str)})
            out[path] = {"methods": methods, "type": body_type, "function": fn.name, "keys": keys}
    return out


def meta_info_required_reads() -> list[str]:
    """meta_info keys SGLang's OpenAI serving layer reads by subscript (`...["meta_info"]["k"]`, `meta_info["k"]`):
    a /generate reply without one breaks it."""
    keys = set()
    for name in ("serving_chat.py", "serving_completions.py"):
        for node in ast.walk(_tree(f"sglang/srt/entrypoints/openai/{name}")):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(_const(node.slice), str):
                value = node.value
                if (isinstance(value, ast.Subscript) and _const(value.slice) == "meta_info") or \
                        (isinstance(value, ast.Name) and value.id == "meta_info"):
                    keys.add(_const(node.slice))
    return sorted(keys)


def meta_info_written() -> list[str]:
    """meta_info keys SGLang's tokenizer manager (and its weight-version helper) writes: dict literals assigned to
    or merged into a `meta_info`, and `meta_info["k"] = ...`."""
    keys = set()
    for relative in ("sglang/srt/managers/tokenizer_manager.py", "sglang/srt/utils/weight_versions.py",
                     "sglang/srt/observability/req_time_stats.py"):
        if not (SITE / relative).exists():
            continue
        for node in ast.walk(_tree(relative)):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "meta_info"
                                                    for t in node.targets) and isinstance(node.value, ast.Dict):
                keys |= {_const(k) for k in node.value.keys if isinstance(_const(k), str)}
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "meta_info" and isinstance(_const(node.slice), str):
                keys.add(_const(node.slice))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update" and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "meta_info":
                for arg in node.args:
                    if isinstance(arg, ast.Dict):
                        keys |= {_const(k) for k in arg.keys if isinstance(_const(k), str)}
    return sorted(keys)


def launch_server_parser() -> str | None:
    """The function `python -m sglang.launch_server` builds its ServerArgs with, if it is prepare_server_args."""
    for node in ast.walk(_tree("sglang/launch_server.py")):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "prepare_server_args":
            return "prepare_server_args"
    return None


def option_strings() -> list[str]:
    """Every option string of SGLang's server parser, as prepare_server_args builds it."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return sorted(o for o in parser._option_string_actions if o.startswith("--"))


def deterministic_facts() -> dict:
    """SGLang's rule for --enable-deterministic-inference: the attention backends it allows for absorbed-MLA
    models, and those models' architectures (the string lists of attention_hook.handle_deterministic_inference)."""
    from sglang.srt.arg_groups.choices import RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND

    archs = set()
    for fn in ast.walk(_tree("sglang/srt/arg_groups/attention_hook.py")):
        if isinstance(fn, ast.FunctionDef) and fn.name == "handle_deterministic_inference":
            archs |= {_const(e) for node in ast.walk(fn) if isinstance(node, ast.List) for e in node.elts
                      if isinstance(_const(e), str)}
    return {"backends": list(RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND), "absorbed_mla_architectures": sorted(archs)}


def tensor_load_formats() -> list:
    """The load_format values SGLang's update_weights_from_tensor takes (weight_updater.py: the constants it
    compares load_format with, None included; anything else is a NotImplementedError unless it is one of the
    server's --custom-weight-loader)."""
    formats = set()
    for fn in ast.walk(_tree("sglang/srt/model_executor/model_runner_components/weight_updater.py")):
        if isinstance(fn, ast.FunctionDef) and fn.name == "update_weights_from_tensor":
            for node in ast.walk(fn):
                if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "load_format":
                    formats |= {_const(c) for c in node.comparators if isinstance(c, ast.Constant)}
    return sorted(formats, key=str)


def environment_variables() -> list[str]:
    from sglang.srt.environ import Envs

    return sorted(name for name in vars(Envs) if name.startswith("SGLANG_"))


# Judging -------------------------------------------------------------------------------------------------------

def _plain(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def parse_argv(argv: list[str]) -> dict:
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import prepare_server_args

    err = io.StringIO()
    try:
        with redirect_stderr(err):
            args = prepare_server_args(argv)
    except SystemExit:  # argparse refused it (unknown flag, bad value): its message went to stderr
        return {"ok": False, "error": err.getvalue().strip().splitlines()[-1:]}
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    fields = {f.name: _plain(getattr(args, f.name)) for f in record_fields(type(args))}
    return {"ok": True, "fields": fields}


def check_request(request: dict, table: dict[str, dict], vocab_size: int) -> dict:
    from sglang.srt.managers import io_struct

    path, method, body = request["path"], request["method"], request["body"]
    route = table.get(path)
    if route is None:
        return {"ok": False, "error": f"SGLang's http_server has no route {path}"}
    if method not in route["methods"]:
        return {"ok": False, "error": f"SGLang serves {path} for {route['methods']}, not {method}"}
    if route["type"] is None:
        return {"ok": True, "type": None} if body is None else \
            {"ok": False, "error": f"SGLang's {path} takes no body, asyncrl sends {body}"}
    cls = getattr(io_struct, route["type"])
    try:
        if path == "/generate":
            from sglang.srt.entrypoints.api_contract import generate_contract_error

            if (error := generate_contract_error(body)) is not None:
                return {"ok": False, "error": f"/generate schema: {error}"}
        obj = cls(**(body or {}))  # a stdlib dataclass: an unknown or misspelled key is a TypeError
        _pydantic_check(cls, body or {})  # what FastAPI does with the body: the field types
        if hasattr(obj, "normalize_batch_and_arguments"):
            obj.normalize_batch_and_arguments()
        if path == "/generate":
            _check_sampling(obj, vocab_size)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": f"{route['type']}: {type(exc).__name__}: {exc}"}
    return {"ok": True, "type": route["type"]}


def _pydantic_check(cls, body: dict) -> None:
    """The body validated against the dataclass's field types as FastAPI's request parsing does (pydantic)."""
    from pydantic import TypeAdapter

    TypeAdapter(cls).validate_python(body)


class _ByteTokenizer:
    """Stands in for the checkpoint's tokenizer: normalize() only measures stop strings with it."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


def _check_sampling(obj, vocab_size: int) -> None:
    """What the tokenizer manager does with each request's sampling params (tokenizer_manager.py,
    _create_tokenized_object): SamplingParams(**params) (an unknown key is a TypeError), normalize, verify."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
    for p in params:
        sp = SamplingParams(**(p or {}))
        sp.normalize(_ByteTokenizer())  # the launcher does not pass --skip-tokenizer-init: SGLang has a tokenizer
        sp.verify(vocab_size)


def main() -> None:
    job = json.load(sys.stdin)
    _boot()
    import sglang

    table = routes()
    answer = {
        "argvs": {key: parse_argv(argv) for key, argv in job.get("argvs", {}).items()},
        "requests": {key: check_request(r, table, job.get("vocab_size", 1 << 20))
                     for key, r in job.get("requests", {}).items()},
        "sglang": {"version": sglang.__version__, "routes": table,
                   "meta_info_required_reads": meta_info_required_reads(), "meta_info_written": meta_info_written(),
                   "launch_server_parses_with": launch_server_parser(), "option_strings": option_strings(),
                   "deterministic": deterministic_facts(), "environment_variables": environment_variables(),
                   "tensor_load_formats": tensor_load_formats()},
    }
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    main()
