"""`tierserve train router` and `tierserve eval router`: the learned router trained on, and
all routers scored on, paired `tierserve eval tasks --json` outcomes of both tiers.

`add_train_router` registers `router` under whichever `tierserve train` parser owns the
training stages and `add_eval_router` registers `router` under `tierserve eval`.
"""

import argparse
from pathlib import Path


def _add_outcome_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--full", type=Path, required=True, help="`tierserve eval tasks --json` of the full tier"
    )
    parser.add_argument(
        "--highspeed",
        type=Path,
        required=True,
        help="`tierserve eval tasks --json` of the highspeed tier, on the same tasks",
    )


def run_eval_router(args: argparse.Namespace) -> None:
    from router.evaluation import curve, format_report, random_curve
    from router.heuristic import HeuristicPolicy, LengthPolicy
    from router.learned import LearnedPolicy
    from router.outcomes import load_outcomes

    outcomes = load_outcomes(args.full, args.highspeed)
    policies = [HeuristicPolicy(), LengthPolicy()]
    if args.router.exists():
        policies.insert(0, LearnedPolicy.load(args.router))
    else:
        print(f"no learned router at {args.router}: evaluating the baselines only")
    curves = [curve(p.name, [p.score(o.request) for o in outcomes], outcomes) for p in policies]
    print(format_report([*curves, random_curve(len(outcomes))], outcomes))


def run_train_router(args: argparse.Namespace) -> None:
    from router.learned import train
    from router.outcomes import load_outcomes

    outcomes = load_outcomes(args.full, args.highspeed)
    # The label is the gain of calling the full tier (it passes where highspeed fails), as
    # RouteLLM labels "the strong model wins": with "highspeed fails" alone, the tasks both
    # tiers fail rank first and waste full-tier calls.
    needed = [o.full_passed and not o.highspeed_passed for o in outcomes]
    policy = train([o.request for o in outcomes], needed, args.target_full_share)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    policy.save(args.out)
    scores = [policy.score(o.request) for o in outcomes]
    accuracy = sum((s >= 0.5) == f for s, f in zip(scores, needed, strict=True)) / len(needed)
    share = sum(s >= policy.threshold for s in scores) / len(scores)
    print(
        f"{args.out}: {len(outcomes)} paired tasks, the full tier needed (it passes, highspeed "
        f"fails) on {sum(needed)}; "
        f"training accuracy {100 * accuracy:.1f}%; threshold {policy.threshold:.4f} sends "
        f"{100 * share:.1f}% to full (target {100 * args.target_full_share:.0f}%)"
    )


def _share(text: str) -> float:
    share = float(text)
    if not 0.0 <= share <= 1.0:
        raise argparse.ArgumentTypeError(f"a share is in [0, 1], got {text}")
    return share


def add_eval_router(evals: argparse._SubParsersAction) -> None:
    parser = evals.add_parser(
        "router", help="the routers' quality-vs-cost curves on paired outcomes of both tiers"
    )
    _add_outcome_args(parser)
    parser.add_argument(
        "--router", type=Path, default=Path("models/router.npz"), help="a learned router"
    )
    parser.set_defaults(run=run_eval_router)


def add_train_router(actions: argparse._SubParsersAction) -> None:
    router = actions.add_parser(
        "router", help="train the learned router on both tiers' eval outcomes"
    )
    _add_outcome_args(router)
    router.add_argument("--out", type=Path, default=Path("models/router.npz"))
    router.add_argument(
        "--target-full-share",
        type=_share,
        default=0.5,
        help="the share of requests the calibrated threshold sends to the full tier",
    )
    router.set_defaults(run=run_train_router)
