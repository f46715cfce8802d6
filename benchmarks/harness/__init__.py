"""The benchmarks' harness: what every experiment script shares, so that each script states only its design.

- ``grid``: run a grid of jobs under a memory budget, resumably (a job is done when its record exists);
- ``memory``: the one reader of RSS and of the machine's memory;
- ``procs``: the examples/demo.py command of a real-model run, and the runs in flight on this machine;
- ``log``: ``Log`` (a measurement's progress), ``RunnerLog`` (a runner's log, kept in ``runner.json``);
- ``tables``, ``timing``, ``machine``: markdown tables and result files, interleaved timing, the machine's description;
- ``stats``: paired differences over seeds, Student-t intervals and the power of the paired t-test;
- ``readme``: the README blocks that are copies of generated tables.

Scripts run as ``python benchmarks/NAME.py`` (this package's folder is then on the path) and import from here and from
``studies`` (the code of one experiment that outgrew its script, or that two scripts share), never from each other.
"""

from .log import Log, RunnerLog, merged_log, quiet
from .machine import host, host_id, machine_info, machine_line, uptime, utc_now
from .tables import fmt, md_table, write_results
from .timing import time_interleaved

__all__ = ["Log", "RunnerLog", "fmt", "host", "host_id", "machine_info", "machine_line", "md_table", "merged_log",
           "quiet", "time_interleaved", "uptime", "utc_now", "write_results"]
