"""Print each thread of a process: tid, name, user+system CPU seconds (from /proc)."""

import os
import sys

pid = int(sys.argv[1])
tick = os.sysconf("SC_CLK_TCK")
for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    with open(f"/proc/{pid}/task/{tid}/comm") as f:
        name = f.read().strip()
    cpu = (int(fields[11]) + int(fields[12])) / tick
    print(tid, "main" if int(tid) == pid else name, f"{cpu:.2f}")
