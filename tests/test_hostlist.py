"""fedhpc/hostlist.py: SLURM's compressed host-list syntax, checked against lists written out by hand."""

import itertools
import subprocess
import sys

import pytest

from conftest import REPO
from fedhpc.errors import ConfigError
from fedhpc.hostlist import expand_hostlist, first_host, iter_hostlist


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
    ("cn1", ["cn1"]),
    ("cn1,cn2,login-3", ["cn1", "cn2", "login-3"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),                 # no padding: widths grow
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),              # the lower bound's padding is kept
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),  # two bracket groups: leftmost slowest
    ("r[1-2]-gpu[3,5]x", ["r1-gpu3x", "r1-gpu5x", "r2-gpu3x", "r2-gpu5x"]),
    ("a[1],b[2-3],c", ["a1", "b2", "b3", "c"]),
    (" node[1-2] ", ["node1", "node2"]),
])
def test_expand(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


def test_expansion_matches_a_brute_force_product():
    """Three bracket groups, each with ranges and singles, against itertools written out here."""
    racks, nodes, gpus = ["1", "2", "4"], [f"{i:02d}" for i in (1, 2, 3, 10, 11)], ["0", "1"]
    expected = [f"r{a}n{b}g{c}" for a, b, c in itertools.product(racks, nodes, gpus)]
    assert expand_hostlist("r[1-2,4]n[01-03,10-11]g[0-1]") == expected


def test_first_host_does_not_expand_the_whole_list():
    it = iter_hostlist("n[0000001-9999999]")
    assert next(it) == "n0000001" and next(it) == "n0000002"
    assert first_host("big[000001-999999],other") == "big000001"


@pytest.mark.parametrize("bad, words", [
    ("node[01-03", "unclosed"), ("node01-03]", "never opened"), ("node[[1]]", "nest"),
    ("node[a-b]", "not a number"), ("node[5-2]", "backwards"), ("node[1-]", "not a number"), ("", "empty"),
])
def test_malformed_lists_are_refused_by_name(bad, words):
    with pytest.raises(ConfigError, match=words):
        expand_hostlist(bad)


def test_command_line():
    p = subprocess.run([sys.executable, "-m", "fedhpc.hostlist", "gpu-a[1-2],node[07]"], cwd=REPO,
                       capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.split() == ["gpu-a1", "gpu-a2", "node07"]
    p = subprocess.run([sys.executable, "-m", "fedhpc.hostlist", "--first", "node[3-4]"], cwd=REPO,
                       capture_output=True, text=True)
    assert p.stdout.strip() == "node3"
    p = subprocess.run([sys.executable, "-m", "fedhpc.hostlist", "node[3-"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 2 and "unclosed" in p.stderr
