"""Is anything else competing for this machine? Load samples before, during and after timing, and the environment.

Three signals, each from a window between two ``snapshot()`` calls (Linux /proc; elsewhere they read None):
- others_cores:  CPU time the machine's CPUs (those this process may run on, where its affinity is narrower) spent
                 busy minus this process's own CPU time (its finished children's, e.g. the llama.cpp peers,
                 and what the HF peers' live child spent inside calls, included), per wall second (another job
                 using the cores we time on);
- runq_share:    seconds our threads were runnable but waited for a CPU, per wall second (/proc/self/task/*/schedstat:
                 more runnable threads than cores);
- steal_cores:   time the hypervisor gave our vCPUs to someone else, per wall second.
A window is *busy* when any signal passes its threshold. Timing on a busy machine is distorted 10-50x, so the
report says so loudly and no cost curve measured then is cached.
"""
from __future__ import annotations

import glob
import os
import platform
import resource
import time

import torch

from graft_block.engine import libc

OTHERS_CORES = 0.25  # a quarter of a core used by other processes, on average over the window
RUNQ_SHARE = 0.10  # our threads waited for a CPU 10% of the wall time
STEAL_CORES = 0.10
MIN_WINDOW_S = 0.3  # shorter windows are too coarse for /proc/stat's 10 ms ticks: pooled, not judged alone

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC_STAT = "/proc/stat"


def usable_cpus() -> set[int] | None:
    """The CPUs this process (and the children it starts) may run on; None where the OS does not say."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _proc_stat() -> tuple[float, float] | tuple[None, None]:
    """(busy seconds, steal seconds) since boot of the CPUs this process may run on (all of them, the first line,
    when its affinity is not narrower): a job pinned to other cores (taskset, a cpuset) competes for nothing."""
    mine = usable_cpus()
    try:
        with open(PROC_STAT) as fh:
            lines = [line.split() for line in fh if line.startswith("cpu")]
        rows = [lines[0][1:]]
        per_cpu = {int(f[0][3:]): f[1:] for f in lines[1:]}
        if mine and set(per_cpu) - mine and mine <= set(per_cpu):
            rows = [per_cpu[c] for c in sorted(mine)]
        busy = steal = 0
        for row in rows:
            user, nice, system, _idle, _iowait, irq, softirq, st = ([int(x) for x in row] + [0] * 8)[:8]
            busy += user + nice + system + irq + softirq
            steal += st
    except (OSError, ValueError, IndexError):
        return None, None
    return busy / _TICK, steal / _TICK


def _runq_wait() -> float | None:
    """Seconds this process's threads have waited on a run queue (sum over live threads)."""
    total, found = 0, False
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as fh:
                total += int(fh.read().split()[1])
            found = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended between glob and open
    return total / 1e9 if found else None


_CREDITED: dict[int, float] = {}  # live children's CPU seconds spent on this run's behalf (eval/peers.py)
_REAPED_OFFSET = 0.0  # keeps own CPU continuous when such a child is reaped (see ``forget``)


def process_cpu(pid: int) -> float | None:
    """CPU seconds a live (or not yet reaped) process has used, its own and its reaped children's (None: unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return sum(int(x) for x in fields[11:15]) / _TICK  # utime, stime, cutime, cstime
    except (OSError, ValueError, IndexError):
        return None


def credit(pid: int, seconds: float) -> None:
    """Count ``seconds`` of a live child's CPU (a call it served) as this process's own, until ``forget``."""
    _CREDITED[pid] = _CREDITED.get(pid, 0.0) + max(seconds, 0.0)


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (``os.times()``): read it before reaping one, for ``forget``."""
    t = os.times()
    return t.children_user + t.children_system


def forget(pid: int, reaped_s: float = 0.0) -> None:
    """Call right after reaping the child, with the CPU its reaping added to ``children_cpu()``: its calls stay
    counted as ours and nothing else of it is, so a window around the reap reads no jump."""
    global _REAPED_OFFSET
    _REAPED_OFFSET += _CREDITED.pop(pid, 0.0) - reaped_s


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def snapshot() -> dict:
    busy, steal = _proc_stat()
    # finished child processes (the llama.cpp peers) and the calls of live ones are this run's own work
    return {"wall": time.perf_counter(),
            "own_cpu": time.process_time() + children_cpu() + sum(_CREDITED.values()) + _REAPED_OFFSET,
            "busy": busy, "steal": steal, "runq": _runq_wait()}


def window(a: dict, b: dict, expected_cores: float = 0.0) -> dict:
    """The load signals between snapshots ``a`` and ``b`` (see module doc); None where /proc is unavailable.
    ``expected_cores``: CPU that others are known to use by design (sibling torchrun ranks), not held against us."""
    wall = max(b["wall"] - a["wall"], 1e-9)
    own = b["own_cpu"] - a["own_cpu"]
    out = {"wall_s": wall, "own_cpu_s": own, "others_cpu_s": None, "runq_s": None, "steal_s": None}
    if a["busy"] is not None and b["busy"] is not None:
        out["others_cpu_s"] = max(0.0, (b["busy"] - a["busy"]) - own)
        out["steal_s"] = max(0.0, b["steal"] - a["steal"])
    if a["runq"] is not None and b["runq"] is not None:
        out["runq_s"] = max(0.0, b["runq"] - a["runq"])
    return judge(out, expected_cores)


