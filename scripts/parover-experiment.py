#!/usr/bin/env python3
"""Step 1 of issue 17 item 4: per-pair spread of A/A pairs of the probe's cpu
job, run back to back (sequential, as `corral-bench overhead` does today)
against run at the same time, each `corral run` process pinned to one of
the two CPUs (taskset), CPUs swapped every round. Both kinds interleaved in
one run. Usage: parover-experiment.py CORRAL ROUNDS UNITS [UNIT_ITERS]"""
import math, statistics as st, subprocess, sys, time

corral, rounds, units = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
iters = int(sys.argv[4]) if len(sys.argv) > 4 else 20000
# PAROVER_SETSID=1: each run in its own session, so its own autogroup (the
# kernel shares CPU between autogroups: two runs of one group on the two
# CPUs would split one group's share between them on a loaded host)
import os
NEWSESS = os.environ.get("PAROVER_SETSID") == "1"
cmd = ["run", "--vcpus", "1", "--memory", "32", "--cmdline",
       f"probe.mode=work probe.units={units} probe.unit_iters={iters}"]

def start(cpu):
    pre = ["taskset", "-c", str(cpu)] if cpu is not None else []
    return subprocess.Popen(pre + [corral] + cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=NEWSESS)

def us(p):
    out, _ = p.communicate()
    for l in out.splitlines():
        if l.startswith("PROBE-RESULT"):
            for kv in l.split():
                if kv.startswith("us="):
                    return int(kv[3:]) / 1e6
    raise SystemExit("no PROBE-RESULT: " + out[-300:])

seq, conc, seqpin = [], [], []
us(start(None))  # warm-up
t0 = time.time()
for r in range(rounds):
    x = r % 2
    kinds = ["seq", "conc", "seqpin"] if r % 2 == 0 else ["seqpin", "conc", "seq"]
    for k in kinds:
        if k == "seq":
            a = us(start(None)); b = us(start(None)); seq.append((a, b))
        elif k == "seqpin":  # both on one CPU, back to back
            a = us(start(x)); b = us(start(x)); seqpin.append((a, b))
        else:
            pa, pb = start(x), start(1 - x)
            a, b = us(pa), us(pb)  # a ran on CPU x
            conc.append((a, b))
el = time.time() - t0

def report(name, pairs):
    la = [math.log(a) for a, _ in pairs]; lb = [math.log(b) for _, b in pairs]
    d = [y - x for x, y in zip(la, lb)]
    sd = st.stdev(d); n = len(d)
    med = st.median(d); mad = 1.4826 * st.median([abs(v - med) for v in d])
    corr = st.correlation(la, lb)
    half = 1.96 * sd / math.sqrt(n) * 100
    print(f"{name:7} n={n:3} mean job {st.mean(a for a, _ in pairs):.3f}/{st.mean(b for _, b in pairs):.3f} s  "
          f"log-ratio mean {st.mean(d)*100:+.2f} %  sd {sd*100:.2f} %  MAD-sd {mad*100:.2f} %  "
          f"corr {corr:.3f}  ~±{half:.2f} % (95 %)  job sd {st.stdev(la)*100:.2f} %")

print(f"{rounds} rounds in {el:.0f} s; units={units} unit_iters={iters}")
report("seq", seq); report("seqpin", seqpin); report("conc", conc)
# concurrent, split by which CPU ran the first job (per-CPU bias)
print("conc CPU1/CPU0 log-ratio mean (bias of the CPUs):",
      f"{st.mean((math.log(b/a) if i%2==0 else math.log(a/b)) for i,(a,b) in enumerate(conc))*100:+.2f} %")
for k, p in [("seq", seq), ("seqpin", seqpin), ("conc", conc)]:
    print(k, " ".join(f"{a:.3f}/{b:.3f}" for a, b in p))
# concurrent with the CPU bias taken out (the CPU1/CPU0 log-ratio's sd)
c = [(math.log(b/a) if i%2==0 else math.log(a/b)) for i,(a,b) in enumerate(conc)]
print(f"conc CPU1/CPU0 sd {st.stdev(c)*100:.2f} %")
