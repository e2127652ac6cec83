"""Other libraries' deprecation notices go to the run's logs; everything else still
reaches the console."""
import warnings

from async_rl.models import loading


def test_a_third_party_deprecation_goes_to_the_log_and_ours_to_the_console(tmp_path, monkeypatch):
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda *args, **kwargs: shown.append(args[0]))
    log = tmp_path / "logs" / "learner-rank0.warnings"
    loading.quiet_libraries(log)
    elsewhere = "/site-packages/transformers/modeling_utils.py"
    warnings.showwarning(FutureWarning("`is_gradient_checkpointing` is deprecated"), FutureWarning, elsewhere, 7)
    warnings.showwarning(UserWarning("something to act on"), UserWarning, elsewhere, 8)
    ours = str(loading.__file__)
    warnings.showwarning(DeprecationWarning("ours"), DeprecationWarning, ours, 9)
    assert "is_gradient_checkpointing" in log.read_text() and "modeling_utils.py:7" in log.read_text()
    assert [str(m) for m in shown] == ["something to act on", "ours"]
