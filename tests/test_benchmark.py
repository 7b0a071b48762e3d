"""Small runs of loadtest/benchmark.py against real emulated replicas.

The mixed workload at a tenth of its size through our gateway with two policies: both tables
come out, the per-shape rows add up to the workload's rows (requests, tokens, the slowest
first token), and the requests each replica served, as read from the response ids, add up to
the requests of each shape. Two repeated runs
end with a summary that agrees with the runs' own rows.
"""

from __future__ import annotations

from tests.support import run_script


def benchmark(*args: str) -> str:
    """What `loadtest/benchmark.py ARGS` prints, after checking that it succeeded."""
    return run_script("loadtest/benchmark.py", *args)


def rows(table: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("| mixed |")
    ]


def test_mixed_workload_tables_add_up() -> None:
    output = benchmark(
        "--workloads", "mixed", "--policies", "prefix,round_robin", "--scale", "0.1",
        "--concurrency", "4",
    )  # fmt: skip
    tables = output.split("\n\n")
    assert len(tables) == 2, output
    summary, shapes = (rows(table) for table in tables)
    assert [row[1] for row in summary] == ["prefix", "round_robin"]
    for row in summary:
        policy, requests, failed = row[1], int(row[2]), int(row[3])
        assert failed == 0
        mine = [shape for shape in shapes if shape[1] == policy]
        assert {shape[2] for shape in mine} == {"shared", "customers", "conversation", "rag"}
        assert sum(int(shape[3]) for shape in mine) == requests
        assert sum(int(shape[4].replace(",", "")) for shape in mine) == int(row[4].replace(",", ""))
        for shape in mine:
            served = [int(count) for count in shape[8].split(" / ")]
            assert len(served) == 4
            assert sum(served) == int(shape[3])
        # Under a hundred requests a p99 is the slowest one, so the slowest shape's is the run's.
        assert requests < 100
        assert max(float(shape[7]) for shape in mine) == float(row[11])
    # Round robin takes the replicas in turn: the ids tell all four apart.
    per_replica = [0, 0, 0, 0]
    for shape in shapes:
        if shape[1] == "round_robin":
            for position, count in enumerate(shape[8].split(" / ")):
                per_replica[position] += int(count)
    assert max(per_replica) - min(per_replica) <= 1, per_replica


def test_repeated_runs_end_with_a_summary() -> None:
    output = benchmark(
        "--workloads", "shared", "--policies", "prefix", "--scale", "0.05", "--concurrency", "2",
        "--runs", "2",
    )  # fmt: skip
    lines = output.splitlines()
    runs = [line for line in lines if line.startswith("| shared | prefix | 8 |")]
    assert len(runs) == 2  # one row per run, 8 requests each
    summary = output.split("## Over the 2 runs")[1]
    (row,) = [line for line in summary.splitlines() if line.startswith("| shared | prefix |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2] == "2"
    hit_rates = sorted(run.split(" | ")[8] for run in runs)
    assert cells[3] in (hit_rates[0], f"{hit_rates[0]}–{hit_rates[1]}")
    each = [float(value) for value in cells[7].split(", ")]
    assert each == [float(run.strip("|").split("|")[11]) for run in runs]
