#!/usr/bin/python3
"""plot-bench.py: the benchmark plots in docs/plots/, from `kvshare-bench GROUP --json`.

One command runs the benches and redraws every plot:

    scripts/plot-bench.py --bench build/bin/kvshare-bench [--backend PATH-to-patched-llama-server]

It runs `equal`, `handoff`, `route` and `conversation` (twice with --backend:
kvshare-decoder and that llama-server), `serve`, `scatter`, `statefile` and `load` (its
llama-server configurations with --backend, else $LLAMA_SERVER_KVSHARE) with --json,
keeps their lines in docs/plots/bench.jsonl and writes:

    handoff-cost.svg   what each route adds to writing the KV, vs prompt length (log-log), with
                       a resident provider's shared handoff beside the per-request one
    first-byte.svg     first byte by route, split into the provider's prefill and the rest; the
                       resident routes beside the per-request ones, one panel per decoder and model
    resident.svg       route overhead_ms vs prompt length, per request and resident, and where a
                       resident route's overhead goes (serve's phases)
    throughput.svg     scatter and state-file GB/s beside memcpy and plain write()/read()
    conversation.svg   a chat's first byte turn by turn: the decoder alone, the shared and file routes
    load.svg           many users at once: requests/s vs concurrent clients, one line per serve
                       configuration (cpu -np 4, hybrid -np 1 and -np 4, kvshare-decoder -np 1), and
                       their first byte p50 and p99
    load-mix.svg       streams decoding while long prompts arrive (only when the lines hold
                       `kvshare-bench load-mix --json` output, which this script does not run: it
                       needs a patched llama-server and pinned cores): the streams' p99 gap and the
                       arrivals' first byte vs the arrival interval, one line per configuration

`--groups route,conversation` runs only those groups and replaces their lines in the kept
bench.jsonl (the others stay as they were measured).

`--from FILE.jsonl` redraws from lines kept earlier without running anything. Needs
Debian's python3-matplotlib (scripts/install-deps.sh installs it), hence /usr/bin/python3
rather than whatever python3 comes first on PATH.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(os.path.dirname(HERE), "docs", "plots")
# SVGs that differ only in matplotlib's random ids and dates make noisy diffs.
matplotlib.rcParams["svg.hashsalt"] = "kvshare"
matplotlib.rcParams["svg.fonttype"] = "none"
COLORS = {"shared": "#1b7837", "shared_map": "#a6dba0", "file": "#762a83", "cpu": "#999999", "floor": "#444444",
          "remote": "#2166ac", "shared_resident": "#00441b", "file_resident": "#40004b", "resident": "#00441b"}
# A resident route is drawn hatched beside its per-request twin.
ROUTES = ("cpu", "file", "file_resident", "shared", "shared_resident", "remote")


def run_group(bench, group, extra=()):
    cmd = [bench, group, "--json", *extra]
    print("plot-bench: running %s" % " ".join(cmd), file=sys.stderr)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def load_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def of(lines, bench):
    return [line for line in lines if line.get("bench") == bench]


def save_figure(fig, out, name, stamp):
    """Stamps the run under the plot, writes out/name without a date (stable diffs), closes it."""
    fig.text(0.99, 0.01, stamp, ha="right", fontsize=7, color="#666666")
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    return path


def errorbar(ax, xs, lines, key, label, color, style="-o"):
    # A median at or below zero (a route that beat the floor in most rounds) has no place on
    # a log axis: it is left out of the line and named in the legend instead.
    below = ["%d: %.0f ms" % (x, line[key]) for x, line in zip(xs, lines) if line[key] <= 0]
    kept = [(x, line) for x, line in zip(xs, lines) if line[key] > 0]
    if below:
        label += " (median <= 0 at " + ", ".join(below) + ")"
    if not kept:
        return
    ys = [line[key] for _, line in kept]
    # A quartile at or below zero cannot be drawn either: its bar stops at a tenth of the median.
    lo = [min(0.9 * line[key], max(0.0, line[key] - line.get(key + "_p25", line[key]))) for _, line in kept]
    hi = [max(0.0, line.get(key + "_p75", line[key]) - line[key]) for _, line in kept]
    ax.errorbar([x for x, _ in kept], ys, yerr=[lo, hi], fmt=style, color=color, label=label, capsize=3)


def plot_handoff_cost(lines, out, stamp):
    equal = sorted(of(lines, "equal"), key=lambda line: line["tokens"])
    handoff = sorted(of(lines, "handoff"), key=lambda line: line["tokens"])
    if not equal:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5))
    xs = [line["tokens"] for line in equal]
    errorbar(ax, xs, equal, "file_added_ms", "file route: write + read + restore", COLORS["file"])
    errorbar(ax, xs, equal, "shared_map_added_ms", "shared route, scatter through a fresh mapping (before)",
             COLORS["shared_map"])
    errorbar(ax, xs, equal, "shared_added_ms", "shared route, scatter through the memfd (per-request provider)",
             COLORS["shared"])
    # A kept run from before issue 24 has no resident side.
    resident = [line for line in equal if "resident_added_ms" in line]
    if resident:
        errorbar(ax, [line["tokens"] for line in resident], resident, "resident_added_ms",
                 "shared route, resident provider (region mapped once)", COLORS["resident"], style="-s")
    errorbar(ax, xs, equal, "floor_ms", "floor: the scatter alone into warm memory (not added)", COLORS["floor"],
             style=":x")
    if handoff:
        hx = [line["tokens"] for line in handoff]
        ax.plot(hx, [line["shared_ms"] for line in handoff], "--", color=COLORS["shared"], alpha=0.6,
                label="handshake only (share + map + adopt, no KV written)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (Qwen3-Coder-30B-A3B shape: 96 KiB of f16 KV per token)")
    ax.set_ylabel("ms added to writing the KV (median, p25..p75)")
    ax.set_title("What the handoff adds, equal work per route")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, out, "handoff-cost.svg", stamp)


def plot_first_byte(lines, out, stamp):
    # The plain KV cache (qwen3, the default arch); other memory kinds are a table in docs/hybrid.md.
    route = [line for line in of(lines, "route") if line.get("arch", "qwen3") == "qwen3"]
    if not route:
        return None
    # One panel per decoder and generated model (a kept run from before --model is the tiny one).
    panels = sorted({(line.get("decoder", "kvshare-decoder"), line.get("model", "tiny")) for line in route})
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5), squeeze=False)
    for ax, (decoder, model) in zip(axes[0], panels):
        mine = [line for line in route
                if line.get("decoder", "kvshare-decoder") == decoder and line.get("model", "tiny") == model]
        tokens = sorted({line["tokens"] for line in mine})
        # A kept run from before the remote or resident sides has no such rows: drawn without them.
        names = [n for n in ROUTES if any(line["route"] == n for line in mine)]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            rows = [next((line for line in mine if line["tokens"] == t and line["route"] == name), None) for t in tokens]
            xs = [k + (i - (len(names) - 1) / 2) * width for k in range(len(tokens))]
            first = [row["first_byte_ms"] if row else 0 for row in rows]
            if name == "cpu":
                ax.bar(xs, first, width, color=COLORS["cpu"], label="--device cpu (the decoder prefills)")
                continue
            prefill = [row["prefill_ms"] if row else 0 for row in rows]
            overhead = [row["overhead_ms"] if row else 0 for row in rows]
            hatch = "//" if name.endswith("_resident") else None
            ax.bar(xs, prefill, width, color=COLORS[name], alpha=0.35, hatch=hatch,
                   label="%s: provider's prefill_ms" % name)
            ax.bar(xs, overhead, width, bottom=prefill, color=COLORS[name], hatch=hatch,
                   label="%s: overhead_ms (first byte - prefill)" % name)
            for x, p, o in zip(xs, prefill, overhead):
                ax.text(x, p + o, "%.0f" % o, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(tokens)))
        ax.set_xticklabels(["%d tokens" % t for t in tokens])
        ax.set_yscale("log")
        # On a log axis a bar starts where the axis does: set it below the shortest prefill, so
        # that a slow model's prefill part (where every bar is long) stays visible.
        lows = [line[key] for line in mine for key in ("prefill_ms", "first_byte_ms") if line.get(key, 0) > 0]
        if lows:
            ax.set_ylim(bottom=min(lows) / 3)
        ax.set_ylabel("ms to first byte (medians over paired rounds)")
        ax.set_title("first byte by route, decoder %s%s" % (decoder, ", ~100M model" if model == "100m" else ""))
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, out, "first-byte.svg", stamp)


def plot_resident(lines, out, stamp):
    """overhead_ms vs prompt length per request and resident; the resident routes' phases."""
    route = [line for line in of(lines, "route")
             if line.get("arch", "qwen3") == "qwen3" and line.get("model", "tiny") == "tiny"]
    if not any(line["route"].endswith("_resident") for line in route):
        return None
    decoders = sorted({line.get("decoder", "kvshare-decoder") for line in route})
    fig, axes = plt.subplots(len(decoders), 2, figsize=(13, 4.8 * len(decoders)), squeeze=False)
    for (left, right), decoder in zip(axes, decoders):
        mine = [line for line in route if line.get("decoder", "kvshare-decoder") == decoder]
        for name in ("file", "file_resident", "shared", "shared_resident"):
            series = sorted((line for line in mine if line["route"] == name), key=lambda line: line["tokens"])
            if series:
                errorbar(left, [line["tokens"] for line in series], series, "overhead_ms", name, COLORS[name],
                         style="-s" if name.endswith("_resident") else "-o")
        left.axhline(10, color=COLORS["floor"], linestyle=":", label="issue 24: resident <= 10 ms at 307 tokens")
        left.set_xscale("log")
        left.set_yscale("log")
        left.set_xlabel("prompt tokens")
        left.set_ylabel("overhead_ms = first byte - prefill_ms (median, p25..p75)")
        left.set_title("what the route adds, per request vs resident provider, decoder %s" % decoder)
        left.grid(True, which="both", alpha=0.3)
        left.legend(fontsize=7)
        # Where the overhead goes, from serve's phases: line (a kept run without it draws nothing here).
        phased = sorted((line for line in mine if "phase_provider_ms" in line and line["route"] != "remote"),
                        key=lambda line: (line["tokens"], ROUTES.index(line["route"])))
        if phased:
            parts = [("phase_tokenize_ms", "tokenize", "#bbbbbb"), ("phase_share_ms", "share", "#66c2a5"),
                     ("provider_outside_ms", "provider - prefill", "#fc8d62"),
                     ("phase_adopt_ms", "adopt / restore", "#8da0cb"),
                     ("phase_first_token_ms", "first token", "#e78ac3")]
            xs = range(len(phased))
            bottom = [0.0] * len(phased)
            for key, label, color in parts:
                ys = [max(0.0, line.get(key, 0.0)) for line in phased]
                right.bar(xs, ys, 0.7, bottom=bottom, color=color, label=label)
                bottom = [b + y for b, y in zip(bottom, ys)]
            for x, line in zip(xs, phased):
                right.text(x, bottom[x], "%.1f" % line["overhead_ms"], ha="center", va="bottom", fontsize=7)
            right.set_xticks(list(xs))
            right.set_xticklabels(["%s\n%d" % (line["route"].replace("_", "\n"), line["tokens"]) for line in phased],
                                  fontsize=6)
            right.set_ylabel("ms (medians of serve's phases; overhead_ms on top)")
            right.set_title("where overhead_ms goes")
            right.grid(True, axis="y", alpha=0.3)
            right.legend(fontsize=7)
    return save_figure(fig, out, "resident.svg", stamp)


