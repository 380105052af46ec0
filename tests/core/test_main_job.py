"""The README's main job trains, reports, samples, saves, and resumes when run again."""
import os
import subprocess
import sys


def run_demo(workdir):
    cmd = [sys.executable, "-m", "redco_zoo_lm.demo", "--workdir", workdir, "--n_epochs", "1",
           "--hidden_size", "32"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)


def test_main_job_trains_samples_saves_and_resumes(workdir):
    first = run_demo(workdir)
    assert "mesh: {'dp': 4, 'mp': 2}" in first.stdout
    loss = float(first.stdout.split("eval loss ")[1].split(",")[0])
    assert loss < 3.5  # uniform over 256 bytes would be 5.55
    assert "sample: The import statement" in first.stdout
    assert "epoch 1/1" in first.stderr  # the progress bar
    assert os.listdir(os.path.join(workdir, "ckpts")) == ["step_107"]

    second = run_demo(workdir)
    assert "Resumed from" in second.stdout and "step 107" in second.stdout
    assert float(second.stdout.split("eval loss ")[1].split(",")[0]) == loss
