"""``dflop-ds report RUN``: plots and a summary from a run's telemetry log."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflop_ds.telemetry.report import find_log, format_summary, plot_run, read_log, select_run, split_runs, summarize


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` sub-command."""
    parser = subparsers.add_parser(
        "report",
        help="plot a training run's telemetry (imbalance over steps, predicted vs observed)",
        description="Read RUN's dflop_telemetry.jsonl (a file, or a folder such as the csv_monitor "
        "output folder) and write imbalance.png and predicted_vs_observed.png.",
    )
    parser.add_argument("run", metavar="RUN", help="telemetry JSONL file or a folder containing dflop_telemetry.jsonl")
    parser.add_argument("--out", help="folder for the plots (default: next to the log)")
    parser.add_argument(
        "--run-index", type=int, default=-1, help="which run of a log that several runs appended to (default: the last)"
    )
    parser.add_argument("--run-id", help='the run with this run_id (see the records\' "run_id"); overrides --run-index')
    parser.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Write the plots, print the summary; 0 on success."""
    log = find_log(args.run)
    runs = split_runs(read_log(log))
    records = select_run(runs, args.run_id, args.run_index, str(log))
    out_dir = Path(args.out) if args.out else log.parent
    written = plot_run(records, out_dir, title=f"{log.parent.name}: microbatch imbalance")
    run_id = records[0].get("run_id")
    position = next(i for i, run in enumerate(runs) if run[0] is records[0])
    print(
        f"{log}: run {position + 1} of {len(runs)}{'' if run_id is None else f' (run_id {run_id})'},"
        f" {len(records)} steps"
    )
    print(format_summary(summarize(records)))
    for path in written:
        print(f"wrote {path}")
    return 0
