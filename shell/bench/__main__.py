"""Entry point: ``python -m shell.bench {balance} [--seeds N] [--markdown]``."""

from __future__ import annotations

import argparse
import sys

from shell.bench.report import Report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shell.bench", description=__doc__)
    sub = parser.add_subparsers(dest="name", required=True)
    balance = sub.add_parser("balance", help="sharding and packing quality against baselines")
    balance.add_argument("--seeds", type=int, default=20, help="number of seeded instances per cell (default 20)")
    balance.add_argument("--markdown", action="store_true", help="print Markdown tables (for docs/benchmarks.md)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1: got {args.seeds}")
    report = Report(markdown=args.markdown)
    if args.name == "balance":
        from shell.bench.balance import BalanceConfig, run

        run(BalanceConfig(seeds=args.seeds), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
