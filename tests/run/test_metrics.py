"""`mcore-rl plot RUN_DIR --compare OTHER_RUN_DIR`: two runs' rewards overlaid in one PNG
(synthetic metrics.jsonl files, no run needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mcore_rl.cli import main
from mcore_rl.rl.metrics import plot_compare, trailing_mean


def _write_run(run_dir, rewards):
    run_dir.mkdir()
    lines = [json.dumps({"step": i + 1, "reward_mean": r, "timing_s/gen": 0.5,
                         "timing_s/step": 1.0}) for i, r in enumerate(rewards)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _has_color(image, rgb, tol=0.02) -> bool:
    return bool((np.abs(image[..., :3] - np.asarray(rgb)) < tol).all(-1).any())


def test_trailing_mean_averages_at_most_window_values():
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert trailing_mean([0.0, 0.3, 0.6], 10) == pytest.approx([0.0, 0.15, 0.3])


def test_plot_compare_overlays_both_runs(tmp_path):
    import matplotlib.colors as mcolors
    import matplotlib.image as mpimg

    _write_run(tmp_path / "sync", [0.1 * i for i in range(10)])
    _write_run(tmp_path / "async", [0.05 * i for i in range(12)])
    assert main(["plot", str(tmp_path / "sync"), "--compare", str(tmp_path / "async")]) == 0
    assert (tmp_path / "sync" / "reward.png").is_file()  # plot_run still runs first
    image = mpimg.imread(tmp_path / "sync" / "reward_compare.png")
    assert image.shape[:2] == (400, 700)  # figsize (7, 4) at 100 dpi
    # Each run's mean line is drawn in its own opaque colour.
    assert _has_color(image, mcolors.to_rgb("tab:blue"))
    assert _has_color(image, mcolors.to_rgb("tab:orange"))


def test_single_run_chart_has_no_second_colour(tmp_path):
    """The colour check above can fail: plot_run's one-run reward.png has no orange line."""
    import matplotlib.colors as mcolors
    import matplotlib.image as mpimg

    _write_run(tmp_path / "a", [0.2, 0.4, 0.3])
    assert main(["plot", str(tmp_path / "a")]) == 0
    image = mpimg.imread(tmp_path / "a" / "reward.png")
    assert _has_color(image, mcolors.to_rgb("tab:blue"))
    assert not _has_color(image, mcolors.to_rgb("tab:orange"))


def test_plot_compare_names_a_missing_metrics_file(tmp_path):
    _write_run(tmp_path / "a", [0.2, 0.4])
    with pytest.raises(FileNotFoundError, match="nowhere/metrics.jsonl"):
        plot_compare(tmp_path / "a", tmp_path / "nowhere")


def test_plot_compare_rejects_an_empty_run(tmp_path):
    _write_run(tmp_path / "a", [0.2, 0.4])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="b/metrics.jsonl: no steps recorded"):
        plot_compare(tmp_path / "a", tmp_path / "b")
