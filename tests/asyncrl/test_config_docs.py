"""Every field of every dataclass in asyncrl/config.py says what it does and its unit, in the string
literal right after it (what `--cfg job` readers, docs and the generated flags rely on)."""

import ast
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[2] / "asyncrl" / "config.py"


def fields_without_docstring(source: str) -> list[str]:
    """`Class.field` of every annotated field of a @dataclass not followed by a string literal."""
    missing = []
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ClassDef) and any(
                getattr(d, "id", getattr(d, "attr", None)) == "dataclass" for d in node.decorator_list)):
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                after = body[i + 1] if i + 1 < len(body) else None
                documented = (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                              and isinstance(after.value.value, str) and after.value.value.strip())
                if not documented:
                    missing.append(f"{node.name}.{stmt.target.id}")
    return missing


def test_the_check_finds_an_undocumented_field():
    source = '@dataclass\nclass A:\n    x: int = 1\n    """X, in s."""\n    y: int = 2\n    z: int = 3\n'
    assert fields_without_docstring(source) == ["A.y", "A.z"]


def test_every_config_field_has_a_docstring():
    missing = fields_without_docstring(CONFIG.read_text())
    assert not missing, f"{len(missing)} fields of asyncrl/config.py without a docstring: {', '.join(missing)}"
