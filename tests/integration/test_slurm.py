"""SlurmCluster against a real single-node Slurm (Debian's slurm-wlm): the test starts
munged, slurmctld and slurmd on this machine, on loopback ports of its own, with a
configuration in a temporary directory (``SLURM_CONF``), and stops them at the end.
Workers arrive as batch jobs, tasks run on them, ``scale(jobs=0)`` cancels them."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shoal
from shoal.testing import wait_for

pytestmark = pytest.mark.timeout(180)

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "squeue")

_CONF = """\
ClusterName=shoaltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MpiDefault=none
KillWait=10
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(p: subprocess.Popen[Any]) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    missing = [d for d in DAEMONS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing or os.geteuid() != 0:
        why = f"a single-node Slurm needs root and Debian's slurm-wlm and munge (missing: {missing})"
        if os.environ.get("SHOAL_REQUIRE_SLURM"):
            pytest.fail(why)
        pytest.skip(why)
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    with open("/proc/meminfo") as f:
        total_mb = int(f.readline().split()[1]) // 1024
    conf = d / "slurm.conf"
    conf.write_text(_CONF.format(dir=d, ctld_port=_free_port(), d_port=_free_port(), memory=total_mb // 2))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started: list[subprocess.Popen[Any]] = []
    old = os.environ.get("SLURM_CONF")
    try:
        munged = shutil.which("munged") or "/usr/sbin/munged"
        started.append(subprocess.Popen(
            [munged, "-F", "-f", f"--key-file={key}", f"--socket={d / 'munge.socket'}",
             f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munge.seed'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        started.append(subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL))
        started.append(subprocess.Popen(["slurmd", "-D", "-N", "localhost"], env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL))
        # a job that runs is the proof the daemons are up (sbatch waits for it with --wait)
        ready = subprocess.run(["sbatch", "--wait", "--quiet", f"--output={d / 'ready.out'}", "--wrap", "true"],
                               env=env, capture_output=True, text=True, timeout=120)
        assert ready.returncode == 0, (ready.stderr, (d / "slurmctld.log").read_text()[-2000:])
        os.environ["SLURM_CONF"] = str(conf)  # for the cluster's sbatch, scancel and scontrol
        yield {"conf": str(conf), "dir": str(d)}
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=30)
        for p in reversed(started):
            _stop(p)


def _jobs() -> list[list[str]]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return [line.split() for line in out.splitlines()]


def test_workers_arrive_as_jobs_run_tasks_and_scale_0_cancels_them(slurm: dict[str, str], tmp_path: Path) -> None:
    with shoal.SlurmCluster(cores=1, memory="512MiB", queue="debug", walltime="00:10:00",
                            log_directory=str(tmp_path / "jobs"), job_script_prologue=["echo prologue ran"],
                            env={"OMP_NUM_THREADS": "1"},
                            scheduler_options={"host": "127.0.0.1"}) as cluster:
        script = cluster.job_script()
        for line in ("#SBATCH --cpus-per-task=1", "#SBATCH --mem=512M", "#SBATCH --time=00:10:00",
                     "#SBATCH --partition=debug", "#SBATCH --job-name=shoal-worker-0", "echo prologue ran",
                     "export OMP_NUM_THREADS=1"):
            assert line in script.splitlines(), (line, script)
        assert f"-m shoal worker {cluster.scheduler_address}" in script
        assert cluster.security.secret is not None and cluster.security.secret.decode() not in script

        cluster.scale(jobs=2)
        with shoal.Client(cluster) as c:
            c.wait_for_workers(2, timeout=120)
            jobs = _jobs()
            assert sorted(j[1] for j in jobs) == ["shoal-worker-0", "shoal-worker-1"]
            assert all(j[2] == "RUNNING" for j in jobs), jobs
            info = c.scheduler_info()["workers"]
            assert sorted(w["name"] for w in info.values()) == ["shoal-worker-0", "shoal-worker-1"]
            assert all(w["nthreads"] == 1 for w in info.values())
            # the jobs' workers run tasks and hand values to each other
            xs = c.map(lambda i: i * 10, range(20))
            total = c.submit(sum, xs)
            assert total.result(timeout=60) == sum(i * 10 for i in range(20))
            assert set(sum(c.who_has(xs).values(), [])) <= set(info)
            logs = cluster.get_logs()
            assert set(logs) == {"Scheduler", "shoal-worker-0", "shoal-worker-1"}
            assert all("shoal worker at " in logs[n] and "prologue ran" in logs[n]
                       for n in ("shoal-worker-0", "shoal-worker-1"))

            # scale(jobs=0): the jobs are cancelled, their workers left the scheduler
            jobs_before = dict(cluster.workers)
            cluster.scale(jobs=0)
            assert _jobs() == []
            assert c.scheduler_info()["workers"] == {}
            # each job's workers closed in order and the job completed: the batch process
            # (the workers' nanny) got the SIGTERM, not every process of the job at once
            after = cluster.get_logs()
            for name, job in jobs_before.items():
                assert (job.state, job.returncode) == ("COMPLETED", 0), (job.state, after[name])
                assert "second signal" not in after[name], after[name]
            # and n workers (here one per job) come back the same way
            cluster.scale(1)
            c.wait_for_workers(1, timeout=120)
            assert c.submit(lambda: 5).result(timeout=60) == 5
    assert cluster.status == "closed"
    assert _jobs() == []
    assert not os.path.exists(tmp_path / "jobs" / "secret")


def test_adapt_submits_jobs_under_load_and_cancels_idle_ones(slurm: dict[str, str], tmp_path: Path) -> None:
    with shoal.SlurmCluster(cores=1, memory="256MiB", log_directory=str(tmp_path),
                            scheduler_options={"host": "127.0.0.1"}) as cluster, shoal.Client(cluster) as c:
        # checks made one by one here (its own period is an hour): each is one decision
        adaptive = cluster.adapt(minimum=0, maximum=2, interval="1h", wait_count=2, target_duration="1s")
        try:
            check = lambda: cluster._sync(adaptive.adapt())  # noqa: E731
            futures = c.map(lambda i: i + 1, range(10))  # queued: no worker yet
            wait_for(lambda: len(cluster.scheduler.state.tasks) == 10, timeout=30, what="the graph to arrive")
            check()
            assert sorted(j[1] for j in _jobs()) == ["shoal-worker-0", "shoal-worker-1"]
            c.wait_for_workers(1, timeout=120)
            assert sorted(c.gather(futures)) == list(range(1, 11))
            del futures
            c.wait_for_workers(2, timeout=120)
            wait_for(lambda: not cluster.scheduler.state.tasks, timeout=30, what="the values to be released")
            # idle, nothing held: retired after wait_count checks in a row, not before
            check()
            assert len(_jobs()) == 2
            check()
            assert _jobs() == [] and c.scheduler_info()["workers"] == {}
        finally:
            adaptive.stop()


def test_a_job_that_sbatch_refuses_is_a_clear_error(slurm: dict[str, str], tmp_path: Path) -> None:
    with shoal.SlurmCluster(cores=1, memory="256MiB", queue="no-such-partition",
                            log_directory=str(tmp_path), scheduler_options={"host": "127.0.0.1"}) as cluster:
        with pytest.raises(shoal.DeployError, match="sbatch refused shoal-worker-0.*partition"):
            cluster.scale(jobs=1)
        assert _jobs() == []


@pytest.mark.parametrize("kwargs, says", [
    ({"cores": 0}, "cores"),
    ({"cores": 2, "processes": 3}, "processes"),
    ({"memory": 0}, "memory"),
    ({"job_name": "a b"}, "job_name"),
    ({"scheduler_options": {"prot": 1}}, "prot"),
])
def test_slurmcluster_arguments_are_checked(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises((ValueError, TypeError), match=says):
        shoal.SlurmCluster(**kwargs)


def test_a_tls_cluster_of_jobs(slurm: dict[str, str], tmp_path: Path) -> None:
    sec = shoal.Security.temporary()
    with shoal.SlurmCluster(cores=1, memory="256MiB", log_directory=str(tmp_path), security=sec,
                            scheduler_options={"host": "127.0.0.1"}) as cluster:
        assert cluster.scheduler_address.startswith("tls://")
        script = cluster.job_script()
        assert f"--tls-cert {sec.cert}" in script and f"--tls-key {sec.key}" in script
        cluster.scale(jobs=1)
        with shoal.Client(cluster) as c:
            c.wait_for_workers(1, timeout=120)
            assert all(a.startswith("tls://") for a in c.scheduler_info()["workers"])
            assert c.submit(lambda: 6 * 7).result(timeout=60) == 42
    assert _jobs() == []