def pool(windows: list[dict], expected_cores: float = 0.0) -> dict:
    """Several windows as one (sums), judged again: how short per-record windows add up to a verdict."""
    out = {"wall_s": sum(w["wall_s"] for w in windows), "own_cpu_s": sum(w["own_cpu_s"] for w in windows)}
    for k in ("others_cpu_s", "runq_s", "steal_s"):
        vals = [w[k] for w in windows if w.get(k) is not None]
        out[k] = sum(vals) if vals else None
    return judge(out, expected_cores)


def judge(w: dict, expected_cores: float = 0.0) -> dict:
    """Add per-wall-second rates, ``busy`` (bool, or None when nothing could be read) and the reasons."""
    wall = max(w["wall_s"], 1e-9)
    rates = {"others_cores": w.get("others_cpu_s"), "runq_share": w.get("runq_s"), "steal_cores": w.get("steal_s")}
    rates = {k: (None if v is None else v / wall) for k, v in rates.items()}
    reasons = []
    if rates["others_cores"] is not None and rates["others_cores"] > OTHERS_CORES + expected_cores:
        reasons.append(f"other processes used {rates['others_cores']:.2f} cores")
    if rates["runq_share"] is not None and rates["runq_share"] > RUNQ_SHARE:
        reasons.append(f"our threads waited for a CPU {100 * rates['runq_share']:.0f}% of the time")
    if rates["steal_cores"] is not None and rates["steal_cores"] > STEAL_CORES:
        reasons.append(f"the hypervisor stole {rates['steal_cores']:.2f} cores")
    readable = any(v is not None for v in rates.values())
    judged = w["wall_s"] >= MIN_WINDOW_S
    busy = bool(reasons) if (readable and judged) else None
    return {**w, **rates, "busy": busy, "reasons": reasons if busy else []}


def idle_probe(seconds: float = 0.5, expected_cores: float = 0.0) -> dict:
    """Sleep and watch: with this process idle, every busy CPU second belongs to someone else."""
    a = snapshot()
    time.sleep(seconds)
    return {**window(a, snapshot(), expected_cores), "loadavg": loadavg()}


class LoadGuard:
    """Samples the load before (idle probe), during (``measure`` windows around each timed call) and after.

        guard = LoadGuard(); guard.before()
        with guard.measure() as w: ...   # w["load"] holds the window afterwards
        guard.after(); guard.report()    # {"busy": bool | None, "reasons": [...], "before", "during", "after"}
    """

    def __init__(self, probe_s: float = 0.5, expected_cores: float = 0.0):
        self.probe_s, self.expected_cores = probe_s, expected_cores
        self.windows: list[dict] = []
        self.before_w = self.after_w = None

    def before(self) -> dict:
        self.before_w = idle_probe(self.probe_s, self.expected_cores)
        return self.before_w

    def after(self) -> dict:
        self.after_w = idle_probe(self.probe_s, self.expected_cores)
        return self.after_w

    def measure(self):
        return _Window(self)

    def report(self, windows: list[dict] | None = None) -> dict:
        windows = self.windows if windows is None else windows
        during = pool(windows, self.expected_cores) if windows else None
        parts = {"before": self.before_w, "during": during, "after": self.after_w}
        reasons = [f"{when}: {r}" for when, w in parts.items() if w for r in w["reasons"]]
        verdicts = [w["busy"] for w in parts.values() if w and w["busy"] is not None]
        busy = None if not verdicts else any(verdicts)
        return {"busy": busy, "reasons": reasons, **parts, "thresholds": {
            "others_cores": OTHERS_CORES + self.expected_cores, "runq_share": RUNQ_SHARE, "steal_cores": STEAL_CORES}}


class _Window:
    def __init__(self, guard: LoadGuard):
        self.guard, self.load = guard, None

    def __enter__(self):
        self._a = snapshot()
        return self

    def __exit__(self, *exc):
        self.load = window(self._a, snapshot(), self.guard.expected_cores)
        self.guard.windows.append(self.load)
        return False


def busy_banner(load: dict) -> str | None:
    """The loud table-header warning, or None on a quiet (or unreadable) machine."""
    if not load or not load.get("busy"):
        return None
    return ("!!! BUSY MACHINE: something else competed for the CPU while this ran; timings and speedups are "
            "distorted (a second job skews them 10-50x). Rerun on a quiet machine.\n    "
            + "\n    ".join(load["reasons"]))


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux: the process's peak resident set so far.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def return_large_frees() -> None:
    """glibc: allocations of 4 MB or more get their own mapping and go back to the system when freed. By default
    the threshold grows with the largest block freed (up to 32 MB), and the engine's packing and the drafters'
    loading then leave freed weight-sized blocks in the heap (measured: ~40 MB of the main job's peak)."""
    c = libc()
    if c is not None:
        c.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD (fixing it also stops its growth)


def own_peak_rss_mb() -> float | None:
    """This process's peak resident set from /proc/self/status (VmHWM: its own address space since exec;
    ru_maxrss of a spawned child also carries its parent's peak from before the exec)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmHWM"))
    except (OSError, StopIteration, ValueError):
        return None


def environment() -> dict:
    import transformers

    cpus = usable_cpus()
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            # the CPUs the run could use (taskset, a cpuset), which cpu_count (the machine's) does not say
            "usable_cpus": None if cpus is None else len(cpus), "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "loadavg": loadavg()}
