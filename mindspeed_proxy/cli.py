"""`mindspeed-proxy COMMAND ...`: the one launcher, and the one error line every command prints on bad input.

Each command is also reachable as before (`examples/train_moe.py`, `python -m mindspeed_proxy.rl.train`,
`convert_to_proxy.py`, ...): the launcher only imports the same entry point and names itself in `prog`.
"""
import importlib
import sys
from typing import NoReturn

# name -> (module, entry function, whether it takes prog=, help); "rl" has sub-commands of its own
COMMANDS = {
    "train": ("mindspeed_proxy.training.loop", "train", True,
              "train the tiny megatron-core GPT-MoE with Megatron-LM flags (examples/train_moe.py)"),
    "rl": {
        "sft": ("mindspeed_proxy.rl.sft", "main", True, "supervised warm-up on the RL task (mindspeed_proxy.rl.sft)"),
        "train": ("mindspeed_proxy.rl.train", "main", True, "GRPO on megatron-core (mindspeed_proxy.rl.train)"),
    },
    "convert": ("mindspeed_proxy.proxy.cli", "main", True,
                "prune a Megatron MoE checkpoint into a proxy (convert_to_proxy.py)"),
    "plan": ("mindspeed_proxy.proxy.plan_cli", "main", False,
             "proxy options of a real model on a cluster (--hf-config / --load / Megatron flags)"),
    "report": ("mindspeed_proxy.report.cli", "main", False, "plots + summary of a run dir (RUN_DIR [--out DIR])"),
    "compare": ("mindspeed_proxy.report.cli", "compare_main", False, "consistency of two run dirs (RUN_A RUN_B)"),
    "replay": ("mindspeed_proxy.report.replay_cli", "main", False,
               "a run's alerts under another detector config (RUN_DIR)"),
    "calibrate": ("mindspeed_proxy.report.calibrate_cli", "main", False,
                  "detector thresholds from healthy runs (RUN_DIR... --false-alarms-per-1000-steps R --out FILE)"),
    "write-tokenizer": ("mindspeed_proxy.rl.tokenizer_dir", "main", True,
                        "a character-level HF tokenizer folder for Megatron-LM's train_rl.py (DIR)"),
    "patches": ("mindspeed_proxy.patches.__main__", "main", False, "list the patch registry (--list)"),
}


def error(prog: str, message) -> int:
    """Print one `prog: error: message` line on stderr; return 2, the exit status of bad input."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return 2


def fail(prog: str, message) -> NoReturn:
    """Print one `prog: error: message` line on stderr and exit with status 2."""
    raise SystemExit(error(prog, message))


def _usage(table: dict, prefix: str) -> None:
    print(f"usage: {prefix} {{" + ",".join(table) + "} ...", file=sys.stderr)
    for name, entry in table.items():
        text = "; ".join(f"{prefix} {name} {sub}" for sub in entry) if isinstance(entry, dict) else entry[-1]
        print(f"  {name:<10} {text}", file=sys.stderr)


def resolve(argv: list) -> tuple:
    """(entry function, prog, the command table reached, remaining argv) of the command `argv` names; the
    function is None when `argv` names none (the table is then the one whose usage to print)."""
    table, prog = COMMANDS, "mindspeed-proxy"
    while argv and argv[0] in table and isinstance(table[argv[0]], dict):
        table, prog, argv = table[argv[0]], f"{prog} {argv[0]}", argv[1:]
    if not argv or argv[0] not in table:
        return None, prog, table, argv
    module, function, takes_prog, _ = table[argv[0]]
    entry = getattr(importlib.import_module(module), function)
    prog = f"{prog} {argv[0]}"
    if takes_prog:
        return (lambda rest: entry(rest, prog=prog)), prog, table, argv[1:]
    return entry, prog, table, argv[1:]


def main(argv=None) -> int:
    """Dispatch `argv` to its command's entry point with the rest of `argv`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    entry, prog, table, rest = resolve(argv)
    if entry is None:
        _usage(table, prog)
        return 0 if rest and rest[0] in ("-h", "--help") else 2
    from mindspeed_proxy.extras import MissingExtra

    try:
        return entry(rest) or 0
    except MissingExtra as exc:
        return error(prog, exc)


if __name__ == "__main__":
    sys.exit(main())
