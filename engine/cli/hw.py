"""`python -m engine hw [--json] [--snapshot-cost]` — chip, thermal state, memory and backends of this machine."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("hw", help="show chip, thermal state, memory and compute backends")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--snapshot-cost", action="store_true", help="also measure the cost of one memory snapshot")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.backends import probe_all
    from engine.hw import SystemMemorySource, default_chip_source, default_thermal_source, snapshot_cost_s
    from engine.hw.report import format_summary, hardware_report

    memory = SystemMemorySource()
    report = hardware_report(default_chip_source(), default_thermal_source(), memory, probe_all)
    if args.snapshot_cost:
        report["snapshot_cost_us"] = round(snapshot_cost_s(memory) * 1e6, 1)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_summary(report))
        if args.snapshot_cost:
            print(f"snapshot: {report['snapshot_cost_us']} µs per memory snapshot")
    return 0
