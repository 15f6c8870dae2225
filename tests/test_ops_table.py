from pathlib import Path

from onnxgrad.ops_table import readme_with_table

README = Path(__file__).parent.parent / "README.md"


def test_readme_ops_table_is_current():
    text = README.read_text()
    assert readme_with_table(text) == text, "the supported-ops table is stale: run `make ops-table`"
