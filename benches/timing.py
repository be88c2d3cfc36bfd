"""Timing shared by the benchmark scripts (pytorch.py, resnet50.py, bert.py): the Rust
side writes this file next to the script it runs, which imports it."""
import statistics
import sys
import time


def timed(step, samples):
    """(median, 25th, 75th percentile, first call) in ms, after the first call."""
    started = time.perf_counter()
    step()
    first = (time.perf_counter() - started) * 1e3
    times = []
    for _ in range(max(samples, 1)):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    times.sort()
    at = lambda fraction: times[round((len(times) - 1) * fraction)]
    return statistics.median(times), at(0.25), at(0.75), first


def print_row(index, name, measure):
    """Prints the line of option `name` on batch `index`: the fields `measure()` gives
    (median, 25th, 75th percentile and first call in ms, then anything else), or
    `unavailable` and why, when it raises (an option that fails is a row)."""
    try:
        fields = [f"{field:.3f}" if isinstance(field, float) else str(field) for field in measure()]
        print("\t".join([str(index), name, *fields]))
    except Exception as error:  # noqa: BLE001
        why = f"{type(error).__name__}: {error}".splitlines()[0]
        print(f"{index}\t{name}\tunavailable\t{why}")
    sys.stdout.flush()
