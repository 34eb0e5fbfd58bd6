"""Timing and reporting shared by every benchmark family.

Times are medians of CUDA-event-timed runs, each after overwriting a 256 MB buffer so the 60 MB
L2 holds none of the operands, and after a GPU sleep that covers the host's enqueueing of the run
(see bench_ms). Effective bandwidth = bytes the op must move / time; every figure
is also given as a fraction of the device-to-device copy bandwidth measured in the same run.
"""
import csv
import math
import os
import statistics
import sys
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_L2_FLUSH_BYTES = 256 * 2**20
# ~0.5 ms at the H200's clock: longer than any op's host work (autograd, Python wrappers), so the
# start event fires only once the op is already queued behind it.
_HOST_COVER_CYCLES = 1_000_000
_flush_buffer = None


def _flush_l2():
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    _flush_buffer.zero_()


def bench_ms(fn, warmup_ms=25.0, rep_ms=100.0, min_reps=5, max_reps=200):
    """Median milliseconds of fn() with a cold L2."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 3, 1e-3)
    for _ in range(int(warmup_ms / estimate)):
        fn()
    reps = max(min_reps, min(max_reps, int(rep_ms / estimate)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        _flush_l2()
        # Without it, host work that outlasts the flush leaves the GPU idle inside the timed
        # region: in a long benchmark process (compiled peers, Liger) the backward tables came out
        # 15-50 points of copy below the same kernels timed alone (session-4 notes).
        torch.cuda._sleep(_HOST_COVER_CYCLES)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _copy_thunk(n_bytes):
    """A device-to-device copy of n_bytes (random bytes, so no zero-page shortcut)."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def copy_bandwidth_gbs(n_bytes=2**30):
    """Device-to-device copy bandwidth (bytes read + written) in GB/s: the ceiling of this run."""
    return 2 * n_bytes / bench_ms(_copy_thunk(n_bytes)) / 1e6


# The benchmarks' tensors move 64-512 MiB each way (2^26 bf16 elements: 128 MiB): at those sizes a
# kernel's fixed costs (its start, its last wave's drain) weigh more than in the 1 GiB reference
# copy, so the copy of the same bytes is timed too (H200, session 16: 94% of the reference at 128
# MiB each way, 86-89% at 64 MiB).
COPY_SIZES = (2**26, 2**27, 2**28, 2**29)


def copy_table(report):
    """The copy at each of COPY_SIZES, as a table of the report (its % of the reference copy)."""
    for n_bytes in COPY_SIZES:
        report.measure("device-to-device copy at the benchmarks' sizes", f"{n_bytes >> 20} MiB each way",
                       {"copy": _copy_thunk(n_bytes)}, n_bytes=2 * n_bytes)
        torch.cuda.empty_cache()


def gbs(n_bytes, ms):
    return n_bytes / ms / 1e6 if ms and ms > 0 else float("nan")


def backward_thunk(fn, inputs):
    """A callable that runs only the backward of fn(*inputs): the graph is built once (fresh leaf
    copies of the inputs, a random output gradient) and retained between calls."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


# Every compiled peer recompiles its code once per shape, dtype and requires_grad (static shapes,
# as eager and fusedops run them): dozens of times per benchmark family, past dynamo's default
# limit of 8, beyond which fullgraph=True fails and the peer would go missing.
_RECOMPILE_LIMIT = 256


def try_compile(fn):
    """torch.compile(fn) with static shapes, or None where inductor cannot run here."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    try:
        return torch.compile(fn, fullgraph=True, dynamic=False)
    except Exception:  # noqa: BLE001 - a peer that cannot be built is reported as missing
        return None


def liger():
    """The liger_kernel.ops module family, or None when Liger is not installed."""
    try:
        import liger_kernel.ops as liger_ops  # noqa: F401

        return liger_ops
    except Exception:  # noqa: BLE001
        return None


def liger_state():
    """Which Liger the peer columns come from, or why they are absent (for the report's header)."""
    if liger() is None:
        return "Liger not installed: no Liger columns (carry .whl/ to the GPU machine)"
    try:
        from importlib.metadata import version

        return f"Liger {version('liger-kernel')}"
    except Exception:  # noqa: BLE001 - installed without metadata (a --target copy)
        return "Liger installed (version unknown)"


def progress(items, desc):
    """A one-line text progress bar on stderr."""
    items = list(items)
    total, started = len(items), time.time()
    for i, item in enumerate(items):
        filled = int(30 * i / max(total, 1))
        sys.stderr.write(f"\r{desc:<28} [{'#' * filled}{'.' * (30 - filled)}] {i}/{total} {time.time() - started:5.0f}s")
        sys.stderr.flush()
        yield item
    sys.stderr.write(f"\r{desc:<28} [{'#' * 30}] {total}/{total} {time.time() - started:5.0f}s\n")


