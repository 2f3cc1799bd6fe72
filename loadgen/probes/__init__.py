"""One-off probes: each measured one mechanism in isolation, and its finding is written down in docs/benchmarks/.
They stay runnable (`python -m academus.loadgen.probes.<name>`) so a finding can be checked again; the benches a
user runs live one level up, in `academus.loadgen`."""