def plot_throughput(lines, out, stamp):
    scatter = of(lines, "scatter")
    statefile = sorted(of(lines, "statefile"), key=lambda line: line["tokens"])
    if not scatter and not statefile:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    if scatter:
        labels, values, lo, hi, colors = [], [], [], [], []
        memcpy = scatter[0]
        labels.append("memcpy")
        values.append(memcpy["memcpy_gbps"])
        lo.append(memcpy["memcpy_gbps"] - memcpy.get("memcpy_gbps_p25", memcpy["memcpy_gbps"]))
        hi.append(memcpy.get("memcpy_gbps_p75", memcpy["memcpy_gbps"]) - memcpy["memcpy_gbps"])
        colors.append(COLORS["floor"])
        for line in scatter:
            labels.append("scatter %s\n(%.2fx memcpy)" % (line["case"], line["ratio"]))
            values.append(line["gbps"])
            lo.append(line["gbps"] - line.get("gbps_p25", line["gbps"]))
            hi.append(line.get("gbps_p75", line["gbps"]) - line["gbps"])
            colors.append(COLORS["shared"])
        left.bar(range(len(values)), values, yerr=[lo, hi], color=colors, capsize=4)
        left.set_xticks(range(len(values)))
        left.set_xticklabels(labels, fontsize=8)
        left.set_ylabel("GB/s of f16 cache written (median, p25..p75)")
        left.set_title("scatter at %s tokens, %s threads" % (scatter[0]["tokens"], scatter[0]["threads"]))
        left.grid(True, axis="y", alpha=0.3)
    if statefile:
        tokens = [line["tokens"] for line in statefile]
        keys = [("write_gbps", "state-file writer", COLORS["file"], 1.0),
                ("plain_write_gbps", "plain write()", COLORS["file"], 0.35),
                ("read_gbps", "state-file reader", COLORS["shared"], 1.0),
                ("plain_read_gbps", "plain read()", COLORS["shared"], 0.35)]
        width = 0.8 / len(keys)
        for i, (key, label, color, alpha) in enumerate(keys):
            xs = [k + (i - 1.5) * width for k in range(len(tokens))]
            right.bar(xs, [line[key] for line in statefile], width, color=color, alpha=alpha, label=label)
        for k, line in enumerate(statefile):
            right.text(k, max(line["write_gbps"], line["plain_write_gbps"], line["read_gbps"], line["plain_read_gbps"]),
                       "w %.2fx, r %.2fx" % (line["write_ratio"], line["read_ratio"]), ha="center", va="bottom",
                       fontsize=7)
        right.axhline(statefile[0]["memcpy_gbps"], color=COLORS["floor"], linestyle=":", label="memcpy")
        right.set_xticks(range(len(tokens)))
        right.set_xticklabels(["%d tokens" % t for t in tokens])
        right.set_ylabel("GB/s (medians of paired runs)")
        right.set_title("state files vs plain I/O of the same bytes")
        right.grid(True, axis="y", alpha=0.3)
        right.legend(fontsize=7)
    return save_figure(fig, out, "throughput.svg", stamp)


