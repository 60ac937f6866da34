"""SLURM's compressed host lists: ``node[01-03,07],gpu-a[1-2]`` -> node01 node02 node03 node07 gpu-a1 gpu-a2.

The syntax (as ``scontrol show hostnames`` reads it):
  * a comma at the top level separates host expressions; commas inside brackets separate ranges;
  * a bracket holds ranges ``LO-HI`` or single numbers; a range keeps the zero padding of its
    lower bound (``[08-11]`` -> 08 09 10 11, ``[8-11]`` -> 8 9 10 11);
  * several bracket groups in one expression give every combination, leftmost slowest
    (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2).
Malformed lists raise ConfigError naming the list: a wrong rendezvous host would otherwise
show up only as a connection timeout minutes later.

    python -m fedhpc.hostlist 'node[01-03,07]'          # one host per line
    python -m fedhpc.hostlist --first "$SLURM_JOB_NODELIST"
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterator, List, Tuple, Union

from .errors import ConfigError


def _split_top_level(nodelist: str) -> List[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"host list {nodelist!r} nests brackets; SLURM host lists do not")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"host list {nodelist!r} closes a bracket it never opened")
        elif ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"host list {nodelist!r} has an unclosed bracket")
    parts.append(nodelist[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_ranges(body: str, nodelist: str) -> List[Tuple[int, int, int]]:
    """A bracket body ``01-03,07`` as (low, high, width) triples, checked in full up front."""
    out = []
    for item in body.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ConfigError(f"host list {nodelist!r}: [{body}] holds {item!r}, not a number or LO-HI range")
        if sep and int(hi) < int(lo):
            raise ConfigError(f"host list {nodelist!r}: range {item!r} runs backwards")
        # the lower bound's digits fix the padding, as scontrol does
        out.append((int(lo), int(hi) if sep else int(lo), len(lo)))
    return out


def _expand_one(expr: str, nodelist: str) -> Iterator[str]:
    """All hosts of one expression such as ``rack[1-2]-n[01-04]``, leftmost group slowest, lazily."""
    pieces: List[Union[str, List[Tuple[int, int, int]]]] = []
    rest = expr
    while rest:
        i = rest.find("[")
        if i < 0:
            pieces.append(rest)
            break
        if i:
            pieces.append(rest[:i])
        j = rest.index("]", i)
        pieces.append(_parse_ranges(rest[i + 1:j], nodelist))
        rest = rest[j + 1:]

    def walk(k: int, prefix: str) -> Iterator[str]:
        if k == len(pieces):
            yield prefix
        elif isinstance(pieces[k], str):
            yield from walk(k + 1, prefix + pieces[k])
        else:
            for lo, hi, width in pieces[k]:
                for n in range(lo, hi + 1):
                    yield from walk(k + 1, prefix + str(n).zfill(width))

    return walk(0, "")


def iter_hostlist(nodelist: str) -> Iterator[str]:
    """Hosts of ``nodelist`` in order, lazily (a list of thousands of nodes is never built for first_host)."""
    if not nodelist or not nodelist.strip():
        raise ConfigError("the SLURM host list is empty; is SLURM_JOB_NODELIST set?")
    for expr in _split_top_level(nodelist.strip()):
        yield from _expand_one(expr, nodelist)


def expand_hostlist(nodelist: str) -> List[str]:
    """Every host of a compressed SLURM host list, in SLURM's order."""
    return list(iter_hostlist(nodelist))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: where rank 0 of a block-distributed step runs."""
    return next(iter_hostlist(nodelist))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedhpc.hostlist", description="Expand a SLURM host list.")
    p.add_argument("nodelist")
    p.add_argument("--first", action="store_true", help="print only the first host (the rendezvous)")
    args = p.parse_args(argv)
    try:
        hosts = [first_host(args.nodelist)] if args.first else expand_hostlist(args.nodelist)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print("\n".join(hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
