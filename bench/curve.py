"""Section 9 of BENCHMARKS.md from one `bench bloat` JSON line on stdin: the sizes of
once.entries and of each of its indexes along the run."""
import json
import sys

r = json.loads(sys.stdin.read())
mb = lambda b: "%.1f" % (b / 1e6)
print("| after cycles | heap MB | indexes MB | entries_queue_idx | entries_pkey | entries_running_idx | once.attempts MB | dead rows | autovacuums |")
print("|---|---|---|---|---|---|---|---|---|")
for s in r["sizes"]:
    each = {k.split(".")[-1]: v for k, v in s["index_bytes_each"].items()}
    print("| %d | %s | %s | %s | %s | %s | %s | %d | %d |" % (
        s["cycles"], mb(s["heap_bytes"]), mb(s["index_bytes"]), mb(each["entries_queue_idx"]),
        mb(each["entries_pkey"]), mb(each["entries_running_idx"]), mb(s["attempts_bytes"]),
        s["dead_tuples"], s["autovacuums"]))
print()
print("%d cycles in %.0f s (%.0f cycles/s), %d autovacuums of once.entries."
      % (r["cycles"], r["seconds"], r["cycles"] / r["seconds"], r["sizes"][-1]["autovacuums"]))