def plot_conversation(lines, out, stamp):
    rows = of(lines, "conversation")
    if not rows:
        return None
    decoders = sorted({line["decoder"] for line in rows})
    fig, axes = plt.subplots(1, len(decoders), figsize=(6.5 * len(decoders), 5), squeeze=False)
    for ax, decoder in zip(axes[0], decoders):
        mine = [line for line in rows if line["decoder"] == decoder]
        labels = {"cpu": "--device cpu (the decoder alone)", "shared": "hybrid, shared route (--handoff auto)",
                  "file": "hybrid, file route (--handoff auto)"}
        for name in ("cpu", "shared", "file"):
            series = sorted((line for line in mine if line["route"] == name), key=lambda line: line["turn"])
            if not series:
                continue
            xs = [line["turn"] for line in series]
            ys = [line["first_byte_ms"] for line in series]
            lo = [line["first_byte_ms"] - line["first_byte_ms_p25"] for line in series]
            hi = [line["first_byte_ms_p75"] - line["first_byte_ms"] for line in series]
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="-o", color=COLORS[name], label=labels[name], capsize=3)
            if name != "cpu":
                for line in series:
                    ax.annotate("H%d" % line["handed_off_rounds"] if line["handed_off_rounds"] else "F",
                                (line["turn"], line["first_byte_ms"]),
                                textcoords="offset points", xytext=(4, 4), fontsize=7, color=COLORS[name])
        tokens = {line["turn"]: line["tokens"] for line in mine if line["route"] != "cpu"}
        ax.set_xticks(sorted(tokens))
        ax.set_xticklabels(["%d\n%d tok" % (t, tokens[t]) for t in sorted(tokens)], fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("turn (prompt tokens); Hn: handed off in n rounds, F: forwarded in all")
        ax.set_ylabel("ms to first byte (median, p25..p75 over rounds)")
        ax.set_title("a chat, turn by turn, decoder %s" % decoder)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, out, "conversation.svg", stamp)


