"""`mcore-rl bench`: a config file that is not YAML is one line naming file:line:col, exit 2
(`CONFIG_ERROR_EXIT`, as in every command), before anything is built or started."""

import pytest

from mcore_rl.cli import main


@pytest.mark.parametrize("bench", ["sync", "logprob", "rollout", "step"])
def test_yaml_syntax_error_is_one_line(tmp_path, capsys, bench):
    bad = tmp_path / "bench.yaml"
    bad.write_text("repeats: 1\nmodel: [tiny\nother: 2\n")  # line 3, col 6: the list is open
    assert main(["bench", bench, "--config", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"mcore-rl bench {bench}: config error: {bad}:3:6: "), line
    assert "Traceback" not in captured.err and "<unicode string>" not in captured.err
