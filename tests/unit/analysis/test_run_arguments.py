"""The analysis scripts on a path that is no run directory: the same one line from each."""
import pytest
from conftest import load_script


@pytest.mark.parametrize("script", ["summarize", "staleness", "throughput"])
def test_a_path_without_metrics_is_one_line_naming_it(script, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", [f"{script}.py", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit) as stop:
        load_script(script).main()
    assert stop.value.code == f"{tmp_path / 'nowhere'}: not a run directory (no metrics.jsonl)"
