"""asyncrl/plugins.py: one import-path syntax (`module:Name` or `module.Name`), errors that name what is
missing, and every plugin point loading a user's own class by import path exactly as a built-in."""

import sys
from pathlib import Path

import pytest

from asyncrl.config import (LossConfig, OrchestratorConfig, RolloutConfig, TrainerConfig, WarmupConfig,
                            WeightPushConfig, load_model_section)
from asyncrl.plugins import PluginNotFound, load_object, load_plugin
from envs.sdk.sandbox import SANDBOX_BACKENDS, SandboxConfig, make_sandbox_backend
from orchestrator.sessions import SESSION_PROVIDERS, make_sessions
from rollout.backends import BACKENDS as ROLLOUT_BACKENDS
from rollout.backends import make_backend as make_engine_backend
from trainer.backends.base import BACKENDS as TRAINER_BACKENDS
from trainer.backends.base import make_backend as make_trainer_backend
from trainer.losses import LOSSES, DirectDoubleSidedIS, build_loss
from trainer.sft import warmup
from trainer.weight_push import PUSHERS, DiskPusher, WeightSync

HERE = "tests.asyncrl.test_plugins"
ROOT = Path(__file__).resolve().parents[2]


class UserPlugin:
    """A user's own implementation: records what its plugin point constructed it with."""

    def __init__(self, *args) -> None:
        self.args = args


class UserDemoEnv:
    """A user's warm-up env: one demonstration dialogue, `count` times."""

    requested: list[tuple[int, int]] = []

    def __init__(self, reply: str) -> None:
        self.reply = reply

    def demonstrations(self, count: int, seed: int) -> list[list[dict[str, str]]]:
        UserDemoEnv.requested.append((count, seed))
        return [[{"role": "user", "content": "1+1="}, {"role": "assistant", "content": self.reply}]] * count


def test_both_syntaxes_name_the_same_object():
    assert load_object("trainer.losses:DirectDoubleSidedIS") is DirectDoubleSidedIS
    assert load_object("trainer.losses.DirectDoubleSidedIS") is DirectDoubleSidedIS
    assert load_object(f"{HERE}:UserPlugin") is load_object(f"{HERE}.UserPlugin") is UserPlugin


@pytest.mark.parametrize("registry", [LOSSES, TRAINER_BACKENDS, ROLLOUT_BACKENDS, SESSION_PROVIDERS, PUSHERS,
                                      SANDBOX_BACKENDS])
def test_every_builtin_name_resolves_to_its_class(registry):
    for name, path in registry.items():
        if name != "megatron":  # megatron-core is optional; its path is checked without importing it
            assert isinstance(load_plugin(registry, name, "setting"), type), name
        assert (ROOT / (path.partition(":")[0].replace(".", "/") + ".py")).is_file(), path


def test_a_missing_module_is_named():
    with pytest.raises(PluginNotFound, match=r"cannot import 'no_such_pkg.mod:Loss': no module named 'no_such_pkg'$") \
            as err:
        load_object("no_such_pkg.mod:Loss")
    assert err.value.missing_module == "no_such_pkg"
    with pytest.raises(PluginNotFound, match=r"no module named 'trainer.no_such_module'$"):
        load_object("trainer.no_such_module.Loss")


def test_a_missing_attribute_is_named_with_its_module_file():
    with pytest.raises(PluginNotFound, match=r"cannot import 'trainer.losses:NoSuchLoss': module 'trainer.losses' "
                                             r"\(.*trainer/losses.py\) has no attribute 'NoSuchLoss'$") as err:
        load_object("trainer.losses:NoSuchLoss")
    assert err.value.missing_module is None


def test_a_setting_names_itself_and_its_builtins():
    with pytest.raises(ValueError, match=r"loss.type 'grpo' not in \['direct_double_sided_is', 'icepop_ppo'\] and "
                                         r"not an import path \(package.module:Name or package.module.Name\)"):
        build_loss(LossConfig(type="grpo"))
    with pytest.raises(PluginNotFound, match=r"^trainer.backend: cannot import 'my_pkg.Backend': no module named "
                                             r"'my_pkg' \(built-ins: \['megatron', 'torch'\]\)$"):
        make_trainer_backend(TrainerConfig(backend="my_pkg.Backend"), None)
    with pytest.raises(ValueError, match="is not an import path"):
        load_object("NoModule")


def test_a_module_that_exists_but_fails_to_import_raises_its_own_error(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin.py").write_text("import not_installed_dependency\nclass Loss: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="not_installed_dependency") as err:
        load_object("broken_plugin:Loss")
    assert not isinstance(err.value, PluginNotFound)
    sys.modules.pop("broken_plugin", None)


def test_every_plugin_point_loads_a_users_class_by_import_path():
    loss_cfg, trainer_cfg = LossConfig(type=f"{HERE}:UserPlugin"), TrainerConfig(backend=f"{HERE}.UserPlugin")
    rollout_cfg, orchestrator_cfg = RolloutConfig(backend=f"{HERE}:UserPlugin"), OrchestratorConfig(
        sessions=f"{HERE}.UserPlugin")
    push_cfg, sandbox_cfg = WeightPushConfig(method=f"{HERE}:UserPlugin"), SandboxConfig(type=f"{HERE}.UserPlugin")
    http = object()
    built = {
        "loss.type": build_loss(loss_cfg),
        "trainer.backend": make_trainer_backend(trainer_cfg, "model section", 7),
        "rollout.backend": make_engine_backend(rollout_cfg),
        "orchestrator.sessions": make_sessions(orchestrator_cfg, http),
        "weight_push.method": WeightSync(push_cfg, store=None, weights_dir=Path("w")).pusher,
        "sandbox type": make_sandbox_backend(sandbox_cfg),
    }
    assert {point: obj.args for point, obj in built.items() if isinstance(obj, UserPlugin)} == {
        "loss.type": (loss_cfg,), "trainer.backend": (trainer_cfg, "model section", 7),
        "rollout.backend": (rollout_cfg,), "orchestrator.sessions": (orchestrator_cfg, http),
        "weight_push.method": (push_cfg,), "sandbox type": (sandbox_cfg,)}
    assert isinstance(WeightSync(WeightPushConfig(), store=None, weights_dir=Path("w")).pusher, DiskPusher)


def test_the_warmup_env_is_a_users_class_by_import_path(tmp_path):
    cfg = WarmupConfig(steps=1, batch_size=2, env=f"{HERE}:UserDemoEnv", env_options={"reply": "2"})
    out = warmup(load_model_section("tiny"), cfg, str(tmp_path / "warmup"), seed=3)
    assert UserDemoEnv.requested == [(2, 3)] and (Path(out) / "config.json").is_file()
