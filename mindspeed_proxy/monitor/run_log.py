"""One run per monitor output folder: the run id, when a launch may append to a monitor.jsonl, and how it is read.

A run has an id (its lineage), written in its `config` record and saved with the monitor's state in each
checkpoint. A launch that finds another run's records in `monitor.jsonl` appends only when it resumes that run
(it loads a checkpoint of the same id); otherwise it is refused in one line before training starts
(`RunFolderError`), so a folder never mixes two runs. A resume appends a `config` record with the same id and
`resumed_from`, the iteration it continues from; readers (`one_run`) then drop the records the interrupted
launch wrote for later steps (after its last checkpoint), so they see one continuous run.
"""
from __future__ import annotations

import json
import os
import uuid
from typing import Optional

FILE = "monitor.jsonl"


class RunFolderError(ValueError):
    """A monitor output folder that holds another run (message: one line)."""


class TwoRunsError(ValueError):
    """A monitor.jsonl that holds two runs (message: one line naming the line where the second starts)."""


def new_run_id() -> str:
    """A fresh run id (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def numbered_records(path: str) -> list[tuple[int, dict]]:
    """(1-based line, record) of every JSON object in `path`, skipping blank or truncated lines."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a launch killed mid-write
                continue
            if isinstance(record, dict):
                out.append((number, record))
    return out


def _continues(first: dict, record: dict) -> bool:
    """Whether `record` (a later config record) resumes the run whose first config record is `first`."""
    if first.get("run_id") is not None or record.get("run_id") is not None:
        return record.get("run_id") == first.get("run_id") and record.get("resumed_from") is not None
    return int(record.get("iteration") or 0) > int(first.get("iteration") or 0)  # files from before run ids


def one_run(numbered: list[tuple[int, dict]], path: str) -> list[dict]:
    """The records of the one run in a file, resumes merged; TwoRunsError when a second run starts in it."""
    first, first_line, out = None, None, []
    for number, record in numbered:
        if record.get("type") == "config":
            if first is None:
                first, first_line = record, number
            elif _continues(first, record):
                since = int(record.get("resumed_from", record.get("iteration")) or 0)
                out = [r for r in out if not isinstance(r.get("step"), int) or r["step"] <= since]
                continue
            else:
                raise TwoRunsError(
                    f"{path}:{number}: a second run starts here (run {record.get('run_id')}, after run "
                    f"{first.get('run_id')} of line {first_line}); a monitor file holds one run: split the file at "
                    "this line, and give each run its own --mechanism-monitor-output")
        out.append(record)
    return out


def last_run(path: str) -> Optional[dict]:
    """{"run_id", "line", "last_step"} of the run recorded in `path`, or None when it has no records."""
    if not os.path.isfile(path):
        return None
    numbered = numbered_records(path)
    if not numbered:
        return None
    configs = [(n, r) for n, r in numbered if r.get("type") == "config"]
    line, config = configs[-1] if configs else (numbered[0][0], {})
    steps = [r["step"] for _, r in numbered if isinstance(r.get("step"), int)]
    return {"run_id": config.get("run_id"), "line": line, "last_step": max(steps) if steps else None}


def refusal(path: str, found: dict, why: str) -> RunFolderError:
    """The one-line error for a launch that would write into another run's monitor.jsonl."""
    last = "no step yet" if found.get("last_step") is None else f"up to step {found['last_step']}"
    return RunFolderError(f"mechanism monitor: {path} already holds run {found.get('run_id')} ({last}) and {why}; "
                          "a monitor output folder holds one run: give another --mechanism-monitor-output "
                          "(config output_dir) or move that file")


class RunLog:
    """This launch's run id and the verdict on its output folder, the same on every rank.

    `open` decides what it can at construction: no earlier run, or an earlier one while no checkpoint load is
    expected (refused). With a load expected (`resume`), records are held until `loaded(saved_run_id)`: the run
    then takes the checkpoint's id, and an earlier run in the file must be that one."""

    def __init__(self, path: str, run_id: str, found: Optional[dict], resume: bool):
        self.path, self.run_id, self.found = path, run_id, found
        self.pending = resume  # records are held until the checkpoint's lineage is known
        self.resumed_from: Optional[int] = None

    @classmethod
    def open(cls, output_dir: str, world, src: int, writes_file: bool, resume: bool) -> "RunLog":
        """The verdict at construction; `world` is the process group to agree over (None: one process).
        Raises RunFolderError on every rank alike."""
        path = os.path.join(output_dir, FILE)
        payload = [new_run_id(), last_run(path) if writes_file else None]
        import torch.distributed as dist

        if world is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(world) > 1:
            dist.broadcast_object_list(payload, src=src, group=world)
        run_id, found = payload
        if found is not None and not resume:
            raise refusal(path, found, "this launch does not resume it (no --load of its checkpoint)")
        return cls(path, run_id, found, resume)

    def loaded(self, saved_run_id: Optional[str], step: Optional[int]) -> None:
        """A checkpoint was loaded (its monitor state's run id and step; None: it had none): decide while pending;
        a saved id always becomes this run's (the launch continues that run)."""
        if self.pending:
            self.pending = False
            if self.found is not None and (saved_run_id is None or saved_run_id != self.found.get("run_id")):
                what = "the loaded checkpoint has no run id (no monitor state, or one saved before run ids)" \
                    if saved_run_id is None else \
                    f"the loaded checkpoint is of run {saved_run_id}"
                raise refusal(self.path, self.found, what)
            if saved_run_id is not None:
                self.resumed_from = step if isinstance(step, int) else 0
        if saved_run_id is not None:
            self.run_id = saved_run_id

    def config_fields(self) -> dict:
        """What the config record says of the run: its id, and the iteration a resume continues from."""
        fields = {"run_id": self.run_id}
        if self.resumed_from is not None:
            fields["resumed_from"] = self.resumed_from
        return fields
