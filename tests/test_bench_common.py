"""tools/_bench_common.py: the helpers every benchmark prints its command, CPU time and checks
with (issue 34, "Benchmarks that reproduce")."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

import _bench_common as bc  # noqa: E402

#: The benchmarks that must print their command line, CPU time and checks through the helpers.
BENCHMARKS = ("bench_length_sync.py", "bench_scale.py", "bench_packing.py", "bench_schedule.py",
              "bench_window_mix_memory.py",
              "bench_image_header.py", "bench_index.py")


def _cost(lengths: list[float]) -> float:
    return sum(L + L * L / 4096 for L in lengths)


def test_lost_compute_figures_per_micro_batch_per_step_and_padding_by_tokens() -> None:
    # 2 ranks, 4 micro-batches of 2 samples; M = 2: two steps.
    steps = [
        [[100, 100], [300, 100]],
        [[300, 100], [100, 100]],   # per step the ranks' sums are equal: 0 idle per step
        [[1000, 1000], [1000, 1000]],
        [[4000, 0], [2000, 2000]],  # a ragged micro-batch: its empty slot is not padding
    ]
    got = bc.lost_compute_figures(steps, micro_batches_per_step=2)
    per_mb = []
    for step in steps:
        costs = [_cost(b) for b in step]
        per_mb.append(1 - sum(costs) / len(costs) / max(costs))
    assert got["idle_micro_batch"] == pytest.approx(float(np.mean(per_mb)))
    sums = [[_cost(steps[0][r]) + _cost(steps[1][r]) for r in range(2)],
            [_cost(steps[2][r]) + _cost(steps[3][r]) for r in range(2)]]
    assert sums[0][0] == pytest.approx(sums[0][1])
    assert got["idle_step"] == pytest.approx(np.mean([1 - np.mean(s) / max(s) for s in sums]))
    assert got["optimizer_steps"] == 2
    padded = real = 0.0
    for step in steps:
        for b in step:
            full = [L for L in b if L > 0]
            padded += len(full) * max(full)
            real += sum(full)
    assert got["padding_tokens"] == pytest.approx(1 - real / padded)
    # the mean of per-micro-batch ratios differs: the figure is weighted by tokens
    ratios = np.mean([1 - sum(b) / (len(b) * max(b)) for step in steps for b in step])
    assert abs(got["padding_tokens"] - ratios) > 1e-3


def test_lost_compute_figures_partial_step_left_out() -> None:
    steps = [[[10], [20]], [[20], [10]], [[5], [50]]]
    got = bc.lost_compute_figures(steps, micro_batches_per_step=2)
    assert got["optimizer_steps"] == 1
    assert got["idle_step"] == pytest.approx(0.0)
    assert np.isnan(bc.lost_compute_figures(steps, micro_batches_per_step=4)["idle_step"])


def test_command_line_quotes_and_relativises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "tools" / "bench_x.py"
    assert bc.command_line([str(script), "--out", "a b", "--quick"]) == \
        "python tools/bench_x.py --out 'a b' --quick"


def test_timed_counts_cpu_of_children() -> None:
    with bc.timed() as t:
        subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"],
                       check=True)
    assert t.cpu > 0.05  # the child's CPU time, reaped by run()
    assert t.wall >= t.cpu * 0.1


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=TOOLS,
                          capture_output=True, text=True, check=False)


def test_load_dependent_never_fails_and_check_fails_the_run() -> None:
    done = _run("""
        from _bench_common import begin, finish, load_dependent, check
        start = begin(["tools/bench_x.py", "--quick"])
        load_dependent("pool against no pool", False, "CPU-time ratio 0.5, wall 0.3")
        check("idle", True, "0.4% <= 0.5%")
        finish(start)
    """)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "$ python tools/bench_x.py --quick"
    assert ("load-dependent: pool against no pool: CPU-time ratio 0.5, wall 0.3, outside the "
            "expectation (not a failure)") in lines
    assert "check: idle: 0.4% <= 0.5%: ok" in lines
    assert lines[-1].startswith("(total: CPU ") and ", wall " in lines[-1]
    failed = _run("""
        from _bench_common import begin, finish, check
        start = begin(["tools/bench_x.py"])
        check("every step exact", False, "worst step 2 samples off")
        finish(start)
    """)
    assert failed.returncode == 1
    assert "check FAILED: every step exact: worst step 2 samples off" in failed.stdout


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_prints_command_and_totals_through_the_helpers(name: str) -> None:
    """Each benchmark's main() calls begin() first and finish() on every way out, and reports
    timing expectations with load_dependent (never an assert or SystemExit)."""
    tree = ast.parse((TOOLS / name).read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    first = main.body[1] if isinstance(main.body[0], ast.Expr) and isinstance(
        main.body[0].value, ast.Constant) else main.body[0]
    assert "begin()" in ast.unparse(first), f"{name}: main() does not start with begin()"
    returns = [n for n in ast.walk(main) if isinstance(n, ast.Return)]
    calls = ast.unparse(main)
    assert calls.count("finish(start)") >= 1 + len(returns), f"{name}: a return skips finish()"
    source = (TOOLS / name).read_text()
    assert "SystemExit" not in source and "\n    assert " not in source


def test_machine_speed_names_both_reference_operations_with_their_sizes() -> None:
    """The benchmarks that report planning CPU print this line beside it: both operations,
    their sizes and CPU milliseconds (numbers, not placeholders)."""
    line = bc.machine_speed(n=1 << 12, repeats=2)
    assert line.startswith("this machine: a stable sort of 4,096 int64 keys takes ")
    assert "a random gather of 4,096 lengths" in line
    figures = [float(x) for x in line.replace(",", "").split() if x.replace(".", "").isdigit()]
    assert len(figures) == 4 and all(f >= 0 for f in figures[1::2])


def test_machine_speed_says_which_sort_the_planners_take_for_runs() -> None:
    """The sort of keys in runs is timed once per process (runs_sort_kind): the line says which
    one won, and deciding it there keeps its timing out of the first plan's CPU."""
    from energon_ordering.planned.sort_order import runs_sort_kind

    line = bc.machine_speed(n=1 << 12, repeats=1)
    want = "stable" if runs_sort_kind() == "stable" else "vectorised default"
    assert line.endswith(f"the planners sort keys in runs by numpy's {want} sort")
