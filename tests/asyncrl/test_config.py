"""Every file in configs/ composes and validates; bad keys and bad types fail naming the key."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError
from hydra.errors import ConfigCompositionException

from asyncrl.config import RunConfig, register_configs, to_dataclass

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
register_configs()


def load(*overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return to_dataclass(compose(config_name="config", overrides=list(overrides)))


GROUP_FILES = sorted(p for p in CONFIGS.glob("*/*.yaml"))


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_config_file_composes(path):
    cfg = load(f"{path.parent.name}={path.stem}")
    assert isinstance(cfg, RunConfig)


def test_defaults_are_typed():
    cfg = load()
    assert cfg.model.arch.layer_indexer_types[0] == "full"
    assert cfg.trainer.loss.type == "direct_double_sided_is"
    assert cfg.run_dir == "runs/asyncrl"
    assert load("experiment=tiny_demo").run_dir == "runs/tiny_demo"


def test_misspelt_key_names_it():
    with pytest.raises(ConfigCompositionException) as info:
        load("trainer.lr_rate=1")
    assert "lr_rate" in str(info.value.__cause__) and "TrainerConfig" in str(info.value.__cause__)


def test_wrong_type_names_key():
    with pytest.raises(ConfigCompositionException) as info:
        load("trainer.lr=abc")
    assert "trainer.lr" in str(info.value.__cause__)


def test_bad_key_inside_a_yaml_file_names_it(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "typo.yaml").write_text("backend: torch\ngroups_per_stepp: 2\n")
    with pytest.raises((ConfigCompositionException, ConfigKeyError, ConfigAttributeError, ValidationError)) as info:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
            cfg = compose(config_name="config", overrides=[f"hydra.searchpath=[file://{tmp_path}]", "trainer=typo"])
            to_dataclass(cfg)
    assert "groups_per_stepp" in str(info.value) + str(info.value.__cause__)


def test_inconsistent_model_config_names_the_field():
    with pytest.raises(ValueError, match="indexer_types must have num_hidden_layers entries"):
        load("model.arch.num_hidden_layers=3")


def test_a_checkpoint_named_by_asset_is_the_shipped_one_and_matches_the_arch():
    """The main job starts from asyncrl/assets/tiny_base (`${asset:tiny_base}`): the path resolves into the
    package, and the checkpoint was built for the experiment's arch (a change of configs/model/tiny.yaml or of
    the experiment without `python scripts/build_tiny_base.py` fails here, not in a run)."""
    from dataclasses import asdict

    from asyncrl.config import ASSETS_DIR, ModelConfig

    cfg = load("experiment=file_lookup")
    assert cfg.model.path == str(ASSETS_DIR / "tiny_base")
    shipped, arch = asdict(ModelConfig.from_pretrained(cfg.model.path)), asdict(cfg.model.arch)
    derived = {"torch_dtype", "mlp_layer_types"}  # the weights' dtype (bf16, as released); filled in from the arch
    assert {k: v for k, v in shipped.items() if k not in derived} == {k: v for k, v in arch.items() if k not in derived}
    with pytest.raises(Exception, match=r"\$\{asset:nothing\}: no .*assets/nothing \(the assets: .*tiny_base"):
        load("experiment=file_lookup", "model.path=${asset:nothing}")
