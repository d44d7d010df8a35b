"""Entry point: ``python -m shell.bench {balance,dataplane,policy,grpo,reward,revisions,async,r3,scale} [options] [--markdown]``."""

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
    dataplane = sub.add_parser("dataplane", help="store throughput and overheads against raw transports")
    dataplane.add_argument(
        "--repeats", type=int, default=30,
        help="timed rounds; each runs every transport twice (compared pairs as A B B A, order rotated) and yields one paired ratio per comparison (default 30; 60 for docs)",
    )
    dataplane.add_argument("--rows", type=int, default=256, help="rows in the payload (default 256)")
    dataplane.add_argument("--profile", action="store_true", help="also profile the adapter's put and get")
    dataplane.add_argument(
        "--tq-backend", choices=("RayObjectStore", "SimpleStorage", "MooncakeStore"), default="RayObjectStore",
        help="TransferQueue storage backend (default RayObjectStore, the runs' default; SimpleStorage is TransferQueue as shipped; MooncakeStore needs the mooncake package)",
    )
    dataplane.add_argument("--markdown", action="store_true", help="print Markdown tables")
    policy = sub.add_parser("policy", help="bytes through the driver and wall time: legacy vs data-plane policy")
    policy.add_argument("--repeats", type=int, default=3, help="timed calls per path (default 3)")
    policy.add_argument(
        "--rows", type=int, default=256, help="ragged rows in the batch (default 256; a multiple of 2 * --dp)"
    )
    policy.add_argument(
        "--lengths", choices=("lognormal", "short"), default="lognormal",
        help="row lengths: lognormal (median 700, issue 13's realistic rows; the default) or short (uniform 8..64, quick)",
    )
    policy.add_argument("--max-len", type=int, default=1024, help="longest lognormal row (default 1024)")
    policy.add_argument("--dp", type=int, default=2, help="data-parallel ranks (default 2)")
    policy.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="where the ranks run megatron-core: cpu (gloo; the default) or cuda (a GPU per rank, NCCL)",
    )
    policy.add_argument("--markdown", action="store_true", help="print Markdown tables")
    grpo = sub.add_parser("grpo", help="GRPO step time and driver bytes: data-plane vs legacy path, with parity")
    grpo.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    grpo.add_argument("--repeats", type=int, default=3, help="runs per path, order alternated (default 3)")
    grpo.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides (see python -m shell.run --help)")
    grpo.add_argument("--markdown", action="store_true", help="print Markdown tables")
    reward = sub.add_parser(
        "reward", help="the default run over several seeds: reward, entropy and step time per seed (Markdown), and the curves"
    )
    reward.add_argument("--seeds", type=int, default=3, help="number of seeds, run one after the other (default 3)")
    reward.add_argument("--steps", type=int, default=200, help="steps per run (default 200, the default run's)")
    reward.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    reward.add_argument(
        "--runs-dir", default=None,
        help="where the runs go, one folder seed<s> each (default runs/reward-<timestamp>)",
    )
    reward.add_argument("--reuse", action="store_true", help="read the runs already in --runs-dir instead of running them")
    reward.add_argument(
        "--plot", default=None, help="the PNG to write (default RUNS_DIR/reward_curve.png; the README's is docs/img/reward_curve.png)",
    )
    reward.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides (none: the default run)")
    reward.set_defaults(markdown=True)
    revisions = sub.add_parser("revisions", help="GRPO step time of this tree against another git revision, paired")
    revisions.add_argument("--base", required=True, help="the git revision to compare against (e.g. main, HEAD~3)")
    revisions.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    revisions.add_argument("--repeats", type=int, default=3, help="paired runs per transport, order alternated (default 3)")
    revisions.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides (see python -m shell.run --help)")
    revisions.add_argument("--markdown", action="store_true", help="print Markdown tables")
    asynchronous = sub.add_parser(
        "async", help="async GRPO (max_staleness 1, 2) vs sync on the generation-heavy task: throughput, time to reward, final reward"
    )
    asynchronous.add_argument("--seeds", type=int, default=3, help="paired repeats, one seed each (default 3)")
    asynchronous.add_argument("--steps", type=int, default=150, help="steps per run (default 150)")
    asynchronous.add_argument("--staleness", type=int, nargs="+", default=[1, 2], help="async max_staleness values (default 1 2)")
    asynchronous.add_argument("--target", type=float, default=0.5, help="reward for the time-to-reward column (default 0.5)")
    asynchronous.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    asynchronous.add_argument("--runs-dir", default=None, help="where the runs go (default runs/async-<timestamp>)")
    asynchronous.add_argument("--reuse", action="store_true", help="read the runs in --runs-dir instead of running them")
    asynchronous.add_argument("--plot", default=None, help="the PNG (default RUNS_DIR/async_reward.png; the README's is docs/img/async_reward.png)")
    asynchronous.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides (default: task.name=reverse)")
    asynchronous.set_defaults(markdown=True)
    r3 = sub.add_parser(
        "r3", help="MoE router replay (R3) with a bf16 rollout: routing and log-prob mismatch off vs r3, step cost, routing bytes, reward"
    )
    r3.add_argument("--seeds", type=int, default=3, help="paired repeats, one seed each (default 3)")
    r3.add_argument("--steps", type=int, default=100, help="steps per cost run (default 100)")
    r3.add_argument("--batches", type=int, default=4, help="generation batches per seed and model in the mismatch table (default 4)")
    r3.add_argument(
        "--mismatch-override", action="append", default=[], metavar="policy.model.KEY=VALUE",
        help="a setting of the mismatch table's second, routing-heavy model over its defaults (64 experts, top-8, "
        "4 layers; the rest as the run model; initial weights only); repeat for more",
    )
    r3.add_argument("--bytes-steps", type=int, default=5, help="steps of each routing-bytes run (default 5)")
    r3.add_argument(
        "--cost-steps", type=int, default=40,
        help="steps of each same-batches cost measurement, an off and an r3 trainer side by side (default 40)",
    )
    r3.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    r3.add_argument("--runs-dir", default=None, help="where the runs go (default runs/r3-<timestamp>)")
    r3.add_argument("--reuse", action="store_true", help="read the runs in --runs-dir instead of running them")
    r3.add_argument("--plot", default=None, help="the PNG (default RUNS_DIR/r3_reward.png; the docs' is docs/img/r3_reward.png)")
    r3.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides, for the runs and both mismatch models (default: 8 experts, top-2, bf16 rollout, memory store)")
    r3.set_defaults(markdown=True)
    scale = sub.add_parser(
        "scale", help="both paths across Ray nodes (bytes per node per step) and over growing batches (row sweep, DP=2)"
    )
    scale.add_argument("--nodes", type=int, default=3, help="nodes of the local cluster, the head included (default 3)")
    scale.add_argument("--steps", type=int, default=3, help="GRPO steps per path in the bytes-per-node table (default 3; 0: skip it)")
    scale.add_argument(
        "--rows", dest="sweep_rows", metavar="ROWS", default="256,1024,4096",
        help="row counts of the sweep, comma-separated (default 256,1024,4096; 'none': skip it)",
    )
    scale.add_argument("--repeats", type=int, default=3, help="paired repeats per row count, order alternated (default 3)")
    scale.add_argument("--seed", type=int, default=0, help="seed of the run and of the sweep's rows (default 0)")
    scale.add_argument("--object-store-mb", type=int, default=512, help="object store per node, MiB (default 512)")
    scale.add_argument("--num-cpus", type=int, default=4, help="logical CPUs per node (default 4)")
    scale.add_argument(
        "--max-len", type=int, default=1024,
        help="the sweep's lognormal lengths (median 700) are clipped to 16..MAX_LEN (default 1024; > 700)",
    )
    scale.add_argument(
        "--backend", choices=("tq_object_store", "transfer_queue"), default="tq_object_store",
        help="the data plane's store (default tq_object_store, the run's default; transfer_queue: SimpleStorage units on the worker nodes)",
    )
    scale.add_argument("--plot", default=None, help="write the sweep's PNG here (the docs' is docs/img/scale_rows.png)")
    scale.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides of the bytes-per-node runs")
    scale.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = parser.parse_args(argv)
    if getattr(args, "seeds", 1) < 1:
        parser.error(f"--seeds must be >= 1: got {args.seeds}")
    if getattr(args, "repeats", 1) < 1 or getattr(args, "rows", 1) < 1:
        parser.error("--repeats and --rows must be >= 1")
    report = Report(markdown=args.markdown)
    if args.name == "balance":
        from shell.bench.balance import BalanceConfig, run

        run(BalanceConfig(seeds=args.seeds), report)
    elif args.name == "dataplane":
        from shell.bench.dataplane import DataplaneConfig
        from shell.bench.dataplane import run as run_dataplane

        run_dataplane(
            DataplaneConfig(rows=args.rows, repeats=args.repeats, profile=args.profile, tq_backend=args.tq_backend), report
        )
    elif args.name == "policy":
        from shell.bench.policy import PolicyBenchConfig
        from shell.bench.policy import run as run_policy

        try:
            cfg = PolicyBenchConfig(
                rows=args.rows, repeats=args.repeats, lengths=args.lengths, max_len=args.max_len, dp=args.dp,
                device=args.device,
            )
        except ValueError as error:
            parser.error(str(error))
        if cfg.device == "cuda":
            import torch

            if torch.cuda.device_count() < cfg.dp:
                parser.error(f"--device cuda needs a GPU per rank: --dp {cfg.dp}, torch sees {torch.cuda.device_count()}")
        run_policy(cfg, report)
    elif args.name == "grpo":
        from shell.bench.grpo import GrpoBenchConfig, cuda_shortage
        from shell.bench.grpo import run as run_grpo

        cfg = GrpoBenchConfig(steps=args.steps, repeats=args.repeats, overrides=tuple(args.overrides))
        try:
            problem = cuda_shortage(cfg.overrides)
        except ValueError as error:  # a bad override (ConfigError) is a usage error, before Ray starts
            problem = str(error)
        if problem:
            parser.error(problem)
        run_grpo(cfg, report)
    elif args.name == "reward":
        import time

        from shell.bench.reward import RewardBenchConfig
        from shell.bench.reward import run as run_reward

        if args.reuse and args.runs_dir is None:
            parser.error("--reuse needs --runs-dir (the folder holding the seed<s> runs)")
        try:
            cfg = RewardBenchConfig(
                seeds=args.seeds, steps=args.steps, first_seed=args.first_seed, reuse=args.reuse,
                runs_dir=args.runs_dir or f"runs/reward-{time.strftime('%Y%m%d-%H%M%S')}",
                plot=args.plot, overrides=tuple(args.overrides),
            )
        except ValueError as error:
            parser.error(str(error))
        run_reward(cfg, report)
    elif args.name == "async":
        import time

        from shell.bench.async_grpo import AsyncBenchConfig
        from shell.bench.async_grpo import run as run_async

        if args.reuse and args.runs_dir is None:
            parser.error("--reuse needs --runs-dir (the folder holding the runs)")
        try:
            acfg = AsyncBenchConfig(
                seeds=args.seeds, steps=args.steps, staleness=tuple(args.staleness), target=args.target,
                first_seed=args.first_seed, reuse=args.reuse, plot=args.plot, overrides=tuple(args.overrides),
                runs_dir=args.runs_dir or f"runs/async-{time.strftime('%Y%m%d-%H%M%S')}",
            )
        except ValueError as error:
            parser.error(str(error))
        run_async(acfg, report)
    elif args.name == "r3":
        import time

        from shell.bench.r3 import R3BenchConfig
        from shell.bench.r3 import run as run_r3

        if args.reuse and args.runs_dir is None:
            parser.error("--reuse needs --runs-dir (the folder holding the runs)")
        try:
            rcfg = R3BenchConfig(
                seeds=args.seeds, steps=args.steps, batches=args.batches, bytes_steps=args.bytes_steps, cost_steps=args.cost_steps,
                first_seed=args.first_seed, reuse=args.reuse, plot=args.plot, overrides=tuple(args.overrides),
                mismatch_overrides=tuple(args.mismatch_override),
                runs_dir=args.runs_dir or f"runs/r3-{time.strftime('%Y%m%d-%H%M%S')}",
            )
        except ValueError as error:
            parser.error(str(error))
        run_r3(rcfg, report)
    elif args.name == "scale":
        from shell.bench.scale import ScaleConfig, parse_rows
        from shell.bench.scale import run as run_scale

        try:
            scfg = ScaleConfig(
                nodes=args.nodes, steps=args.steps, repeats=args.repeats, seed=args.seed,
                rows=() if args.sweep_rows.strip().lower() == "none" else parse_rows(args.sweep_rows),
                object_store_mb=args.object_store_mb, num_cpus=args.num_cpus, max_len=args.max_len, backend=args.backend, plot=args.plot,
                overrides=tuple(args.overrides),
            )
        except ValueError as error:
            parser.error(str(error))
        run_scale(scfg, report)
    elif args.name == "revisions":
        from shell.bench.revisions import RevisionsConfig
        from shell.bench.revisions import run as run_revisions

        run_revisions(
            RevisionsConfig(base=args.base, steps=args.steps, repeats=args.repeats, overrides=tuple(args.overrides)),
            report,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
