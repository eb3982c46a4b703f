"""A service's section from `--config FILE` and the flags generated from its dataclass (asyncrl/section_flags.py)."""

import argparse
import json
from dataclasses import fields

import pytest

from asyncrl.config import OrchestratorConfig, field_docs, is_secret
from asyncrl.section_flags import add_section_flags, parse_section


def parser(names=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="svc")
    add_section_flags(p, OrchestratorConfig, names)
    return p


def test_flags_override_the_file_field_by_field(tmp_path):
    path = tmp_path / "orchestrator.json"
    path.write_text(json.dumps({"max_in_flight": 7, "group_size": 2, "sampling": {"temperature": 0.5}}))
    section, _ = parse_section(parser({"domain_weights": "--weights"}), OrchestratorConfig, [
        "--config", str(path), "--group-size", "4", "--sampling-max-new-tokens", "64", "--weights", "swe=2,search=1",
        "--dynamic-sampling-enabled", "--max-turns-by-env", "swe=3"])
    assert (section.max_in_flight, section.group_size) == (7, 4)  # from the file, then the flag
    assert (section.sampling.temperature, section.sampling.max_new_tokens) == (0.5, 64)
    assert section.domain_weights == {"swe": 2.0, "search": 1.0} and section.max_turns_by_env == {"swe": 3}
    assert section.dynamic_sampling.enabled is True


def test_a_bad_value_is_a_usage_error_naming_its_field(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_section(parser(), OrchestratorConfig, ["--max-in-flight", "many"])
    assert exit_.value.code == 2 and "max_in_flight" in capsys.readouterr().err


def test_help_shows_each_field_docstring_and_no_secret_flag(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    docs = field_docs(OrchestratorConfig)
    for f in fields(OrchestratorConfig):
        flag = "--" + f.name.replace("_", "-")
        if is_secret(f):
            assert flag + " " not in shown, f.name
        else:
            assert flag in shown and docs[f.name].split(". ")[0][:40] in shown, f.name
