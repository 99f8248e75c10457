"""What serve_compare prints, and the figures its result file leads with."""

from __future__ import annotations

from _results import row

from kiln.hardware import cpu_info
from kiln.timing import verdict_of

SERVERS = ("kiln-http", "kiln-grpc", "triton-http", "triton-grpc")


def cpu_line() -> str:
    """The CPU as `kiln doctor` names it, printed beside every ratio: rankings move with it."""
    cpu = cpu_info()
    return f"{cpu.model}, {cpu.logical_cores} cores"


def rows_of(result: dict) -> list[dict]:
    """Kiln serve over Triton: throughput per model × clients × protocol (above 1: Kiln
    serves more), then each lone request's P50 (above 1: Kiln's answer takes longer)."""
    rows = []
    for item in result["kiln_over_triton"]:
        r = item["throughput_ratio"]
        rows.append(row(
            f"{item['model']}, {item['clients']} client(s), {item['protocol']}: throughput "
            "kiln serve ÷ Triton", r["median"], "x", [r["min"], r["max"]],
            verdict_of(r["min"], r["max"]), model=item["model"], engine="kiln serve",
            baseline="triton", protocol=item["protocol"], clients=item["clients"],
        ))  # fmt: skip
    for model, figures in result["lone"].items():
        for protocol in ("http", "grpc"):
            over = figures.get(protocol, {}).get("over_triton")
            if over is None:
                continue
            r = over["rounds"]
            # a latency ratio: every round above 1 means kiln serve answered later
            verdict = verdict_of(1 / r["max"], 1 / r["min"])
            rows.append(row(
                f"{model}, lone request, {protocol}: P50 kiln serve ÷ Triton", over["ratio"],
                "x", [r["min"], r["max"]], verdict, model=model, engine="kiln serve",
                baseline="triton", protocol=protocol, clients=1,
            ))  # fmt: skip
    return rows


def print_cells(table: list[dict], ratios: list[dict]) -> None:
    def fig(value: dict | None, digits: int) -> str:
        if value is None:
            return f"{'—':>26}"
        return (f"{value['median']:9.{digits}f} ({value['min']:.{digits}f}–"
                f"{value['max']:.{digits}f})").ljust(26)  # fmt: skip

    print(f"\n{'model':12} {'clients':>7}  {'server':12} {'req/s (rounds)':26} "
          f"{'P50 ms (rounds)':26} {'P99 ms (rounds)':26} errors")  # fmt: skip
    for cell in sorted(table, key=lambda c: (c["model"], c["clients"], SERVERS.index(c["server"]))):
        print(f"{cell['model']:12} {cell['clients']:>7}  {cell['server']:12} "
              f"{fig(cell['rps'], 1)} {fig(cell['p50_ms'], 2)} {fig(cell['p99_ms'], 2)} "
              f"{cell['errors']}")  # fmt: skip
    for ratio in ratios:
        r = ratio["throughput_ratio"]
        print(
            f"kiln/triton throughput, {ratio['model']}, {ratio['clients']} clients, "
            f"{ratio['protocol']}: {r['median']:.2f}× ({r['min']:.2f}–{r['max']:.2f})  "
            f"[{cpu_line()}]"
        )


def print_lone(name: str, figures: dict) -> None:
    p50 = figures["p50_ms"]
    print(f"\n{name}, lone requests (P50, ms): Session.run {p50['session']:.3f}, "
          f"null twin in-process {p50['null_session']:.3f}, GET health/ready "
          f"{p50['health_http']:.3f}")  # fmt: skip
    for protocol in ("http", "grpc"):
        f = figures[protocol]
        low, high = f["ratio_rounds"]
        verdict = "within" if f["within_5pct"] else "NOT within"
        print(
            f"  kiln serve {protocol}: {p50[f'serve_{protocol}']:.3f} "
            f"(+{f['serve_minus_session_ms']:.3f} over Session.run); {protocol} cost "
            f"{f['cost_ms']:.3f} (null twin {p50[f'null_{protocol}']:.3f}); serve / (Session.run "
            f"+ cost) = {f['ratio']:.3f} (rounds {low:.3f}–{high:.3f}): {verdict} 5 %"
        )
        if "over_triton" in f:
            t = f["over_triton"]
            rounds = t["rounds"]
            print(f"  kiln serve {protocol} / Triton {protocol} (lone P50): {t['ratio']:.2f}× "
                  f"(rounds {rounds['median']:.2f}, {rounds['min']:.2f}–{rounds['max']:.2f}); "
                  f"Triton {p50[f'triton_{protocol}']:.3f} ms  [{cpu_line()}]")  # fmt: skip