# load: one line per serve configuration ("hybrid-np4/shared"); the relay grey, hybrid green.
LOAD_STYLES = {"cpu-np1": ("#cccccc", "s"), "cpu-np4": ("#777777", "s"), "hybrid-np1": ("#a6dba0", "o"),
               "hybrid-np4": ("#1b7837", "o"), "hybrid-np4-kvu": ("#5aae61", "D"), "decoder-np1": ("#762a83", "^")}


def plot_load(lines, out, stamp):
    """requests/s vs concurrent clients per configuration; first byte p50 and p99 beside it."""
    rows = of(lines, "load")
    if not rows:
        return None
    configs = []
    for line in rows:
        if line["config"] not in configs:
            configs.append(line["config"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for config in configs:
        series = sorted((line for line in rows if line["config"] == config), key=lambda line: line["clients"])
        base, _, route = config.partition("/")
        color, marker = LOAD_STYLES.get(base, (None, "o"))
        style = "--" if route.startswith("file") else "-"
        np_ = series[0]["np"]
        unified = " -kvu" if series[0].get("kv_unified") else ""
        label = "%s %s -np %d%s%s" % (series[0]["decoder"], series[0]["device"], np_, unified,
                                      (" " + route) if route else "")
        xs = [line["clients"] for line in series]
        errorbar(left, xs, series, "rps", label, color, style=style + marker)
        right.plot(xs, [line["first_byte_ms_p50"] for line in series], style + marker, color=color,
                   label=label + " p50")
        right.plot(xs, [line["first_byte_ms_p99"] for line in series], ":" + marker, color=color, alpha=0.6,
                   label=label + " p99")
    clients = sorted({line["clients"] for line in rows})
    ratio = of(lines, "load_ratio")
    title = "requests/s, %d-token prompts, %d tokens generated" % (rows[0]["tokens"], rows[0]["n_predict"])
    if ratio:
        title += "\n" + ", ".join("hybrid -np 4 / -np 1 at %d clients (%s): %.2f" % (r["clients"], r["route"], r["ratio"])
                                  for r in ratio) + " (target >= 1.5)"
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients)
        ax.set_xticklabels([str(c) for c in clients])
        ax.set_xlabel("concurrent clients, each a closed loop")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    left.set_ylabel("completed requests / s (median, p25..p75 over rounds)")
    left.set_title(title, fontsize=9)
    left.set_ylim(bottom=0)
    right.set_yscale("log")
    right.set_ylabel("ms to first byte (p50 solid or dashed, p99 dotted)")
    right.set_title("first byte under load")
    return save_figure(fig, out, "load.svg", stamp)


def plot_load_mix(lines, out, stamp):
    """The streams' p99 inter-token gap and the arrivals' first byte vs the arrival interval."""
    rows = of(lines, "load_mix")
    if not rows:
        return None
    configs = []
    for line in rows:
        if line["config"] not in configs:
            configs.append(line["config"])
    labels = {"cpu": "--device cpu", "auto": "hybrid auto", "always": "hybrid always", "never": "hybrid never",
              "auto-slow": "hybrid auto, provider +1 s"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for config in configs:
        series = sorted((line for line in rows if line["config"] == config), key=lambda line: line["interval_ms"])
        xs = [line["interval_ms"] for line in series]
        label = labels.get(config, config)
        left.plot(xs, [line["gap_ms_p99"] for line in series], "-o", label=label)
        right.plot(xs, [line["first_byte_ms_p50"] for line in series], "-o", label=label + " p50")
        right.plot(xs, [line["first_byte_ms_p99"] for line in series], ":o", alpha=0.6, label=label + " p99")
    first = rows[0]
    left.set_title("%d stream(s) of %d tokens, %d arrival(s) of %d tokens: streams' p99 gap while they arrive"
                   % (first["streams"], first["stream_tokens"], first["arrivals"], first["tokens"]), fontsize=9)
    left.set_ylabel("ms between two pieces of a stream (p99)")
    right.set_title("arrivals' first byte")
    right.set_ylabel("ms to first byte (p50 solid, p99 dotted)")
    for ax in (left, right):
        ax.set_xlabel("ms between two arrivals")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, out, "load-mix.svg", stamp)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--bench", help="kvshare-bench to run (build/bin/kvshare-bench)")
    source.add_argument("--from", dest="from_file", help="redraw from a kept bench.jsonl")
    parser.add_argument("--backend", help="also run `route` and `conversation` with this decoder (a patched "
                        "llama-server); `load` runs its llama-server configurations with it")
    parser.add_argument("--out", default=DEFAULT_OUT, help="where the SVGs and bench.jsonl go (default docs/plots)")
    parser.add_argument("--note", default="", help="a few words on the machine, printed on every plot")
    parser.add_argument("--groups", help="run only these groups (comma-separated) and keep the other groups' "
                        "lines of OUT/bench.jsonl")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.from_file:
        lines = load_lines(args.from_file)
    else:
        all_groups = ("equal", "handoff", "route", "conversation", "serve", "scatter", "statefile", "load")
        groups = args.groups.split(",") if args.groups else list(all_groups)
        unknown = [g for g in groups if g not in all_groups]
        if unknown:
            parser.error("--groups: %s not among %s" % (", ".join(unknown), ", ".join(all_groups)))
        lines = []
        kept = os.path.join(args.out, "bench.jsonl")
        if args.groups and os.path.exists(kept):
            # The other groups' lines stay, and so does the meta line of the run that made them.
            lines = [line for line in load_lines(kept)
                     if line.get("bench", "").replace("load_mix", "load-mix").split("_")[0] not in groups]
        for group in groups:
            if group == "load":
                # One run: the llama-server configurations and kvshare-decoder's side by side.
                lines += run_group(args.bench, group, ["--backend", args.backend] if args.backend else [])
                continue
            lines += run_group(args.bench, group)
            if args.backend and group in ("route", "conversation"):
                lines += run_group(args.bench, group, ["--backend", args.backend])
        load = os.getloadavg()[0]
        meta = {"bench": "meta", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "load_before_last_group": round(load, 2), "cpus": os.cpu_count(), "note": args.note}
        if args.groups:
            meta["groups"] = groups
        lines.append(meta)
        with open(os.path.join(args.out, "bench.jsonl"), "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    # Each plot, the groups it draws, stamped with the run that measured them (the last meta
    # line naming them, else the one of a whole run); a --groups run redraws only its plots.
    plots = ((plot_handoff_cost, ["equal"]), (plot_first_byte, ["route"]), (plot_resident, ["route"]),
             (plot_throughput, ["scatter", "statefile"]), (plot_conversation, ["conversation"]),
             (plot_load, ["load"]), (plot_load_mix, ["load-mix"]))
    metas = [line for line in lines if line.get("bench") == "meta"]
    for draw, drawn in plots:
        if args.groups and not args.from_file and not set(drawn) & set(groups):
            continue
        meta = next((m for m in reversed(metas) if set(drawn) & set(m.get("groups", drawn))), {})
        stamp = "%s, %s CPUs, load %s%s" % (meta.get("date", "?"), meta.get("cpus", "?"),
                                            meta.get("load_before_last_group", "?"),
                                            (", " + meta["note"]) if meta.get("note") else "")
        path = draw(lines, args.out, stamp)
        if path:
            print("plot-bench: wrote %s" % path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
