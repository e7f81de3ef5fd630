"""The run's picture: latency percentiles and output throughput against concurrency (or request rate), per endpoint."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E latency"))
STYLES = {"p50": ("-", "o"), "p90": ("--", "s"), "p99": (":", "^")}


def plot_summary(summary: dict, path: str) -> None:
    results = summary["results"]
    endpoints = list(dict.fromkeys(r["endpoint"] for r in results))
    mode = results[0]["level"]["mode"] if results else "concurrency"
    xlabel = "concurrency (streams in flight)" if mode == "concurrency" else "request rate (requests/s)"
    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(4.2 * (len(PANELS) + 1), 4.4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for e_index, endpoint in enumerate(endpoints):
        rows = sorted((r for r in results if r["endpoint"] == endpoint), key=lambda r: r["level"]["value"])
        xs = [r["level"]["value"] for r in rows]
        colour = colours[e_index % len(colours)]
        for ax, (key, title) in zip(axes, PANELS):
            for q, (style, marker) in STYLES.items():
                ys = [r["summary"][key][q] * 1000 if r["summary"][key][q] is not None else float("nan") for r in rows]
                ax.plot(xs, ys, style, marker=marker, color=colour, label=f"{endpoint} {q}")
            ax.set_title(f"{title} (ms)")
        throughput = [r["summary"]["output_throughput"] if r["summary"]["output_throughput"] is not None else float("nan") for r in rows]
        axes[-1].plot(xs, throughput, "-", marker="o", color=colour, label=endpoint)
        axes[-1].set_title("output tokens/s")
    levels = sorted({r["level"]["value"] for r in results})
    for ax in axes:
        ax.set_xlabel(xlabel)
        if mode == "concurrency":
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [f"{v:g}" for v in levels])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.13, top=0.86, wspace=0.25)
    workload = summary["workload"]
    state = "complete" if summary.get("complete") else "INCOMPLETE"
    commit = (summary["provenance"]["git"].get("commit") or "?")[:10]
    load = summary["provenance"]["machine"].get("load_average")
    load_text = f" · load {load[0]:.1f} at start" if load else ""
    fig.suptitle(f"{workload['name']} ({workload['output_tokens']} output tokens, ignore_eos={workload['ignore_eos']}) · commit {commit}{load_text} · {state}")
    fig.savefig(path, dpi=110)
    plt.close(fig)
