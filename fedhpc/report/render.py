"""Tables as lists of cells, rendered to Markdown and to HTML from the same data."""

from __future__ import annotations

import html
from typing import List, Optional, Sequence

from .summary import Stat, is_accuracy

Table = List[List[str]]  # first row: the header


def fmt_value(value: float, metric: str) -> str:
    if is_accuracy(metric):
        return f"{100 * value:.2f}"
    if metric.startswith("bytes"):
        # MiB: two decimals from 1 MiB up, three significant digits below (so that a small
        # payload such as FedMix's mean data does not read 0.00).
        mib = value / 2**20
        return f"{mib:.2f}" if abs(mib) >= 1 or mib == 0 else f"{mib:.3g}"
    return f"{value:.4g}"


def fmt_stat(stat: Optional[Stat], metric: str) -> str:
    """``mean ± std`` in the metric's display unit (accuracies in %, bytes in MiB); one seed: the mean."""
    if stat is None:
        return "–"
    if stat.std is None:
        return fmt_value(stat.mean, metric)
    return f"{fmt_value(stat.mean, metric)} ± {fmt_value(stat.std, metric)}"


def unit_of(metric: str) -> str:
    return " (%)" if is_accuracy(metric) else " (MiB)" if metric.startswith("bytes") else ""


def markdown_table(table: Table) -> str:
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(cell(c) for c in table[0]) + " |",
             "|" + "|".join("---" for _ in table[0]) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in table[1:]]
    return "\n".join(lines)


def html_table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in table[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class Document:
    """A report as a sequence of blocks, written out as Markdown and as HTML."""

    def __init__(self, title: str):
        self.title = title
        self.blocks: List[tuple] = []

    def heading(self, text: str):
        self.blocks.append(("h", text))

    def para(self, text: str):
        self.blocks.append(("p", text))

    def items(self, lines: Sequence[str]):
        self.blocks.append(("ul", list(lines)))

    def table(self, table: Table):
        self.blocks.append(("table", table))

    def image(self, path: str, alt: str):
        self.blocks.append(("img", (path, alt)))

    def markdown(self) -> str:
        out = [f"# {self.title}", ""]
        for kind, body in self.blocks:
            if kind == "h":
                out += [f"## {body}", ""]
            elif kind == "p":
                out += [body, ""]
            elif kind == "ul":
                out += [f"- {line}" for line in body] + [""]
            elif kind == "table":
                out += [markdown_table(body), ""]
            elif kind == "img":
                out += [f"![{body[1]}]({body[0]})", ""]
        return "\n".join(out)

    def html(self) -> str:
        e = html.escape
        out = ["<!DOCTYPE html><html><head><meta charset='utf-8'>", f"<title>{e(self.title)}</title>",
               "<style>body{font-family:sans-serif;max-width:75em;margin:2em auto}"
               "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em;"
               "text-align:left}th{background:#f3f3f3}img{max-width:48%;margin:.5em}</style></head><body>",
               f"<h1>{e(self.title)}</h1>"]
        for kind, body in self.blocks:
            if kind == "h":
                out.append(f"<h2>{e(body)}</h2>")
            elif kind == "p":
                out.append(f"<p>{e(body)}</p>")
            elif kind == "ul":
                out.append("<ul>" + "".join(f"<li>{e(line)}</li>" for line in body) + "</ul>")
            elif kind == "table":
                out.append(html_table(body))
            elif kind == "img":
                out.append(f"<img src='{e(body[0])}' alt='{e(body[1])}'>")
        out.append("</body></html>")
        return "\n".join(out) + "\n"
