"""The two lines a conversion prints to launch the proxy (launch flags, accelerators), written and read here."""
from __future__ import annotations

import re
import shlex

FLAGS_PREFIX = "launch flags: "
ACCELERATORS_PREFIX = "accelerators: "


def launch_lines(flags: str, source_world: int, target) -> list[str]:
    """The converter's closing lines: the flags that load the proxy, then the accelerators before and after."""
    return [f"{FLAGS_PREFIX}{flags}",
            f"{ACCELERATORS_PREFIX}{source_world} -> {target.world_size} "
            f"(TP={target.tp} x PP={target.pp} x DP={target.dp}, EP={target.ep})"]


def read_launch(text: str, where: str = "the converter's output") -> tuple[int, list[str]]:
    """(accelerators, launch flags as argv) from a conversion's printed output; the last conversion in `text` wins.
    ValueError naming `where` when either line is missing."""
    flags = re.findall(rf"^{FLAGS_PREFIX}(.*)$", text, re.M)
    world = re.findall(rf"^{ACCELERATORS_PREFIX}\d+ -> (\d+) ", text, re.M)
    if not flags or not world:
        raise ValueError(f"{where}: no '{FLAGS_PREFIX.strip()}' / '{ACCELERATORS_PREFIX.strip()}' line")
    return int(world[-1]), shlex.split(flags[-1])
