"""The monitor's outputs for one run: sinks opened on the run's folder, records held until its lineage is known.

A mixin of MechanismMonitor (and HFMonitor): `_open_run` builds the sinks after `RunLog.open` has checked the
output folder; when a checkpoint load is expected, the records emitted before it (the config record, the
faults) are held and written once the load says which run this is (`_settle`).
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from mindspeed_proxy.monitor.run_log import RunFolderError, RunLog
from mindspeed_proxy.monitor.sinks import WRITER_SINKS, JsonlSink, build_sinks, writer_dir

logger = logging.getLogger(__name__)


class RunOutputs:
    """Sinks, the run log and the held records of a monitor (needs `config`, `groups`, `is_logging_rank`)."""

    def _open_run(self, tensorboard_writer, wandb_writer, resume: bool, tensorboard_dir: Optional[str],
                  header: dict) -> None:
        """Check the output folder (RunFolderError on every rank alike), build the sinks, emit `header`."""
        cfg = self.config
        self.run_log = RunLog.open(cfg.output_dir, self.groups.world, cfg.log_rank,
                                   self.is_logging_rank and "jsonl" in cfg.sinks, resume)
        # files on the logging rank; a TensorBoard / wandb writer on whichever rank its owner created it (Megatron-LM:
        # the last rank), since every rank holds the same results
        kinds = cfg.sinks if self.is_logging_rank else [k for k in cfg.sinks if k in WRITER_SINKS]
        self.sinks = build_sinks(kinds, cfg.output_dir, tensorboard_writer, wandb_writer)
        where = os.path.abspath(tensorboard_dir) if tensorboard_dir else writer_dir(tensorboard_writer)
        if where and "tensorboard" in cfg.sinks:
            header["tensorboard_dir"] = where  # where `report` finds the run's loss
        self.last_step = header.get("iteration", 0)
        self._held: Optional[list] = [header]
        if not self.run_log.pending:
            self._release()

    def _release(self) -> None:
        held, self._held = self._held or [], None
        for record in held:
            if record.get("type") == "config":
                record = {**record, **self.run_log.config_fields()}
            self._emit(record)

    def _settle(self, saved_run_id: Optional[str], step: Optional[int], strict: bool = True) -> None:
        """The load this launch expected happened (or will not): write the held records. `strict`: a folder of
        another run raises RunFolderError; otherwise (training has started) the JSONL sink is dropped, reported."""
        if not self.run_log.pending:
            self.run_log.loaded(saved_run_id, step)
            return
        try:
            self.run_log.loaded(saved_run_id, step)
        except RunFolderError as exc:
            if strict:
                raise
            logger.error("%s; its records are not written", exc)
            self.sinks = [s for s in self.sinks if not isinstance(s, JsonlSink)]
        self._release()

    def weights_loaded(self) -> None:
        """The weights were replaced (a checkpoint load): settle the run's folder, retake the snapshots held."""
        self._settle(None, None)
        super().weights_loaded()

    def log_record(self, record: dict) -> None:
        """Write a caller's record (e.g. the injected faults) to the sinks of the logging rank."""
        self._emit(record)

    def _emit(self, record: dict) -> None:
        if self._held is not None:
            self._held.append(record)
            return
        for sink in self.sinks:
            sink.write(record)
