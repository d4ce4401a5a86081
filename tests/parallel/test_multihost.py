"""Multi-process training with real processes on CPU (jax.distributed, gloo collectives), and the
launcher (`python -m glm5_jax.launch`).

One uninterrupted 1-process x 4-device run is the reference; a 2-process x 2-device run over the
same mesh (data=2 across the processes, fsdp=2 inside each) is SIGKILLed in process 1 after its
step-2 checkpoint (process 0 must end by itself: no launcher there), resumed under the launcher,
stopped by SIGTERM to process 1 alone (both processes stop after the same step and save), and
finished on 1 process. Every step's loss equals the reference's to 1e-6 relative: the 4-device
reductions (the loss, the gradient norm) sum in another order across processes (gloo) than inside
one (2 processes x 1 device against 1 x 2 match bit for bit: a sum of two is the same either way).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glm5_jax.launch import free_port
from glm5_jax.parallel.distributed import initialize_distributed, multi_process_environment

pytestmark = pytest.mark.xdist_group("multihost")  # four train.py runs, two of them 2 processes

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
HEARTBEAT = 8  # seconds; the killed run's process 0 must end within it (the default is 60)


def train_arguments(workdir, data_glob):
    return ["train.py", f"--config=tests/train_config.py:mesh:{data_glob}", f"--workdir={workdir}",
            "--config.mesh.data=2", "--config.mesh.fsdp=2", f"--config.num_train_steps={STEPS}",
            "--config.checkpoint_every=2", "--config.data.validation_fraction=0.0",  # no evaluation
            f"--heartbeat_timeout={HEARTBEAT}"]


def with_devices(count: int, **extra) -> dict:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", ""))
    return {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={count}", **extra}


def losses(workdir) -> dict[int, float]:
    path = Path(workdir) / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    steps = [line["step"] for line in lines if "loss" in line]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def assert_close(got: dict, expected: dict, steps) -> None:
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=0), (step, got, expected)


def wait_for(predicate, processes, what, timeout=240):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        statuses = [process.poll() for process in processes]
        assert statuses.count(None) == len(statuses), f"exited before {what}: {statuses}"
        time.sleep(0.05)


def test_launcher_prefixes_output_and_ends_every_process_when_one_fails(tmp_path):
    script = tmp_path / "child.py"  # a .py command runs with this Python
    script.write_text(
        "import os, sys, time\n"
        "index = int(os.environ['JAX_PROCESS_ID'])\n"
        "print('env', index, os.environ['JAX_NUM_PROCESSES'], os.environ['JAX_COORDINATOR_ADDRESS'],\n"
        "      os.environ['XLA_FLAGS'], flush=True)\n"
        "print('bar 1\\rbar 2', flush=True)\n"
        "print('pid', os.getpid(), file=sys.stderr, flush=True)\n"
        "if index == 1:\n"
        "    time.sleep(0.5)\n"
        "    sys.exit(3)\n"
        "time.sleep(120)\n")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "glm5_jax.launch", "--processes", "3", "--devices-per-process", "2",
         "--port", "0", "--", str(script)], cwd=ROOT, capture_output=True, timeout=60,
        env={**os.environ, "XLA_FLAGS": "--foo --xla_force_host_platform_device_count=8"})
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()  # "\r" kept
    assert time.monotonic() - started < 30  # SIGTERM ends the sleeping processes, no grace needed
    assert result.returncode == 3, result.stderr
    assert "launch: process 1 failed (exit status 3); ending processes 0, 2" in result.stderr
    for index in range(3):
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"[{index}] env"))
        _, _, _, count, address, *flags = line.split()
        assert count == "3" and re.fullmatch(r"127\.0\.0\.1:\d+", address)
        assert flags == ["--foo", "--xla_force_host_platform_device_count=2"]
        assert f"[{index}] bar 1\r[{index}] bar 2\n" in result.stdout
    pids = [int(pid) for pid in re.findall(r"^\[\d\] pid (\d+)$", result.stderr, re.MULTILINE)]
    assert len(pids) == 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_two_processes_train_like_one_survive_sigkill_and_resume_on_either_count(tmp_path, data_glob):
    # 1. The reference: one process, four devices, uninterrupted.
    reference = tmp_path / "reference"
    result = subprocess.run([sys.executable, *train_arguments(reference, data_glob)], cwd=ROOT,
                            env=with_devices(4), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    expected = losses(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))

    # 2. Two processes x two devices, started as a cluster would (no launcher); SIGKILL process 1
    # once checkpoint 2 is complete. Process 0 must end by itself: the heartbeat timeout.
    workdir = tmp_path / "run"
    coordinator = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port('127.0.0.1')}", "JAX_NUM_PROCESSES": "2"}
    logs = [(tmp_path / f"process{index}.out", tmp_path / f"process{index}.err") for index in range(2)]
    processes = [subprocess.Popen(
        [sys.executable, *train_arguments(workdir, data_glob)], cwd=ROOT,
        env=with_devices(2, **coordinator, JAX_PROCESS_ID=str(index)),
        stdout=logs[index][0].open("w"), stderr=logs[index][1].open("w")) for index in range(2)]
    try:
        wait_for(lambda: (workdir / "checkpoints" / "2").is_dir(), processes, "checkpoint 2")
        processes[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        processes[0].wait(timeout=60)
        seconds_to_exit = time.monotonic() - killed
    finally:
        for process in processes:
            process.kill()
            process.wait()
    errors = logs[0][1].read_text()
    assert processes[0].returncode != 0
    assert "JAX distributed service detected fatal errors" in errors or "process 0 of 2:" in errors, errors
    print(f"process 0 ended {seconds_to_exit:.1f} s after process 1's SIGKILL (heartbeat {HEARTBEAT} s)")
    assert logs[1][0].read_text() == ""  # only process 0 prints
    assert not list(workdir.glob(".write-test*"))
    killed_losses = losses(workdir)
    assert 2 <= max(killed_losses) < STEPS, "the run ended before the SIGKILL"
    assert_close(killed_losses, expected, killed_losses)

    # 3. The launcher resumes it on 2 processes; SIGTERM to process 1 alone: both stop after the
    # same step, save it, and exit cleanly.
    outputs = tmp_path / "launch.out", tmp_path / "launch.err"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "glm5_jax.launch", "--processes", "2", "--devices-per-process", "2", "--",
         *train_arguments(workdir, data_glob), "--distributed=on"], cwd=ROOT, env=with_devices(1),
        stdout=outputs[0].open("w"), stderr=outputs[1].open("w"))
    try:
        wait_for(lambda: "pids" in outputs[1].read_text(), [launcher], "the launcher's pids")
        pids = [int(pid) for pid in re.search(r"pids ([\d ]+)\)", outputs[1].read_text()).group(1).split()]
        # Steps logged before the kill stay in metrics.jsonl until the resumed run truncates them.
        wait_for(lambda: max(losses(workdir)) >= max(killed_losses) + 3, [launcher], "resumed steps")
        os.kill(pids[1], signal.SIGTERM)
        launcher.wait(timeout=120)
    finally:
        launcher.kill()
        launcher.wait()
    output = outputs[0].read_text()
    assert launcher.returncode == 0, output + outputs[1].read_text()
    assert "resuming at step 2" in output
    stopped = int(re.search(r"\[0\] a stop signal to another process: saved checkpoint at step (\d+)",
                            output).group(1))
    assert stopped < STEPS, "the run ended before the SIGTERM"
    assert (workdir / "checkpoints" / str(stopped)).is_dir()
    assert sorted(losses(workdir)) == list(range(1, stopped + 1))

    # 4. One process (four devices) resumes the 2-process checkpoint and finishes the run.
    result = subprocess.run([sys.executable, *train_arguments(workdir, data_glob)], cwd=ROOT,
                            env=with_devices(4), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resuming at step {stopped}" in result.stdout
    got = losses(workdir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_close(got, expected, got)


def test_a_batch_that_does_not_divide_over_the_mesh_is_named(tmp_path, data_glob):
    result = subprocess.run(
        [sys.executable, *train_arguments(tmp_path / "run", data_glob), "--config.mesh.fsdp=1",
         "--config.mesh.data=4", "--config.batch_size=6"],
        cwd=ROOT, env=with_devices(4), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert ("error: bad config: batch_size=6 and data.seq_len=32 must divide over the mesh: rows 4 ways, "
            "positions 1") in result.stderr


def test_which_environments_start_a_multi_process_run():
    slurm = dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="node[1-2]", SLURM_PROCID="0", SLURM_LOCALID="0")
    assert multi_process_environment({}) is None
    assert multi_process_environment({"JAX_COORDINATOR_ADDRESS": "h:1"}) == "JAX_COORDINATOR_ADDRESS"
    assert multi_process_environment({**slurm, "SLURM_NTASKS": "2"}) == "SLURM"
    assert multi_process_environment({**slurm, "SLURM_NTASKS": "1"}) is None  # one task
    assert multi_process_environment({"SLURM_JOB_ID": "7"}) is None  # a batch script outside srun
    assert multi_process_environment({"OMPI_COMM_WORLD_SIZE": "4"}) == "Open MPI"
    assert multi_process_environment({"TPU_WORKER_HOSTNAMES": "w0,w1"}) == "Cloud TPU"
    assert multi_process_environment({"TPU_WORKER_HOSTNAMES": "localhost"}) is None
    with pytest.MonkeyPatch.context() as patch:  # off: one process whatever the environment says
        patch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
        assert initialize_distributed(mode="off") is False
        with pytest.raises(ValueError, match="'sometimes' is not one of"):
            initialize_distributed(mode="sometimes")
