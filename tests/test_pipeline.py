"""The resumable stages the demo, sweeps and online rounds share (workflows/pipeline.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace


def test_train_done_records_the_runs_steps_when_the_resume_took_none(tmp_path, monkeypatch):
    # A run killed while exporting its final model resumes after its last step: this session takes no
    # step, yet the model it exports has them all; train.done says so, as an uninterrupted run's does.
    from dllm_align.workflows import pipeline

    def resumed_after_the_last_step(recipe, resume, allow_changes=()):
        final = tmp_path / "final"
        final.mkdir()
        (final / "config.json").write_text("{}")
        (final / "training_summary.json").write_text(json.dumps({"steps": 3, "steps_this_session": 0}))
        return SimpleNamespace(steps=0, final_dir=final)

    monkeypatch.setattr(pipeline, "train", resumed_after_the_last_step)
    pipeline.trained_model(SimpleNamespace(output_dir=str(tmp_path)))
    assert json.loads((tmp_path / "train.done").read_text()) == {"steps": 3}
