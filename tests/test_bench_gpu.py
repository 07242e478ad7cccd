"""`python -m eval.main bench gpu` on CPU: its dry path runs every stage on tiny shapes."""

import jax
import pytest

from eval.bench_gpu import STAGES
from eval.main import main as eval_main


@pytest.mark.long
def test_bench_gpu_dry_path_runs_every_stage_and_appends_its_report(tmp_path, capsys):
    report = tmp_path / "BENCHMARKS.md"
    report.write_text("# Benchmarks\n\nearlier results\n")
    eval_main(["bench", "gpu", "--dry", "--out_dir", str(tmp_path / "out"), "--benchmarks_md", str(report)])
    printed = capsys.readouterr().out
    assert printed.startswith(f"jax {jax.__version__} (jaxlib ")  # eval.main's start-up line
    text = report.read_text()
    assert text.startswith("# Benchmarks\n\nearlier results\n")  # appended, never truncated
    assert "## GPU bench (dry run: tiny shapes on CPU, plumbing only)" in text
    for stage in STAGES:
        assert f"| {stage} | ok |" in text, stage
        assert f"### {stage}" in text
    assert "| sparse attention fwd+bwd | 128 | 64 |" in text  # kernels vs references
    assert "| kvpop | 64 |" in text and "| dense | 64 |" in text and "| dms | 64 |" in text  # decode
    assert "peak_estimate" in text  # the recipe's dry run: per-device bytes
    assert "tokens/s" in text and "MFU" in text  # the training steps
    assert "Where one more step's time goes" in text and "| category | ms | share |" in text  # its profile
    assert (tmp_path / "out" / "bench_gpu.md").read_text() in text
