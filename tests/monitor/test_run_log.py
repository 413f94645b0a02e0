"""One run per monitor.jsonl (monitor/run_log.py): the readers' merge of a resume and refusal of a second run, and
the writer's verdicts, on files written record by record here (the trainer tests cover real runs)."""
import json

import pytest

from mindspeed_proxy.monitor.run_log import RunFolderError, RunLog, TwoRunsError, last_run, numbered_records, one_run


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _samples(*steps):
    return [{"type": "sample", "family": "router", "step": s, "layers": {}} for s in steps]


def test_a_resume_replaces_the_steps_after_its_checkpoint(tmp_path):
    records = [{"type": "config", "run_id": "a", "iteration": 0}, *_samples(2, 4, 6, 8),
               {"type": "alert", "step": 8}, {"type": "monitor-error", "statistic": "x"},
               {"type": "config", "run_id": "a", "iteration": 0, "resumed_from": 4}, *_samples(6, 8)]
    path = _write(tmp_path / "monitor.jsonl", records)
    merged = one_run(numbered_records(path), path)
    assert [r["step"] for r in merged if r["type"] == "sample"] == [2, 4, 6, 8]
    assert [r["type"] for r in merged].count("config") == 1 and not any(r["type"] == "alert" for r in merged)
    assert any(r["type"] == "monitor-error" for r in merged)  # records without a step are kept
    assert last_run(path) == {"run_id": "a", "line": 8, "last_step": 8}


@pytest.mark.parametrize("second", [{"type": "config", "run_id": "b", "iteration": 0},
                                    {"type": "config", "run_id": "b", "iteration": 0, "resumed_from": 4},
                                    {"type": "config", "run_id": "a", "iteration": 0}])  # same id, not a resume
def test_a_second_run_is_refused_naming_its_line(tmp_path, second):
    path = _write(tmp_path / "monitor.jsonl", [{"type": "config", "run_id": "a"}, *_samples(2, 4), second])
    with pytest.raises(TwoRunsError, match=r"monitor.jsonl:4: a second run starts here"):
        one_run(numbered_records(path), path)


def test_files_from_before_run_ids(tmp_path):
    resumed = [{"type": "config", "iteration": 0}, *_samples(2, 4, 6), {"type": "config", "iteration": 4}, *_samples(6)]
    path = _write(tmp_path / "resumed.jsonl", resumed)
    assert [r["step"] for r in one_run(numbered_records(path), path) if r["type"] == "sample"] == [2, 4, 6]
    path = _write(tmp_path / "two.jsonl", [{"type": "config", "iteration": 0}, *_samples(2), {"type": "config"}])
    with pytest.raises(TwoRunsError, match=r"two.jsonl:3:"):
        one_run(numbered_records(path), path)


def test_verdicts_of_the_writer(tmp_path):
    _write(tmp_path / "monitor.jsonl", [{"type": "config", "run_id": "a"}, *_samples(2, 4)])
    with pytest.raises(RunFolderError, match=r"already holds run a \(up to step 4\) and this launch does not resume"):
        RunLog.open(str(tmp_path), None, 0, True, resume=False)
    assert RunLog.open(str(tmp_path), None, 0, False, resume=False).found is None  # a rank that writes no file
    log = RunLog.open(str(tmp_path), None, 0, True, resume=True)
    assert log.pending and log.run_id != "a"
    with pytest.raises(RunFolderError, match="the loaded checkpoint is of run b"):
        log.loaded("b", 4)
    log = RunLog.open(str(tmp_path), None, 0, True, resume=True)
    log.loaded("a", 4)
    assert (log.pending, log.config_fields()) == (False, {"run_id": "a", "resumed_from": 4})
    fresh = RunLog.open(str(tmp_path / "empty"), None, 0, True, resume=True)
    fresh.loaded("c", 10)  # a fresh folder: the run continues the checkpoint's run
    assert fresh.config_fields() == {"run_id": "c", "resumed_from": 10}
    fresh = RunLog.open(str(tmp_path / "empty"), None, 0, True, resume=False)
    assert not fresh.pending and "resumed_from" not in fresh.config_fields()