class Report:
    """Rows of one benchmark run: (table, case, implementation) -> time and rate."""

    def __init__(self, copy_gbs, stem):
        """stem: the files' name under bench/results/. measure() saves the tables there after every
        case, so a run cut short keeps every case it measured; write() adds the plots."""
        self.copy_gbs = copy_gbs
        self.stem = stem
        self.rows = []
        self.note = ""

    def add(self, table, case, impl, ms, n_bytes=None, flops=None):
        row = {"table": table, "case": case, "impl": impl, "ms": ms}
        if n_bytes is not None:
            row["GB/s"] = gbs(n_bytes, ms)
            row["% copy"] = 100 * row["GB/s"] / self.copy_gbs
        if flops is not None:
            row["TFLOP/s"] = flops / ms / 1e9 if ms else float("nan")
        self.rows.append(row)

    def host_overhead(self, table, case, impls, calls=10_000):
        """Host time per call (µs as ms/1000) of each implementation on tiny tensors: `calls` calls
        timed with a host clock, synchronized once at the end."""
        for name, fn in impls.items():
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            self.add(table, case, name, (time.perf_counter() - started) * 1e3 / calls)

    def measure(self, table, case, impls, n_bytes=None, flops=None):
        """Times each available implementation (name -> callable or None) and adds its row."""
        for name, fn in impls.items():
            if fn is None:
                continue
            try:
                ms = bench_ms(fn)
            except Exception as error:  # noqa: BLE001 - a failing peer is reported, not fatal
                print(f"\n{table} {case} {name}: failed ({type(error).__name__}: {str(error)[:120]})", file=sys.stderr)
                ms = float("nan")
            self.add(table, case, name, ms, n_bytes, flops)
        self._write_tables()

    def tables(self):
        order = []
        for row in self.rows:
            if row["table"] not in order:
                order.append(row["table"])
        return order

    def markdown(self):
        lines = [f"Copy bandwidth measured in this run: **{self.copy_gbs:.0f} GB/s** (read + write).", ""]
        for table in self.tables():
            rows = [r for r in self.rows if r["table"] == table]
            impls = list(dict.fromkeys(r["impl"] for r in rows))
            cases = list(dict.fromkeys(r["case"] for r in rows))
            metric = "TFLOP/s" if "TFLOP/s" in rows[0] else "GB/s" if "GB/s" in rows[0] else None
            legend = f"{metric} (and % of copy bandwidth) · time in ms" if metric else "time per call"
            lines += [f"### {table}", "", legend, ""]
            lines.append("| case | " + " | ".join(impls) + " |")
            lines.append("|---|" + "---|" * len(impls))
            for case in cases:
                cells = []
                for impl in impls:
                    row = next((r for r in rows if r["case"] == case and r["impl"] == impl), None)
                    if row is None or math.isnan(row["ms"]):
                        cells.append("—")
                    elif metric is None:
                        cells.append(f"{row['ms'] * 1e3:.2f} µs")
                    elif metric == "GB/s" and "% copy" in row:
                        cells.append(f"{row['GB/s']:.0f} ({row['% copy']:.0f}%) · {row['ms']:.3f}")
                    else:
                        cells.append(f"{row[metric]:.0f} · {row['ms']:.3f}")
                lines.append(f"| {case} | " + " | ".join(cells) + " |")
            lines.append("")
        return "\n".join(lines)

    def write(self):
        """Writes <stem>.md, <stem>.csv and one <stem>_<table>.png per table under bench/results/."""
        md_path = self._write_tables()
        self._plot()
        return md_path

    def _write_tables(self):
        os.makedirs(RESULTS, exist_ok=True)
        md_path = os.path.join(RESULTS, self.stem + ".md")
        with open(md_path, "w") as f:
            f.write(f"# fusedops benchmark — {torch.cuda.get_device_name()}, torch {torch.__version__}\n\n")
            f.write(f"{self.note}\n\n" if self.note else "")
            f.write(self.markdown())
        keys = ["table", "case", "impl", "ms", "GB/s", "% copy", "TFLOP/s"]
        with open(os.path.join(RESULTS, self.stem + ".csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(self.rows)
        return md_path

    def _plot(self):
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        for table in self.tables():
            rows = [r for r in self.rows if r["table"] == table]
            metric = "TFLOP/s" if "TFLOP/s" in rows[0] else "GB/s" if "GB/s" in rows[0] else "ms"
            cases = list(dict.fromkeys(r["case"] for r in rows))
            fig, ax = plt.subplots(figsize=(max(6, len(cases) * 0.9), 4))
            for impl in dict.fromkeys(r["impl"] for r in rows):
                values = [next((r[metric] for r in rows if r["case"] == c and r["impl"] == impl), float("nan")) for c in cases]
                ax.plot(range(len(cases)), values, marker="o", label=impl)
            if metric == "GB/s":
                ax.axhline(self.copy_gbs, color="gray", linestyle="--", label="copy")
            ax.set_xticks(range(len(cases)))
            ax.set_xticklabels(cases, rotation=45, ha="right", fontsize=7)
            ax.set_ylabel(metric)
            ax.set_title(table, fontsize=9)
            ax.legend(fontsize=7)
            fig.tight_layout()
            safe = "".join(ch if ch.isalnum() else "_" for ch in table).strip("_")
            fig.savefig(os.path.join(RESULTS, f"{self.stem}_{safe}.png"), dpi=110)
            plt.close(fig)
