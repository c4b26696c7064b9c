#!/usr/bin/env python3
"""Plot bus bandwidth against message size from cohort-bench JSON files (PNG).

    python3 bench/plot_busbw.py out.json [more.json ...] -o busbw.png

Draws, per file, cohort's out-of-place and in-place busbw and, when the file has them,
the raw engine's busbw (dashed): the gap between the two is the wrapper's overhead.
Uses Debian's gnuplot (apt-get install gnuplot-nox) when present, else python3-matplotlib.
Only the standard library is needed besides one of those two.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile


def load(path):
    with open(path) as f:
        doc = json.load(f)
    if doc.get("tool") != "cohort-bench" or "rows" not in doc:
        sys.exit(f"{path}: not a cohort-bench result file")
    label = f"{doc.get('operation', '?')} {doc.get('backend', '?')} x{doc.get('world', '?')} {doc.get('dtype', '')}"
    series = {"cohort out-of-place": [], "cohort in-place": [], "raw engine": []}
    for row in doc["rows"]:
        size = row["bytes"]
        series["cohort out-of-place"].append((size, row.get("busbw_GBps")))
        if row.get("inplace_busbw_GBps") is not None:
            series["cohort in-place"].append((size, row["inplace_busbw_GBps"]))
        if row.get("raw_busbw_GBps") is not None:
            series["raw engine"].append((size, row["raw_busbw_GBps"]))
    return label, {name: points for name, points in series.items() if points}


def plot_gnuplot(datasets, output, title):
    with tempfile.TemporaryDirectory() as tmp:
        commands = [
            "set terminal pngcairo size 1000,600 noenhanced font 'sans,10'" if gnuplot_has("pngcairo") else
            "set terminal png size 1000,600 noenhanced",
            f"set output '{output}'",
            f"set title '{title}'",
            "set logscale x 2",
            "set format x '%.0b%B'",
            "set xlabel 'message size (bytes, full buffer)'",
            "set ylabel 'bus bandwidth (GB/s)'",
            "set grid",
            "set key left top",
        ]
        plots = []
        index = 0
        for label, series in datasets:
            for name, points in series.items():
                data = os.path.join(tmp, f"s{index}.dat")
                with open(data, "w") as f:
                    for size, value in points:
                        f.write(f"{size} {value}\n")
                style = "dashtype 2" if name == "raw engine" else "dashtype 1"
                plots.append(f"'{data}' using 1:2 with linespoints {style} title '{label}: {name}'")
                index += 1
        commands.append("plot " + ", ".join(plots))
        subprocess.run(["gnuplot"], input="\n".join(commands) + "\n", text=True, check=True)


def gnuplot_has(terminal):
    try:
        out = subprocess.run(["gnuplot", "-e", "set terminal"], capture_output=True, text=True).stdout
        out += subprocess.run(["gnuplot", "-e", "set terminal"], capture_output=True, text=True).stderr
    except OSError:
        return False
    return terminal in out


def plot_matplotlib(datasets, output, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 6))
    for label, series in datasets:
        for name, points in series.items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, "--" if name == "raw engine" else "-", marker="o", label=f"{label}: {name}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes, full buffer)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(output, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="cohort-bench --json files")
    parser.add_argument("-o", "--output", default="busbw.png", help="PNG to write (default busbw.png)")
    parser.add_argument("--title", default="cohort-bench: bus bandwidth against size")
    parser.add_argument("--engine", choices=["auto", "gnuplot", "matplotlib"], default="auto")
    args = parser.parse_args()
    datasets = [load(path) for path in args.files]
    engine = args.engine
    if engine == "auto":
        engine = "gnuplot" if shutil.which("gnuplot") else "matplotlib"
    if engine == "gnuplot":
        plot_gnuplot(datasets, args.output, args.title)
    else:
        try:
            plot_matplotlib(datasets, args.output, args.title)
        except ImportError:
            sys.exit("neither gnuplot nor matplotlib found: apt-get install gnuplot-nox (or python3-matplotlib)")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
